#!/usr/bin/env bash
# Round 18a, lead (issue #4, session 15): the whole GPU tier with the crc32-seeded rng fixture of 2c67871 (not yet run
# on a GPU) beside the partition check against HEAD's own files, then the full grid at HEAD (f471ce5's ring fold had
# only an A/B). ~7 min.
#   usage (device machine, repo root; carry .whl and artifacts/r18_old, written by make_old.sh at HEAD):
#     BENCH_COMMIT=<rev> RET=$OUT bash bench/device_runs/gpu_r18a_tier_grid.sh
set -u
. bench/device_runs/device_env.sh
tier_and_partition artifacts/r18_old r18a || { echo "TESTS FAILED"; exit 1; }
gemm_grid r18a
