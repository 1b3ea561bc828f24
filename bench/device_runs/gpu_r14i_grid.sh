#!/usr/bin/env bash
# Round 14i (issue #4): bench_gemm's grid at the final round-14 kernels (BENCH_COMMIT set by the caller); the GPU tier
# ran on the same kernels in r14h.
#   usage (device machine, repo root; carry .whl):  BENCH_COMMIT=<rev> RET=$OUT bash bench/device_runs/gpu_r14i_grid.sh
set -u
. bench/device_runs/device_env.sh
gemm_grid r14i
