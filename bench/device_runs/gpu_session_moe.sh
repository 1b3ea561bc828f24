#!/usr/bin/env bash
# One GPU-machine session for MoE: tests/gpu/test_moe.py, then bench/bench_moe.py (issue 7).
#   usage (device machine, repo root):  bash bench/device_runs/gpu_session_moe.sh [--quick]
# Logs and results go to $OUT (default ./artifacts/gpu_out).
set -u
OUT=${OUT:-$PWD/artifacts/gpu_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
export CUPY_CACHE_DIR=$PWD/artifacts/cupy_cache NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0 NUMBA_CUDA_WARN_ON_IMPLICIT_COPY=0
QUICK=""
[ "${1:-}" = "--quick" ] && QUICK="--quick"
start=$(date +%s)
timeout ${TEST_TIMEOUT:-240} python3 -m pytest -p no:cacheprovider -q -rs -x --maxfail=10 tests/gpu/test_moe.py \
  > "$OUT/moe_tests.log" 2>&1
echo "pytest rc=$? in $(( $(date +%s) - start ))s" | tee -a "$OUT/moe_tests.log"
tail -60 "$OUT/moe_tests.log"
start=$(date +%s)
timeout ${BENCH_TIMEOUT:-200} python3 bench/bench_moe.py --out "$OUT/bench" $QUICK > "$OUT/moe_bench.log" 2>&1
echo "bench rc=$? in $(( $(date +%s) - start ))s" | tee -a "$OUT/moe_bench.log"
tail -40 "$OUT/moe_bench.log"
