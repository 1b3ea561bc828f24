#!/usr/bin/env bash
# Round 10h, lead (issue #4): bench_gemm.py's full table at bdc99e8 (late scaling + the widened pair exception; the
# GPU tier passed at e6c5469 in round 10e, the policy change's tests in round 10g).
#   usage (device machine, repo root; carry .whl):  BENCH_COMMIT=<rev> RET=$OUT bash bench/device_runs/gpu_r10h_grid.sh
set -u
. bench/device_runs/device_env.sh
mkdir -p "$OUT/results"
timeout 200 python3 bench/bench_gemm.py --out "$OUT/results" > "$OUT/bench_gemm.log" 2>&1; echo "bench_gemm rc=$?"
pack r10h
