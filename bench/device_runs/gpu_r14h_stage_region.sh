#!/usr/bin/env bash
# Round 14h (issue #4): one-block kernels with grouped scales run a stage without the group-reload test between
# the warp's k16 tiles where the groups span them (WarpLoop::compute_stage<false>, chosen per launch from G), after
# the timing-only r14g. The GPU tier (it runs G = 32, 64, 128: both forms) beside the partition check against HEAD
# (artifacts/r14_head; the same sums in the same order: bitwise equal expected), then the A/B against HEAD, 4-bit
# types, every bench layer, M = 1 and 16.
#   usage (device machine, repo root; carry .whl, artifacts/r14_head):
#     RET=$OUT bash bench/device_runs/gpu_r14h_stage_region.sh
set -u
. bench/device_runs/device_env.sh
tier_and_partition artifacts/r14_head r14h || { echo "TESTS FAILED"; exit 1; }
timeout 220 python3 bench/ab_gemm.py --out "$OUT/ab" --old-dir artifacts/r14_head --m 1,16 --labels "u4b8,u4 g128" \
  --variants new,old --no-tinygemm > "$OUT/ab.log" 2>&1
echo "ab rc=$?"; grep -E "\[(new|old)\]|bitwise" "$OUT/ab.log" | sed -E 's/ +/ /g' | cut -c1-72; pack r14h
