#!/usr/bin/env bash
# Round 18h, lead (issue #4, session 15; prepared, not run: the session's device time was spent): where 4096^2 M = 64
# still goes after 683419a's shared slice sum (r18g: 25.5 -> 19.4 µs, half of what was predicted). Variants (timing
# only): nosum (every block writes C as if it held its slice alone: no slots, count or cross-block sum), nofold,
# sinkfinish (no finish at all), beside base, on three M = 64 layers and M = 128 on 4096^2; then the sweep's M = 32 /
# 64 cells (added in round 18: only the policy's tiles had run there; every tile, stages and grid kind). ~6 min.
#   usage (device machine, repo root; carry .whl):  RET=$OUT bash bench/device_runs/gpu_r18h_m64_ablation.sh
set -u
. bench/device_runs/device_env.sh
CELLS="4096x4096:u4b8 g128 fp16:64,8192x8192:u4b8 g128 fp16:64,14336x4096:u4b8 g128 fp16:64"
CELLS="$CELLS,4096x4096:u4b8 g128 fp16:128"
timeout 300 python3 bench/ablation_probe.py --out "$OUT/ablation" --cells "$CELLS" \
  --variants base,nosum,nofold,sinkfinish > "$OUT/ablation.log" 2>&1
echo "ablation rc=$?"; grep -E "base|nosum|nofold|sinkfinish" "$OUT/ablation.log" | cut -c1-120; pack r18h
timeout 300 python3 bench/sweep_gemm.py --out "$OUT/sweep" --cells 32,33,34,35,36,37,38,39 --budget-s 270 \
  > "$OUT/sweep.log" 2>&1; echo "sweep rc=$?"
grep -A10 "^| cell" "$OUT/sweep.log" | head -11; pack r18h
