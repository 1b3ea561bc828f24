#!/usr/bin/env bash
# Round 14c (issue #4): the 512 x 128 tile ((n_tiles, k_warp) = (2, 8), new in gemm._THREAD_SHAPES, in no policy
# order) beside the default in the sweep of the u4b8 cells whose first tile is 256 x 128: 4096x14336, 8192^2,
# 8192x28672, 28672x8192 at M = 1 and 16 (after r14a: 512 x 64 before 256 x 64 gained 7% on 14336x4096).
#   usage (device machine, repo root; carry .whl):  RET=$OUT bash bench/device_runs/gpu_r14c_k512_wide.sh
set -u
. bench/device_runs/device_env.sh
timeout 470 python3 bench/sweep_gemm.py --out "$OUT/sweep" --cells 6,18,1,17,24,25,26,27 --thread-shapes 2x8 \
  --budget-s 440 > "$OUT/sweep.log" 2>&1; echo "sweep rc=$?"
grep -A12 "^| cell" "$OUT/sweep.log" | head -14; grep -E "^\| [0-9]+ .*\| 2,8," "$OUT/sweep.log" | head -40; pack r14c
