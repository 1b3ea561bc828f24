#!/usr/bin/env bash
# Round 18d, lead (issue #4, session 15): r18c found the 512 x 128 tile 4.9% faster than the default on u4b8 fp16
# 4096x14336 M = 16 (2,8,3,b1 12.41 vs 2,4,6,b1 13.05 µs). The same tile (stages 3 / 4, every grid kind) beside each
# default on the other 4-bit M = 16 cells and the M = 8 ones, for a policy. ~4 min.
#   usage (device machine, repo root; carry .whl):  RET=$OUT bash bench/device_runs/gpu_r18d_k512_wide_cells.sh
set -u
. bench/device_runs/device_env.sh
timeout 300 python3 bench/sweep_gemm.py --out "$OUT/sweep" --cells 16,17,19,26,27,12,13,14,15,0,1,24,25 \
  --thread-shapes 2x8 --stages 3,4 --budget-s 280 > "$OUT/sweep.log" 2>&1; echo "sweep rc=$?"
grep -A16 "^| cell" "$OUT/sweep.log" | head -17; pack r18d
