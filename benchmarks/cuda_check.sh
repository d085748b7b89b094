#!/usr/bin/env bash
# The checks that need a CUDA GPU, as one script for a short lease of a GPU machine:
#
#   1. the test suite's CUDA tests (``-m cuda``), then the whole suite on that machine
#      (a CPU model on a machine that has a GPU must be measured on the CPU, as before);
#   2. the bundled sample on the GPU, under ``memsentry run`` and ``memsentry run --watch``;
#   3. benchmarks/cost.py on the GPU: the tiny-step and MLP loops, and the Transformer step
#      over 2,000 iterations (baseline, track, watch, torch.profiler).
#
# Outputs go to $OUT (default: ./cuda-check-out), seven files at most (a lease returns eight).
# Each part has its own time limit, so that one that hangs cannot take the others' time.
# On an H100 (2026-11-26) the first three parts took about 7 minutes: the machine's CPU runs
# the tiny loop at 1 ms a step, so keep ROUNDS low or FULL_SUITE=0 on a short lease.
#
#   OUT=/tmp/cuda bash benchmarks/cuda_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-cuda-check-out}
PY=${PY:-python3}
. benchmarks/gpu_machine.sh

echo "== CUDA tests"
timeout 240 "$PY" -m pytest -q -m cuda -p no:cacheprovider -o addopts="" \
    tests/test_backends.py tests/test_scenarios.py tests/test_plugin.py tests/test_snapshot.py \
    tests/test_tracker.py -rs 2>&1 | tee "$OUT/cuda-tests.log" | tail -25

echo "== sample on the GPU"
{
    timeout 120 "$PY" -m memsentry run samples/train_leaky.py --steps 20 --device cuda
    echo "exit $?"
    timeout 120 "$PY" -m memsentry run --watch samples/train_leaky.py --steps 20 --device cuda
    echo "exit $?"
    timeout 120 "$PY" -m memsentry run samples/train_fixed.py --steps 20 --device cuda
    echo "exit $?"
} >"$OUT/sample.log" 2>&1
grep -E "^ *(LEAK|WASTE|HINT) |^exit|^memsentry:" "$OUT/sample.log" | head -30

echo "== cost on the GPU"
timeout 300 "$PY" benchmarks/cost.py --device cuda --loops tiny,mlp --rounds 5 \
    --modes track,watch,profiler --json "$OUT/cost-cuda-small.json" 2>>"$OUT/cost.err"
timeout 400 "$PY" benchmarks/cost.py --device cuda --loops transformer --iterations 2000 \
    --rounds "${ROUNDS:-3}" --modes track,watch --json "$OUT/cost-cuda-transformer.json" \
    2>>"$OUT/cost.err"

if [ "${FULL_SUITE:-1}" = 1 ]; then
    echo "== whole suite on the GPU machine"
    timeout "${SUITE_LIMIT:-240}" "$PY" -m pytest -q -n 12 -p no:cacheprovider -o addopts="" \
        --deselect tests/test_architecture.py 2>&1 | tee "$OUT/suite.log" | tail -30
fi
