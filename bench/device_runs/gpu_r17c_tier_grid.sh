#!/usr/bin/env bash
# Round 17c, lead (issue #4, session 14): the GPU tier and the partition check at round 17's pair rules (long pairs
# for bf16 and zero points, bf16 two-block pairs; A/B r17b), then bench_gemm's grid at that commit (BENCH_COMMIT set
# by the caller). ~5 min.
#   usage (device machine, repo root; carry .whl, artifacts/r17b_old: the kernels and policy of 0cd5451):
#     BENCH_COMMIT=<rev> RET=$OUT bash bench/device_runs/gpu_r17c_tier_grid.sh
set -u
. bench/device_runs/device_env.sh
tier_and_partition artifacts/r17b_old r17c || { echo "TESTS FAILED"; exit 1; }
gemm_grid r17c
