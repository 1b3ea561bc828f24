#!/usr/bin/env bash
# Round 8b, lead (issue #4): (1) the finishing inlined in the two-block M = 9..16 u4b8 kernels: tests/gpu test_gemm +
# test_moe, partition check bitwise = eb4ac32 (copies in artifacts/r8b_old), A/B u4b8 M = 16; (2) the configuration
# sweep (bench/sweep_gemm.py) on the 4096- and 8192-wide u4b8 cells, whose best configuration may have moved now that
# the slice finishing is cheaper (the policy came from the round-6 sweep).
#   usage (device machine, repo root, numpy wheel installed, PYTHONPATH exported; carry artifacts/r8b_old)
set -u
OUT=${OUT:-$PWD/artifacts/gpu_out}
OLD=${AB_OLD:-artifacts/r8b_old}
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-$PWD/artifacts/cupy_cache}
SKIP_AB=1 R6_KERNELS_OLD="$OLD" bash bench/device_runs/gpu_r6_kernels.sh || exit 1
timeout 60 python3 bench/ab_gemm.py --out "$OUT/ab16" --old-dir "$OLD" --variants new,old --m 16 \
  --no-tinygemm --labels "u4b8 g128 fp16" > "$OUT/ab16.log" 2>&1; echo "ab16 rc=$?"
grep -E "\[(new|old)\]|bitwise" "$OUT/ab16.log" | cut -c1-110
timeout 280 python3 bench/sweep_gemm.py --out "$OUT/sweep" --cells 1,17,0,6,7,16,18,19 --budget-s 250 \
  > "$OUT/sweep.log" 2>&1; echo "sweep rc=$?"
tail -40 "$OUT/sweep.log"
