#!/usr/bin/env bash
# Round 7c, lead (issue #4): the dense main loop split into one stage loop per slice segment (the slice finishing
# after it instead of under a branch inside it), after the ablation found the finishing's mere presence in the loop
# costing ~10 us on 8192x28672 M = 1 (bench/NOTES_gemm.md "Round 7"). Same operations in the same order: outputs must
# be bitwise = HEAD. Tests (tests/gpu/test_gemm.py, test_moe.py, partition check) by gpu_r6_kernels.sh with HEAD's
# copies in artifacts/r7c_old; then one A/B (u4b8 fp16 M = 1, 8, 16 and FP8 M = 1 on the six layers).
# Ran in session 5 with the two patches (dense; the fused MoE's item loop) applied to 68631ad and 68631ad's files in
# artifacts/r7c_old; the change landed in d3fd847. Any later kernel change can be checked the same way: HEAD's files
# (gemm.py, moe.py, kernels_cuda/*) in artifacts/r7c_old, the changed tree checked out.
#   usage (device machine, repo root; carry .whl and artifacts/r7c_old = HEAD's gemm.py, moe.py, kernels_cuda/*;
#   AB_OLD=<dir> names another copy)
set -u
OLD=${AB_OLD:-artifacts/r7c_old}
OUT=${OUT:-$PWD/artifacts/gpu_out}
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-$PWD/artifacts/cupy_cache}
SKIP_AB=1 R6_KERNELS_OLD="$OLD" bash bench/device_runs/gpu_r6_kernels.sh || exit 1
timeout 60 python3 bench/ab_gemm.py --out "$OUT/ab" --old-dir "$OLD" --variants new,old --m 1,8,16 \
  --no-tinygemm --labels "u4b8 g128 fp16" > "$OUT/ab.log" 2>&1; echo "ab rc=$?"
timeout 40 python3 bench/ab_gemm.py --out "$OUT/ab8" --old-dir "$OLD" --variants new,old --m 1 \
  --no-tinygemm --labels "fe4m3fn" > "$OUT/ab8.log" 2>&1; echo "ab8 rc=$?"
timeout 30 python3 bench/bench_moe.py --out "$OUT/ab_moe" --ab-old "$OLD" --m 1,8,64 --reps 15 \
  --variants new > "$OUT/ab_moe.log" 2>&1; echo "ab moe rc=$?"; tail -14 "$OUT/ab_moe.log"
grep -E "\[(new|old)\]|bitwise" "$OUT/ab.log" "$OUT/ab8.log" | sed 's/^.*log://' | paste - - - | awk '{print}' | cut -c1-200
