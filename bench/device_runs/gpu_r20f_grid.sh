#!/usr/bin/env bash
# Round 20f, lead (issue #4, session 17): the full grid at 4fd350c (round 20e's split fold landed: A/B 120 of
# 120 bitwise, GPU tier 536 / 1, partition check PASS). ~1 min warm.
#   usage (device machine, repo root; carry .whl):
#     BENCH_COMMIT=4fd350c RET=$OUT bash bench/device_runs/gpu_r20f_grid.sh
set -u
. bench/device_runs/device_env.sh
gemm_grid r20f
