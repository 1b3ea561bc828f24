#!/usr/bin/env bash
# Round 18c, lead (issue #4, session 15): the 512 x 128 tile (2 x 8: each warp's 128 rows per stage are one whole
# g128 group, so late scaling flushes half as often per weight) has not been swept since the per-warp pipeline
# (0cd5451, which takes it: two tiles, K_WARP >= 2); r14c had it at -1% on 4096x14336 M = 16. Beside the 256 x 128 and
# 512 x 64 tiles, stages 3 / 4 / 6, on the M = 16 cells short of the INT4 x2.5 bar. ~6 min with the ablation below.
#   usage (device machine, repo root; carry .whl):  RET=$OUT bash bench/device_runs/gpu_r18c_k512_wide_sweep.sh
set -u
. bench/device_runs/device_env.sh
timeout 260 python3 bench/sweep_gemm.py --out "$OUT/sweep" --cells 18,16 --thread-shapes 2x8,2x4,1x4 \
  --stages 3,4,6 --budget-s 230 > "$OUT/sweep.log" 2>&1; echo "sweep rc=$?"
grep -A6 "^| cell" "$OUT/sweep.log" | head -7; pack r18c
# Then where M = 64 goes (x0.46 of cuBLAS on 4096^2: 4 m16 blocks, the 64 x 256 tile, 8 blocks per slice summed
# through C_tmp by the slice's first block alone; ablation r17f saw 13.5 of 39.8 µs in 4096x14336 M = 64's finish).
CELLS="4096x4096:u4b8 g128 fp16:64,8192x8192:u4b8 g128 fp16:64,4096x14336:u4b8 g128 fp16:64"
timeout 200 python3 bench/ablation_probe.py --out "$OUT/ablation" --cells "$CELLS" \
  --variants base,nofold,sinkfinish,nocompute > "$OUT/ablation.log" 2>&1
echo "ablation rc=$?"; grep -E "base|nofold|sinkfinish|nocompute" "$OUT/ablation.log" | cut -c1-120; pack r18c
