#!/usr/bin/env bash
# Round 17b, lead (issue #4, session 14; run at 0cd5451 with the variants below, since landed: NOTES_gemm.md round
# 17 item 3; bench/ab_gemm.py now has new-r16pairs for the old rules, and this script times it). Policy variants the
# per-warp pipeline for two tiles (r16i) may have turned, timed against HEAD's policy on the same kernels.
# new-longpairs: one-block pairs past PAIR_MAX_STEPS for bf16 and zero points (28672x8192 M <= 16, two blocks per SM
# then; the zero-point two-block kernel spills 16 bytes); new-bf16two: bf16 in the swapped two-block
# pairs (4096x14336 M <= 8, one block of 6 stages on 112 today); new-stages4: 4 stages first for one-block 4-bit
# kernels outside pairs (4096x14336 zp / bf16 M <= 16 and u4b8 M = 16; sweep r17a: u4b8 M = 16 6 -> 4 stages 13.07 ->
# 12.79, swapped M = 1 11.50 -> 11.21). ~2 min.
#   bash bench/device_runs/make_old.sh artifacts/r17b_old   (here, before the call)
#   usage (device machine, repo root; carry .whl, artifacts/r17b_old):
#     RET=$OUT bash bench/device_runs/gpu_r17b_policy_pairs.sh
set -u
. bench/device_runs/device_env.sh
timeout 400 python3 bench/ab_gemm.py --out "$OUT/ab_gemm" --old-dir artifacts/r17b_old --m 1,8,16 \
  --shapes 4096x14336,28672x8192 --labels "u4 g128+zp,bf16,u4b8 g128 fp16" \
  --variants new,old,new-r16pairs,new-stages4 --no-tinygemm > "$OUT/ab.log" 2>&1
echo "ab rc=$?"; python3 bench/ab_summary.py "$OUT" | cut -c1-160; pack r17b
