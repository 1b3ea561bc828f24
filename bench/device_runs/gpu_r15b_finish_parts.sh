#!/usr/bin/env bash
# Round 15b, lead (issue #4, session 12): the parts of the cluster finish that r15a's sinkfinish took out (0.95 µs of
# 5.96 on 4096² M = 1, 1.5 of 6.44 at M = 16): nofold_cluster (no warp fold), localsum (the cross-block sum on the
# block's own partial, block barriers instead of cluster barriers). Timed only (wrong results on purpose).
#   usage (device machine, repo root; carry .whl):  RET=$OUT bash bench/device_runs/gpu_r15b_finish_parts.sh
set -u
. bench/device_runs/device_env.sh
CELLS="4096x4096:u4b8 g128 fp16:1,4096x4096:u4b8 g128 fp16:16,14336x4096:u4b8 g128 fp16:16"
CELLS="$CELLS,4096x14336:u4b8 g128 fp16:16"
timeout 560 python3 bench/ablation_probe.py --out "$OUT/ablation" --cells "$CELLS" \
  --variants base,sinkfinish,nofold_cluster,localsum,nofinish > "$OUT/ablation.log" 2>&1
echo "ablation rc=$?"; tail -40 "$OUT/ablation.log"; pack r15b
