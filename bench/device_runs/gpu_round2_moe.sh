#!/usr/bin/env bash
# Round 2, engineer "moe": GPU tests of the fused MoE kernel (split-K), then an A/B timing old (HEAD copies in
# artifacts/round2_moe_old/) vs new in one process. Run from the repo root on the H200 with $OUT set, the numpy wheel
# installed and PYTHONPATH exported (by the lead); carry artifacts/round2_moe_old. Logs/JSON under $OUT/moe/.
set -u
D=${OUT:-$PWD/artifacts/gpu_out}/moe
mkdir -p "$D"
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-$PWD/artifacts/cupy_cache} NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0 \
  NUMBA_CUDA_WARN_ON_IMPLICIT_COPY=0
start=$(date +%s)
timeout 120 python3 -m pytest -p no:cacheprovider -x -q -rs tests/gpu/test_moe.py > "$D/moe_tests.log" 2>&1
echo "moe pytest rc=$? in $(( $(date +%s) - start ))s" | tee -a "$D/moe_tests.log"
tail -5 "$D/moe_tests.log"
start=$(date +%s)
timeout 120 python3 bench/bench_moe.py --out "$D" --ab-old artifacts/round2_moe_old > "$D/ab_moe.log" 2>&1
echo "moe A/B rc=$? in $(( $(date +%s) - start ))s" | tee -a "$D/ab_moe.log"
grep -A20 "^| config" "$D/ab_moe.log" || tail -20 "$D/ab_moe.log"
