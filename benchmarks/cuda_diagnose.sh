#!/usr/bin/env bash
# Issue 24 on a GPU lease: why the Transformer's block ratio grows with the block's length on
# an H100, and the CUDA behaviours nobody had seen on a device. One script, parts time-limited:
#
#   1. benchmarks/step_windows.py: the Transformer on CUDA, 2,000-iteration blocks, untracked,
#      track() and watch() interleaved, step time per 200-iteration window, GC, allocator;
#   2. py-spy (carried as a wheel in .whl/, when there) over one untracked and one watch() run,
#      raw stacks, to see what the extra time is;
#   3. benchmarks/cuda_extras.py: hand-updated loop, pinned memory, resident memory;
#   4. the suite's CUDA tests.
#
#   OUT=/tmp/diag bash benchmarks/cuda_diagnose.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-cuda-diagnose-out}
PY=${PY:-python3}
. benchmarks/gpu_machine.sh
SPY=""
if ls .whl/py_spy-*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --target /tmp/spy .whl/py_spy-*.whl \
        && SPY=/tmp/spy/bin/py-spy
fi

echo "== step windows"
timeout "${WINDOWS_LIMIT:-200}" "$PY" benchmarks/step_windows.py --device cuda \
    --iterations "${N:-2000}" --rounds "${ROUNDS:-2}" --json "$OUT/windows.json" 2>&1 \
    | tee "$OUT/windows.log"

if [ -n "$SPY" ]; then
    echo "== py-spy"
    for mode in baseline watch; do
        timeout 90 "$SPY" record -r 250 -f raw --nonblocking -o "$OUT/spy-$mode.txt" -- \
            "$PY" benchmarks/step_windows.py --device cuda --iterations "${N:-2000}" \
            --rounds 1 --warmup 50 --modes "$mode" 2>&1 | tail -3
    done
fi

echo "== CUDA extras"
timeout 120 "$PY" benchmarks/cuda_extras.py 2>&1 | tee "$OUT/extras.log"

echo "== CUDA tests"
timeout "${TESTS_LIMIT:-150}" "$PY" -m pytest -q -m cuda -p no:cacheprovider -o addopts="" \
    tests/test_backends.py tests/test_scenarios.py tests/test_plugin.py tests/test_snapshot.py \
    tests/test_tracker.py -rs 2>&1 | tee "$OUT/cuda-tests.log" | tail -15
