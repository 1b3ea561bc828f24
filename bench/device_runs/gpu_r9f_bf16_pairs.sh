#!/usr/bin/env bash
# Round 9f, lead (issue #4): is the pair policy's long-range exception (one block per SM, 56 steps, clusters of two)
# a loss for u4b8 bf16 on 28672x8192 at M <= 8, as the round 9e grid suggests against d5752a2's (+2.5%, separate
# runs)? A/B in one run: new (the exception for fp16 only: bf16 back on two blocks per SM) vs old = 1030a5c
# (artifacts/r9f_old: bf16 on pairs); fp16 as the control (same config in both); FP8 / u8b128 M = 8 (+4-8% in the 9e
# grid with an unchanged kernel and grid: noise?).
#   usage (device machine, repo root; carry .whl, artifacts/r9f_old):  RET=$OUT bash bench/device_runs/gpu_r9f_bf16_pairs.sh
set -u
. bench/device_runs/device_env.sh
OLD=${AB_OLD:-artifacts/r9f_old}
timeout 60 python3 -m pytest -p no:cacheprovider -q tests/gpu/test_gemm_bench_shapes.py -k "28672" > "$OUT/tests.log" 2>&1
echo "tests rc=$?"; tail -1 "$OUT/tests.log"
timeout 90 python3 bench/ab_gemm.py --out "$OUT/ab" --old-dir "$OLD" --variants new,old --m 1,2,4,8 --no-tinygemm \
  --shapes 28672x8192 --labels "u4b8 g128,fe4m3fn,u8b128" > "$OUT/ab.log" 2>&1; echo "ab rc=$?"
grep -hE "\[(new|old)\]|bitwise" "$OUT/ab.log" | cut -c1-100; pack r9f
