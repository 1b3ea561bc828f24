#!/usr/bin/env bash
# Round 19a, lead (issue #4, session 16): the one-chunk kernels no longer zero A's padding rows (rows >= M) in every
# ring slot before their first weight fetch (~300 instructions a thread at M = 1 with 3 stages; row r of the product
# reads row r of A only, so the padding rows' contents never reach a stored element). A/B against HEAD
# (artifacts/r19_old: make_old.sh at 6b6be2e) at M = 1 / 4 / 8 / 12 / 16 on every layer, the partition check (outputs
# bitwise HEAD's), then a stage-depth sweep of 4096^2 M = 1 / 8 (deeper rings zeroed more rows before). ~7 min.
#   usage (device machine, repo root; carry .whl and artifacts/r19_old):
#     RET=$OUT bash bench/device_runs/gpu_r19a_no_pad_zeroing.sh
set -u
. bench/device_runs/device_env.sh
timeout 270 python3 bench/partition_check.py artifacts/r19_old > "$OUT/partition_check.log" 2>&1
echo "partition check rc=$?"; tail -2 "$OUT/partition_check.log"
timeout 230 python3 bench/ab_gemm.py --out "$OUT/ab" --old-dir artifacts/r19_old --m 1,4,8,12,16 \
  --labels "u4b8 g128 fp16,fe4m3fn chan fp16,u4 g128" --variants new,old --no-tinygemm > "$OUT/ab.log" 2>&1
echo "ab rc=$?"; grep -E "\[(new|old)\]|bitwise" "$OUT/ab.log" | sed -E 's/ +/ /g' | cut -c1-80; pack r19a
timeout 80 python3 bench/sweep_gemm.py --out "$OUT/sweep" --cells 0,12 --thread-shapes 1x4,1x2 --stages 3,4,6 \
  --budget-s 70 > "$OUT/sweep.log" 2>&1
echo "sweep rc=$?"; head -8 "$OUT"/sweep/sweep_*.md; pack r19a
