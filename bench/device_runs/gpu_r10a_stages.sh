#!/usr/bin/env bash
# Round 10a, lead (issue #4), one call: (1) round 9h's checks of the resident-cluster fallback (ceaa321, never run on
# a GPU); (2) deeper pipelines: the sweep around each default (its thread shape, blocks per SM and swap) with
# 16 / 12 / 10 / 8 / 6 / 4 stages, on the cells furthest from their bars (4096-wide layers, u4b8 and FP8).
# Reading (bench/NOTES_gemm.md round 10): a 4096^2 M = 1 block streams 16 steps of 4 KiB with 5 in flight.
#   usage (device machine, repo root; carry .whl):  RET=$OUT bash bench/device_runs/gpu_r10a_stages.sh
set -u
. bench/device_runs/device_env.sh
RET=$RET bash bench/device_runs/gpu_r9h_resident_clusters.sh
timeout 280 python3 bench/sweep_gemm.py --out "$OUT/sweep" --cells 0,8,12,16,28,1,6,7,29,30,25 --near-default \
  --stages 16,12,10,8,6,4 --budget-s 260 > "$OUT/sweep.log" 2>&1; echo "sweep rc=$?"
grep -A14 "^| cell" "$OUT/sweep.log" | head -16; ls "$OUT"; pack r10a
