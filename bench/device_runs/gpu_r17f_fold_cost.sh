#!/usr/bin/env bash
# Round 17f, lead (issue #4, session 14): what the warp fold in passes costs the non-cluster row-layout kernels (the
# idea: fold the last slice in the idle stage ring with every thread, as r15c did for the cluster kernels). Variants
# nofold (fold_warps left out of finish_slice_inline) and sinkfinish, timing only, on u4b8 g128 fp16 4096x14336
# M = 16 (2 tiles x 4 k groups, 112 blocks) and M = 32 / 64 (two / four m16 blocks). ~1 min.
#   usage (device machine, repo root; carry .whl):  RET=$OUT bash bench/device_runs/gpu_r17f_fold_cost.sh
set -u
. bench/device_runs/device_env.sh
CELLS="4096x14336:u4b8 g128 fp16:16,4096x14336:u4b8 g128 fp16:32,4096x14336:u4b8 g128 fp16:64"
timeout 200 python3 bench/ablation_probe.py --out "$OUT/ablation" --cells "$CELLS" \
  --variants base,nofold,sinkfinish > "$OUT/ablation.log" 2>&1
echo "ablation rc=$?"; grep -E "base|nofold|sinkfinish" "$OUT/ablation.log" | cut -c1-120; pack r17f
