#!/usr/bin/env bash
# Round 18g, lead (issue #4, session 15): the fp32 cross-block sum shared by every contributor of a slice held whole
# (slice_held_whole: always so on slice-aligned grids) instead of read by the first contributor alone; ablation r18c
# had 4096^2 M = 64 (8 blocks a slice, 64 x 256 partials) at 24.6 µs, 8.1 with the finish left out. Tier + partition
# check against HEAD (artifacts/r18g_old: make_old.sh at d0b800d; the partition's outputs must be bitwise HEAD's: the
# same sums in the same order), then the A/B at M = 16 / 32 / 64 on every layer. ~6 min.
#   usage (device machine, repo root; carry .whl and artifacts/r18g_old):
#     RET=$OUT bash bench/device_runs/gpu_r18g_shared_sum.sh
set -u
. bench/device_runs/device_env.sh
tier_and_partition artifacts/r18g_old r18g || { echo "TESTS FAILED"; exit 1; }
timeout 200 python3 bench/ab_gemm.py --out "$OUT/ab" --old-dir artifacts/r18g_old --m 16,32,64 \
  --labels "u4b8 g128 fp16,fe4m3fn chan fp16,u4 g128" --variants new,old --no-tinygemm > "$OUT/ab.log" 2>&1
echo "ab rc=$?"; grep -E "\[(new|old)\]|bitwise" "$OUT/ab.log" | sed -E 's/ +/ /g' | cut -c1-80; pack r18g
