#!/usr/bin/env bash
# Round 19f, lead (issue #4, session 16): where the two cells still short of the INT4 x2.5 bar go after the trimmed
# prologue (grid r19e at ca5b326: u4b8 fp16 4096^2 M = 16 5.55 µs, x2.46; 4096x14336 M = 16 12.14 µs, x2.47), and
# r18h's M = 64 ablation (prepared in session 15, not run), its sweep left out. Timing only. ~6 min.
#   usage (device machine, repo root; carry .whl):  RET=$OUT bash bench/device_runs/gpu_r19f_ablation.sh
set -u
. bench/device_runs/device_env.sh
CELLS="4096x4096:u4b8 g128 fp16:16,4096x14336:u4b8 g128 fp16:16"
timeout 170 python3 bench/ablation_probe.py --out "$OUT/ablation16" --cells "$CELLS" \
  --variants base,sinkfinish,nocompute,noB,nowait_nobar > "$OUT/ablation16.log" 2>&1
echo "ablation16 rc=$?"; pack r19f
CELLS="4096x4096:u4b8 g128 fp16:64,8192x8192:u4b8 g128 fp16:64,14336x4096:u4b8 g128 fp16:64"
timeout 200 python3 bench/ablation_probe.py --out "$OUT/ablation64" --cells "$CELLS" \
  --variants base,nosum,nofold,sinkfinish > "$OUT/ablation64.log" 2>&1
echo "ablation64 rc=$?"; pack r19f
