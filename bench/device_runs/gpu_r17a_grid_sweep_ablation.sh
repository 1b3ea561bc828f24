#!/usr/bin/env bash
# Round 17a, lead (issue #4, session 14): after the per-warp pipeline for two tiles (r16i) landed, three things in one
# call. (1) bench_gemm's grid at the landed commit (BENCH_COMMIT set by the caller). (2) The full sweep (tiles 256 x 128
# and 512 x 64, one or two blocks per SM, swap on / off / 16-row, stages 3 / 4 / 6) on the cells still short of the
# INT4 x2.5 bar and their neighbours: 4096x14336 M = 1, 8 (two blocks per SM today, which the per-warp pipeline does
# not cover), M = 16; 4096^2 M = 16; 14336x4096 M = 16. (3) Ablation of the rows-layout cells (where do the ~2 us that
# M = 16 costs over M = 8 go?) and 4096^2 M = 1. ~8 min.
#   usage (device machine, repo root; carry .whl):
#     BENCH_COMMIT=<rev> RET=$OUT bash bench/device_runs/gpu_r17a_grid_sweep_ablation.sh
set -u
. bench/device_runs/device_env.sh
gemm_grid r17a
timeout 220 python3 bench/sweep_gemm.py --out "$OUT/sweep" --cells 18,16,19,6,14 --thread-shapes 2x4,1x4 \
  --stages 3,4,6 --budget-s 180 > "$OUT/sweep.log" 2>&1; echo "sweep rc=$?"
grep -A6 "^| cell" "$OUT/sweep.log" | head -7
CELLS="4096x14336:u4b8 g128 fp16:16,14336x4096:u4b8 g128 fp16:16,4096x4096:u4b8 g128 fp16:1"
timeout 200 python3 bench/ablation_probe.py --out "$OUT/ablation" --cells "$CELLS" \
  --variants base,nobar,nowait_nobar,nocompute,sinkfinish,noB > "$OUT/ablation.log" 2>&1
echo "ablation rc=$?"; tail -12 "$OUT/ablation.log"; pack r17a
