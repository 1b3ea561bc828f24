#!/usr/bin/env bash
# Round 14e (issue #4): the whole GPU tier at the round-14 policy, then bench_gemm's grid (BENCH_COMMIT set by the
# caller), alone on the GPU.
#   usage (device machine, repo root; carry .whl):  BENCH_COMMIT=<rev> RET=$OUT bash bench/device_runs/gpu_r14e_final.sh
set -u
. bench/device_runs/device_env.sh
timeout 280 python3 -m pytest -p no:cacheprovider -q -rs tests/gpu > "$OUT/gpu_tier.log" 2>&1
echo "gpu tier rc=$?"; tail -3 "$OUT/gpu_tier.log"; pack r14e
mkdir -p "$OUT/results"
timeout 180 python3 bench/bench_gemm.py --out "$OUT/results" > "$OUT/bench_gemm.log" 2>&1; echo "bench_gemm rc=$?"
tail -3 "$OUT/bench_gemm.log" | cut -c1-200; pack r14e
