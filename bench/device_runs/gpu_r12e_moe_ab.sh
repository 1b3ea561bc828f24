#!/usr/bin/env bash
# Round 12e (issue #7): does the MoE kernels' programmatic form cost a lone call anything? r12d's table had some
# single calls slower than be122a0's (DeepSeek-V3-like M = 8 126.7 -> 134.8 µs) and the plain graph slower at large M
# (a different machine or clocks?). 1. bench_moe's A/B mode: the fused phase, device time only (spin before the
# start event), interleaved against artifacts/r12_old (67ebc83: the kernel before this change, launched by CuPy);
# 2. the fused paths of the table again (fused, fused graph, fused graph plain, copy graph).
#   usage (device machine, repo root; carry .whl, artifacts/r12_old):
#     RET=$OUT bash bench/device_runs/gpu_r12e_moe_ab.sh
set -u
. bench/device_runs/device_env.sh
mkdir -p "$OUT/ab" "$OUT/results"
timeout 250 python3 bench/bench_moe.py --out "$OUT/ab" --ab-old artifacts/r12_old --m 1,8,64 --variants "" > "$OUT/ab.log" 2>&1
echo "ab rc=$?"; grep -E " (old|new) " "$OUT/ab.log" | cut -c1-110; pack r12e
[ "${AB_ONLY:-0}" = 1 ] && exit 0
timeout 150 python3 bench/bench_moe.py --out "$OUT/results" --paths fused > "$OUT/table.log" 2>&1
echo "table rc=$?"; tail -13 "$OUT/table.log" | cut -c1-250; pack r12e
