#!/usr/bin/env bash
# Round 15a, lead (issue #4, session 12): where the time of the cells still under the ×2.5 bar goes at HEAD (after
# r14k), by taking parts out (bench/ablation_probe.py; the variants compute wrong results on purpose, timed only).
# Read floors (bench/floor_probe.py, 2026-11-29): 4-bit 4096² 3.70 µs, 4096×14336 / 14336×4096 8.6 µs; bars: 4096²
# 5.35 µs, 4096×14336 M = 16 ~12.0, 14336×4096 M = 16 ~12.8.
#   usage (device machine, repo root; carry .whl):  RET=$OUT bash bench/device_runs/gpu_r15a_ablation.sh
set -u
. bench/device_runs/device_env.sh
CELLS="4096x4096:u4b8 g128 fp16:1,4096x4096:u4b8 g128 fp16:16,14336x4096:u4b8 g128 fp16:16"
CELLS="$CELLS,4096x14336:u4b8 g128 fp16:16"
timeout 560 python3 bench/ablation_probe.py --out "$OUT/ablation" --cells "$CELLS" \
  --variants base,sinkfinish,nocompute,nocompute_nofinish,nowait_nobar,noB > "$OUT/ablation.log" 2>&1
echo "ablation rc=$?"; tail -40 "$OUT/ablation.log"; pack r15a
