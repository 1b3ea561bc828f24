#!/usr/bin/env bash
# Round 18e, lead (issue #4, session 15): A/B of gemm.ROWS_WIDE_FIRST (the 512 x 128 tile first for 4-bit rows-layout
# kernels, M = 9..16, groups >= 128 or channelwise) against HEAD's policy (artifacts/r18_old from make_old.sh), on
# every bench layer at M = 9 and 16, u4b8 fp16 / bf16 and u4 + zero points. ~4 min.
#   usage (device machine, repo root; carry .whl and artifacts/r18_old):
#     RET=$OUT bash bench/device_runs/gpu_r18e_rows_wide_ab.sh
set -u
. bench/device_runs/device_env.sh
mkdir -p "$OUT/ab"
timeout 400 python3 bench/ab_gemm.py --out "$OUT/ab" --old-dir artifacts/r18_old --m 9,16 \
  --labels "u4b8 g128 fp16,u4 g128,u4b8 g128 bf16" --variants new,old --no-tinygemm > "$OUT/ab.log" 2>&1
echo "ab rc=$?"; grep -E "\[(new|old)\]|bitwise" "$OUT/ab.log" | sed -E 's/ +/ /g' | cut -c1-90; pack r18e
