#!/usr/bin/env bash
# Round 13h (issue #7): is V2-Lite-like M = 8 (2 CTAs per SM x 3 stages of 26 KB: r13g's ncu showed DRAM at 40% of
# peak, 21% achieved occupancy, latency-bound) faster with one CTA per SM and a deeper ring (8 stages)? bench_moe's
# A/B of lone calls: old (04db8d4) / new (automatic: b2) / new-b1 / new-b2, M = 8 and 64, every config.
#   usage (device machine, repo root; carry .whl, artifacts/r13_old):
#     RET=$OUT bash bench/device_runs/gpu_r13h_moe_b1.sh
set -u
. bench/device_runs/device_env.sh
mkdir -p "$OUT/ab"
timeout 200 python3 bench/bench_moe.py --out "$OUT/ab" --ab-old artifacts/r13_old --m 8,64 --variants new-b1,new-b2 \
  > "$OUT/ab.log" 2>&1; echo "ab rc=$?"; grep -E " (old|new|new-b1|new-b2) " "$OUT/ab.log" | cut -c1-110; pack r13h
