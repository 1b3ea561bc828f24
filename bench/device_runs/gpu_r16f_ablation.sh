#!/usr/bin/env bash
# Round 16f, lead (issue #4): r15a's ablation again at the 3-stage pairs (b9cc582's policy), on the 4096^2 cells that
# still miss the INT4 x2.5 bar: where do 5.8 us go now? Variants compute wrong results on purpose and are only timed.
#   usage (device machine, repo root; carry .whl):  RET=$OUT bash bench/device_runs/gpu_r16f_ablation.sh
set -u
. bench/device_runs/device_env.sh
CELLS="4096x4096:u4b8 g128 fp16:1,4096x4096:u4b8 g128 fp16:16"
timeout 400 python3 bench/ablation_probe.py --out "$OUT/ablation" --cells "$CELLS" \
  --variants base,sinkfinish,nocompute,nocompute_nofinish,nowait_nobar,noB > "$OUT/ablation.log" 2>&1
echo "ablation rc=$?"; tail -20 "$OUT/ablation.log"; pack r16f
