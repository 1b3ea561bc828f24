#!/usr/bin/env bash
# Round 14a (issue #4): the 512 x 64 tile ((n_tiles, k_warp) = (1, 4), new in gemm._THREAD_SHAPES, in no policy
# order) beside the default in the sweep of the cells still short of the INT4 x2.5 bar (u4b8 4096^2 M = 1, 8, 16;
# 14336x4096 M = 1, 16; 4096x14336 M = 16) and FP8 4096^2 / 14336x4096 M = 1. Round 11 found 256 x 64 faster than
# 128 x 64 on 4096-column layers (half the stages of twice the bytes); this asks whether halving them again helps.
# Every candidate is checked against the fp32 reference bound before it is timed (sweep_gemm.py).
#   usage (device machine, repo root; carry .whl):  RET=$OUT bash bench/device_runs/gpu_r14a_k512_tile.sh
set -u
. bench/device_runs/device_env.sh
timeout 470 python3 bench/sweep_gemm.py --out "$OUT/sweep" --cells 0,12,16,7,19,18,28,30 --thread-shapes 1x4 \
  --budget-s 440 > "$OUT/sweep.log" 2>&1; echo "sweep rc=$?"
grep -A12 "^| cell" "$OUT/sweep.log" | head -14; grep -E "^\| [0-9]+ .*\| 1,4," "$OUT/sweep.log" | head -40; pack r14a
