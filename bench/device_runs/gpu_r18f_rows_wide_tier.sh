#!/usr/bin/env bash
# Round 18f, lead (issue #4, session 15): tests/gpu with gemm.ROWS_WIDE_FIRST (its bench-shape file reaches the 512 x
# 128 tile at M = 16 on 4096x14336, 8192^2, 8192x28672 and 28672x8192) beside the partition check against HEAD's
# files. ~5 min.
#   usage (device machine, repo root; carry .whl and artifacts/r18_old):
#     RET=$OUT bash bench/device_runs/gpu_r18f_rows_wide_tier.sh
set -u
. bench/device_runs/device_env.sh
tier_and_partition artifacts/r18_old r18f || { echo "TESTS FAILED"; exit 1; }
