#!/usr/bin/env bash
# Round 8g, lead (issue #4): the swapped (M <= 8) two-block kernels need 8 pipeline steps per block, not 7
# (TWO_BLOCKS_MIN_STEPS_SWAP), from sweep r8b's 8192^2 M = 1 cell: on the bench shapes only 8192^2 M <= 8 changes (to
# one block, 6 stages, the aligned 128 grid). A/B against HEAD's policy (artifacts/r8g_old; same kernels), u4b8 and
# u4 + zero points, M = 1, 2, 4, 8, 16 (16: unchanged, a control). Another K split: bits may differ from old's.
#   usage (device machine, repo root; carry .whl and artifacts/r8g_old):  RET=$OUT bash bench/device_runs/gpu_r8g_policy.sh
set -u
. bench/device_runs/device_env.sh
timeout 90 python3 bench/ab_gemm.py --out "$OUT/ab" --old-dir artifacts/r8g_old --variants new,old --m 1,2,4,8,16 \
  --shapes 8192x8192 --no-tinygemm --labels "u4b8 g128 fp16,u4 g128+zp fp16" > "$OUT/ab.log" 2>&1; echo "ab rc=$?"
grep -hE "\[(new|old)\]" "$OUT/ab.log" | cut -c1-110
pack r8g
