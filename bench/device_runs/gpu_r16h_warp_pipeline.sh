#!/usr/bin/env bash
# Round 16h, lead (issue #4): the per-warp pipeline (marlin_gemm.cu kWarpFetch: one 64-column tile, one m16 block,
# K_WARP >= 2, one block per SM; each warp fetches what it reads and waits for its own copies, no block barrier per
# stage). r16g's nobar ablation bounds it: u4b8 fp16 4096^2 M = 1 5.81 -> 5.50 us, 14336x4096 M = 16 13.27 -> 11.92.
# The arithmetic is unchanged, so every output must be bitwise HEAD's. tests/gpu and the partition check against
# HEAD's files, then bench/ab_gemm.py new vs old on the layers with such kernels (4096^2, 14336x4096: the 512 x 64
# pairs, FP8's 256 x 64) and one without (8192^2), every bench label, M = 1, 8, 16; then bench_gemm's full grid
# (BENCH_COMMIT from the caller). Prediction: most of nobar's gain where the ring is the 512 x 64 tile's.
# Before the call:  bash bench/device_runs/make_old.sh artifacts/r16h_old
#   usage (device machine, repo root; carry .whl, artifacts/r16h_old):
#     BENCH_COMMIT=<rev> RET=$OUT bash bench/device_runs/gpu_r16h_warp_pipeline.sh
set -u
. bench/device_runs/device_env.sh
tier_and_partition artifacts/r16h_old r16h || { echo "TESTS FAILED"; exit 1; }
timeout 150 python3 bench/ab_gemm.py --out "$OUT/ab" --old-dir artifacts/r16h_old --m 1,8,16 \
  --shapes 4096x4096,14336x4096,8192x8192 --variants new,old --no-tinygemm > "$OUT/ab.log" 2>&1
echo "ab rc=$?"; grep -E "\[(new|old)\]|bitwise" "$OUT/ab.log" | sed -E 's/ +/ /g' | cut -c1-64; pack r16h
gemm_grid r16h
