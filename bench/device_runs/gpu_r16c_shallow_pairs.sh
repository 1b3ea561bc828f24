#!/usr/bin/env bash
# Round 16c, lead (issue #4): the policy from sweeps r16a / r16b. One-block pairs start from 3 stages (gemm.PAIR_STAGES:
# 4-bit 512 x 64 and 256 x 128 tiles, 8-bit 256 x 128), and one-block swapped kernels take the slice-aligned grid up
# to 20% longer (gemm.ALIGNED_MAX_LONGER_SWAP: 8-bit 8192x28672 M <= 8, 112 blocks instead of 132). Kernels unchanged.
# tests/gpu (its bench-shape tests run the new choices), the partition check, then bench/ab_gemm.py new vs HEAD's
# policy on every layer the change touches, every bench label (bf16 and zero points were not in the sweeps), M = 1,
# 8, 16. Prediction: the sweep's gains on u4b8 / FP8 / u8b128 fp16 (2-9%), bf16 and zero points unknown.
# Before the call:  bash bench/device_runs/make_old.sh artifacts/r16c_old
#   usage (device machine, repo root; carry .whl, artifacts/r16c_old):
#     RET=$OUT bash bench/device_runs/gpu_r16c_shallow_pairs.sh
set -u
. bench/device_runs/device_env.sh
tier_and_partition artifacts/r16c_old r16c || { echo "TESTS FAILED"; exit 1; }
timeout 280 python3 bench/ab_gemm.py --out "$OUT/ab" --old-dir artifacts/r16c_old --m 1,8,16 \
  --shapes 4096x4096,14336x4096,8192x8192,28672x8192,8192x28672 --variants new,old --no-tinygemm > "$OUT/ab.log" 2>&1
echo "ab rc=$?"; grep -E "\[(new|old)\]" "$OUT/ab.log" | sed -E 's/ +/ /g' | cut -c1-80; pack r16c
