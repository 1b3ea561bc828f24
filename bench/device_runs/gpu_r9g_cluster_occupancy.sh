#!/usr/bin/env bash
# Round 9g, lead (issue #4): diagnostic for the slow clusters of 4 / 8 (NOTES_gemm.md "Round 9" item 2) — how many
# clusters of each size the H200 keeps resident (bench/cluster_occupancy.py), against what the bench grids need.
#   usage (device machine, repo root; carry .whl):  RET=$OUT bash bench/device_runs/gpu_r9g_cluster_occupancy.sh
set -u
. bench/device_runs/device_env.sh
timeout 100 python3 bench/cluster_occupancy.py > "$OUT/cluster_occupancy.log" 2>&1; echo "rc=$?"
cat "$OUT/cluster_occupancy.log"; pack r9g
