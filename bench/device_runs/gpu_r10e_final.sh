#!/usr/bin/env bash
# Round 10e, lead (issues #4 / #7), one call at the late-scaling commit:
#   1. tests/gpu (the whole tier) beside bench/partition_check.py against this commit's own files
#      (artifacts/r10_self: late scaling changes the bits of one-m16-block kernels, so the check's value here is the
#      bound, poison and repeat checks on partitions tests/gpu does not reach)
#   2. bench_gemm.py and bench_moe.py, the full tables (BENCH_COMMIT set by the caller)
#   usage (device machine, repo root; carry .whl, artifacts/r10_self):
#     BENCH_COMMIT=<rev> RET=$OUT bash bench/device_runs/gpu_r10e_final.sh
set -u
. bench/device_runs/device_env.sh
mkdir -p "$OUT/results"
tier_and_partition artifacts/r10_self r10e || { echo "TESTS FAILED: no tables"; exit 1; }
timeout 170 python3 bench/bench_gemm.py --out "$OUT/results" > "$OUT/bench_gemm.log" 2>&1; echo "bench_gemm rc=$?"
pack r10e
timeout 110 python3 bench/bench_moe.py --out "$OUT/results" > "$OUT/bench_moe.log" 2>&1; echo "bench_moe rc=$?"
tail -14 "$OUT/bench_moe.log"; pack r10e
