#!/usr/bin/env bash
# Round 16g, lead (issue #4): how much of r16f's wait-and-barrier cost (nowait_nobar: 4096^2 M = 1 5.81 -> 5.05 us) is
# the block barrier alone? Variant nobar (the per-stage __syncthreads left out, each thread still waits for its own
# copies): the bound a per-warp pipeline could reach (NOTES_gemm "Round 16" item 5). Timing only, wrong results.
#   usage (device machine, repo root; carry .whl):  RET=$OUT bash bench/device_runs/gpu_r16g_nobar.sh
set -u
. bench/device_runs/device_env.sh
CELLS="4096x4096:u4b8 g128 fp16:1,4096x4096:u4b8 g128 fp16:8,4096x4096:u4b8 g128 fp16:16"
CELLS="$CELLS,14336x4096:u4b8 g128 fp16:1,14336x4096:u4b8 g128 fp16:16,8192x8192:u4b8 g128 fp16:1"
timeout 400 python3 bench/ablation_probe.py --out "$OUT/ablation" --cells "$CELLS" \
  --variants base,nobar,nowait_nobar > "$OUT/ablation.log" 2>&1
echo "ablation rc=$?"; tail -20 "$OUT/ablation.log" | cut -c1-130; pack r16g
