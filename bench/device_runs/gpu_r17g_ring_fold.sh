#!/usr/bin/env bash
# Round 17g, lead (issue #4, session 14): the last slice of a one-block row-layout kernel without clusters folds its
# warps in the idle stage ring, every thread at work (gemm_block's kRingFold, fold_warps_in_ring), instead of
# fold_warps' passes. Ablation r17f put fold_warps at 0.38 us of u4b8 4096x14336 M = 16 and 2.83 of M = 32. Touches
# M = 32 on every layer (two m16 blocks, 256 x 128 tile), M = 16 on 4096x14336 (4-bit) and 8-bit M = 16 on the two
# large layers; the cluster kernels' SASS is unchanged, two-block kernels keep fold_warps (they spilled with it).
# Same tree, so every output must be bitwise HEAD's. Prediction: M = 32 -5..-10%, 4096x14336 M = 16 -1..-3%. ~6 min.
#   bash bench/device_runs/make_old.sh artifacts/r17g_old   (here, before the call)
#   usage (device machine, repo root; carry .whl, artifacts/r17g_old):
#     RET=$OUT bash bench/device_runs/gpu_r17g_ring_fold.sh
set -u
. bench/device_runs/device_env.sh
tier_and_partition artifacts/r17g_old r17g || { echo "TESTS FAILED"; exit 1; }
timeout 200 python3 bench/ab_gemm.py --out "$OUT/ab_gemm" --old-dir artifacts/r17g_old --m 16,32 \
  --variants new,old --no-tinygemm > "$OUT/ab.log" 2>&1
echo "ab rc=$?"; python3 bench/ab_summary.py "$OUT" | cut -c1-110; pack r17g
