#!/usr/bin/env bash
# Round 14b (issue #4): 4-bit pairs on the 512 x 64 tile before 256 x 64 (gemm.FOUR_BIT_PAIR_SHAPES, after sweep
# r14a). The GPU tier (its bench-shape file now also checks u4 + zero points and bf16 on 14336x4096, whose policy
# changed too) beside the partition check against OLD (HEAD before the change), then the A/B on the layers the rule
# touches (4096^2, 14336x4096), every 4-bit bench type, M = 1, 8, 16.
#   usage (device machine, repo root; carry .whl, artifacts/r14_old):
#     RET=$OUT bash bench/device_runs/gpu_r14b_k512_pairs.sh
set -u
. bench/device_runs/device_env.sh
tier_and_partition artifacts/r14_old r14b || { echo "TESTS FAILED"; exit 1; }
timeout 200 python3 bench/ab_gemm.py --out "$OUT/ab" --old-dir artifacts/r14_old --m 1,8,16 \
  --shapes 4096x4096,14336x4096 --labels "u4b8,u4 g128" --variants new,old --no-tinygemm > "$OUT/ab.log" 2>&1
echo "ab rc=$?"; tail -40 "$OUT/ab.log" | cut -c1-200; pack r14b
