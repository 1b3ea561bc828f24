#!/usr/bin/env bash
# Round 9c, lead (issue #4): the configuration sweep with thread-block cluster candidates (every slice-aligned grid
# with 2 / 4 / 8 blocks per slice timed with and without clusters): which (configuration, grid) a cluster-2 slice sum
# makes fastest — one block per SM on 64 x 2 grids where two blocks per SM won before (8192^2 M = 16, 28672x8192),
# FP8's (2, 4) tile on 8192^2, half grids on 4096-wide layers — and whether clusters of 4 / 8 lose everywhere.
#   usage (device machine, repo root; carry .whl):  RET=$OUT bash bench/device_runs/gpu_r9c_cluster_sweep.sh
set -u
. bench/device_runs/device_env.sh
timeout 300 python3 bench/sweep_gemm.py --out "$OUT/sweep" --cells 17,25,27,26,2,4,0,16,7,19,1 --budget-s 270 \
  > "$OUT/sweep.log" 2>&1; echo "sweep rc=$?"
grep -A14 "^| cell" "$OUT/sweep.log" | head -16; tail -3 "$OUT/sweep.log"; pack r9c
