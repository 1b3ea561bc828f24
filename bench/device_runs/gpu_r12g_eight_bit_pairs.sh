#!/usr/bin/env bash
# Round 12g (issue #4): 8-bit two-block pairs at M = 9..16 (PAIR_TWO_BLOCK_EIGHT_BIT_ROWS; sweep r12f: FP8 4096x14336
# M = 16 20.05 -> 17.81 µs). A/B new / new-no8bitpairs (the policy before) / old (artifacts/r12_old, 67ebc83) on the
# six layers at M = 9, 16 for FP8 and u8b128 (only 4096x14336 changes; the rest are the control). The new configuration
# is a kernel instantiation the sweep checked against the fp32 reference; tests/gpu's shapes do not reach it.
#   usage (device machine, repo root; carry .whl, artifacts/r12_old):
#     RET=$OUT bash bench/device_runs/gpu_r12g_eight_bit_pairs.sh
set -u
. bench/device_runs/device_env.sh
timeout 150 python3 bench/ab_gemm.py --out "$OUT/ab" --old-dir artifacts/r12_old --variants new,new-no8bitpairs,old \
  --m 9,16 --no-tinygemm --labels "fe4m3fn chan fp16,u8b128 g128 fp16" > "$OUT/ab.log" 2>&1; echo "ab rc=$?"
grep -hE "\[new|  new vs old" "$OUT/ab.log" | cut -c1-100; pack r12g
