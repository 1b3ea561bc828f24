#!/usr/bin/env bash
# Round 20b, lead (issue #4, session 17): the full grid at e9b464d (round 20a's fast_div landed: A/B 90 of 90 bitwise,
# GPU tier 530 / 1, partition check PASS). ~2 min warm.
#   usage (device machine, repo root; carry .whl):
#     BENCH_COMMIT=e9b464d RET=$OUT bash bench/device_runs/gpu_r20b_grid.sh
set -u
. bench/device_runs/device_env.sh
gemm_grid r20b
