# Sourced by the scripts for a GPU lease (cuda_check.sh, cuda_diagnose.sh), from the repository
# root with OUT and PY set: writes what the machine is to $OUT/machine.txt and installs
# memsentry (editable: the pytest plugin and the console script; the machine has no package
# index, so nothing else is installed).
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
{
    date -u +"%Y-%m-%d %H:%M UTC"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    "$PY" -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda)"
    echo "$(nproc) CPUs"
} 2>&1 | tee "$OUT/machine.txt"
"$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . >>"$OUT/machine.txt" 2>&1 \
    || { echo "install failed"; tail -20 "$OUT/machine.txt"; exit 1; }
