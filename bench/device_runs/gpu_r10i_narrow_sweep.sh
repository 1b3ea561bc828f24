#!/usr/bin/env bash
# Round 10i, lead (issue #4): the whole configuration sweep (every tile, blocks per SM, stages, grid, cluster size)
# of the 4096-wide u4b8 layers at M = 1 after late scaling (bdc99e8): 4096^2 (tinygemm still faster at M <= 2),
# 14336x4096 and 4096x14336 (x2.2, the x2.5 bar out of reach of the default).
#   usage (device machine, repo root; carry .whl):  RET=$OUT bash bench/device_runs/gpu_r10i_narrow_sweep.sh
set -u
. bench/device_runs/device_env.sh
timeout 280 python3 bench/sweep_gemm.py --out "$OUT/sweep" --cells 0,7,6 --budget-s 250 > "$OUT/sweep.log" 2>&1
echo "sweep rc=$?"; grep -A5 "^| cell" "$OUT/sweep.log" | head -7; grep -A10 "^| rank" "$OUT/sweep.log" | head -40
pack r10i
