#!/usr/bin/env bash
# Round 16j, lead (issue #4; prepared in session 13, run in session 14 with r16i applied: no change,
# NOTES_gemm.md round 16 item 12). Round 16's stage orders (3 first for one-block pairs,
# sweep r16b) were measured with a block barrier per stage; the per-warp pipeline (92b3b6c) lets each warp's stages
# land and run on their own, so the best depth may have moved. The near-default sweep of the cells still short of the
# INT4 x2.5 bar and their neighbours, one-block stages 2, 3, 4, 5, 6 (every candidate checked against the fp32
# bound). Run after r16i if that patch lands (its two-tile kernels are the 8192^2 / 4096x14336 defaults). ~1 min.
#   usage (device machine, repo root; carry .whl):  RET=$OUT bash bench/device_runs/gpu_r16j_stage_depth_warp.sh
set -u
. bench/device_runs/device_env.sh
timeout 300 python3 bench/sweep_gemm.py --out "$OUT/sweep" --cells 0,12,16,7,19,18,1,17 --near-default \
  --stages 2,3,4,5,6 --budget-s 270 > "$OUT/sweep.log" 2>&1; echo "sweep rc=$?"
grep -A10 "^| cell" "$OUT/sweep.log" | head -11; pack r16j
