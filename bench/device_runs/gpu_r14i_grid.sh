#!/usr/bin/env bash
# Round 14i (issue #4): bench_gemm's grid at the final round-14 kernels (BENCH_COMMIT set by the caller); the GPU tier
# ran on the same kernels in r14h.
#   usage (device machine, repo root; carry .whl):  BENCH_COMMIT=<rev> RET=$OUT bash bench/device_runs/gpu_r14i_grid.sh
set -u
. bench/device_runs/device_env.sh
mkdir -p "$OUT/results"
timeout 300 python3 bench/bench_gemm.py --out "$OUT/results" > "$OUT/bench_gemm.log" 2>&1; echo "bench_gemm rc=$?"
tail -2 "$OUT/bench_gemm.log" | cut -c1-200; pack r14i
