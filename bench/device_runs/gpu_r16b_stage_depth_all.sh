#!/usr/bin/env bash
# Round 16b, lead (issue #4): r16a found 3 stages faster than the default 4 on the swapped 512 x 64 pairs (u4b8 fp16
# 4096^2 M = 1 6.01 -> 5.87 us, 14336x4096 M = 1 11.52 -> 11.25) and 5 slower. Does a shallower ring pay on every
# cell? The near-default sweep of all 32 cells with one-block stages 3, 4, 5, 6, 8, then the 256 x 64 tile beside the
# default on the 4096-column cells (M = 1, 8) with stages 3..6. Every candidate is checked against the fp32 bound.
#   usage (device machine, repo root; carry .whl):  RET=$OUT bash bench/device_runs/gpu_r16b_stage_depth_all.sh
set -u
. bench/device_runs/device_env.sh
timeout 330 python3 bench/sweep_gemm.py --out "$OUT/sweep" --cells all --near-default --stages 3,4,5,6,8 \
  --budget-s 300 > "$OUT/sweep.log" 2>&1; echo "sweep rc=$?"
grep -A34 "^| cell" "$OUT/sweep.log" | head -35; pack r16b
timeout 150 python3 bench/sweep_gemm.py --out "$OUT/sweep_k256" --cells 0,12,7,15 --thread-shapes 1x2 \
  --stages 3,4,5,6 --budget-s 130 > "$OUT/sweep_k256.log" 2>&1; echo "sweep k256 rc=$?"
grep -A6 "^| cell" "$OUT/sweep_k256.log" | head -7; grep -E "^(###|\| [1-4] )" "$OUT/sweep_k256.log" | cut -c1-100
pack r16b
