#!/usr/bin/env bash
# Round 17d, lead (issue #4, session 14): the per-warp pipeline (one or two tiles, K_WARP >= 2) covers the 128 x 128
# and 256 x 64 tiles too, which no sweep has timed with it (nor the 256 x 64 tile with 3 stages). The sweep over the
# four tiles that can run it, stages 3 / 4 / 6, on the cells still short of the INT4 x2.5 bar: 4096x14336 M = 16,
# 4096^2 M = 16, 1 and 8. ~5 min.
#   usage (device machine, repo root; carry .whl):  RET=$OUT bash bench/device_runs/gpu_r17d_shapes_sweep.sh
set -u
. bench/device_runs/device_env.sh
timeout 330 python3 bench/sweep_gemm.py --out "$OUT/sweep" --cells 18,16,0,12 --thread-shapes 1x2,2x2,1x4,2x4 \
  --stages 3,4,6 --budget-s 300 > "$OUT/sweep.log" 2>&1; echo "sweep rc=$?"
grep -A6 "^| cell" "$OUT/sweep.log" | head -7; pack r17d
