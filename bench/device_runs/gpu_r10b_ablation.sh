#!/usr/bin/env bash
# Round 10b, lead (issue #4): where the time goes at HEAD (after round 9's cluster sums), by taking parts out
# (bench/ablation_probe.py; the variants compute wrong results on purpose and are only timed). noscale: the scale
# multiply of every dequantized pair left out, the most that applying scales after the mma could save.
#   usage (device machine, repo root; carry .whl):  RET=$OUT bash bench/device_runs/gpu_r10b_ablation.sh
set -u
. bench/device_runs/device_env.sh
CELLS="4096x4096:u4b8 g128 fp16:1,8192x8192:u4b8 g128 fp16:1,28672x8192:u4b8 g128 fp16:16"
CELLS="$CELLS,14336x4096:fe4m3fn chan fp16:1"
timeout 500 python3 bench/ablation_probe.py --out "$OUT/ablation" --cells "$CELLS" \
  --variants base,sinkfinish,nocompute_nofinish,nowait_nobar,noscale > "$OUT/ablation.log" 2>&1
echo "ablation rc=$?"; tail -30 "$OUT/ablation.log"; pack r10b
