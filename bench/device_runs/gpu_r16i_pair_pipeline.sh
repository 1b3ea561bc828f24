#!/usr/bin/env bash
# Round 16i, lead (issue #4; prepared in session 13, run and landed in session 14: NOTES_gemm.md round 16 item 11;
# the patch it applied is now in the tree). The per-warp
# pipeline of round 16 (kWarpFetch, landed for one 64-column tile) extended to two tiles
# (then bench/attic/gemm_r16i_pair_pipeline.patch): each warp copies its own tile's B rows (remapped), scales and zero
# points; the two warps of a k group together copy the A chunks and g_idx they share and meet at a named barrier of 64
# threads (bar.sync 1 + kg) instead of the block barrier. Touches every one-block kernel on the 256 x 128 tile:
# 8192^2 and 28672x8192 pairs, 4096x14336 M = 16 (the cell still short: x2.27, 13.80 us), FP8 / u8b128 8192^2.
# Arithmetic unchanged: every output must be bitwise HEAD's. Local checks: fetch_maps.cu's host check (B remap,
# scale / zero-point regions, both tile counts), the per-group A test, nvcc sm_90 no spills (115-222 registers).
# Prediction: 4096x14336 M = 16 -5..-10% (nobar on 14336x4096 gave -10%); 8192^2 M <= 8 -2..-5%.
# Before the call (it was run with the patch applied, HEAD b53ceb7 as old):
#   bash bench/device_runs/make_old.sh artifacts/r16i_old
#   usage (device machine, repo root; carry .whl, artifacts/r16i_old):
#     RET=$OUT bash bench/device_runs/gpu_r16i_pair_pipeline.sh
set -u
. bench/device_runs/device_env.sh
tier_and_partition artifacts/r16i_old r16i || { echo "TESTS FAILED"; exit 1; }
timeout 200 python3 bench/ab_gemm.py --out "$OUT/ab" --old-dir artifacts/r16i_old --m 1,8,16 \
  --shapes 4096x14336,8192x8192,28672x8192,4096x4096 --variants new,old --no-tinygemm > "$OUT/ab.log" 2>&1
echo "ab rc=$?"; grep -E "\[(new|old)\]|bitwise" "$OUT/ab.log" | sed -E 's/ +/ /g' | cut -c1-64; pack r16i
