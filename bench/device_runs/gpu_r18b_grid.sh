#!/usr/bin/env bash
# Round 18b, lead (issue #4, session 15): the full grid at HEAD (r18a's tier passed, 526 / 1, but ran 277 s against
# tier_and_partition's 280 s timeout, now 420 s, so the grid after it did not run). ~2 min. Run three times in the
# session, with BENCH_COMMIT 3dc8ece, d0b800d and 683419a (bench/results/gemm_2026-11-30_NVIDIA_H200_<commit>.*).
#   usage (device machine, repo root; carry .whl):  BENCH_COMMIT=<rev> RET=$OUT bash bench/device_runs/gpu_r18b_grid.sh
set -u
. bench/device_runs/device_env.sh
gemm_grid r18b
