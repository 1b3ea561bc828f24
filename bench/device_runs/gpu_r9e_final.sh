#!/usr/bin/env bash
# Round 9e, lead (issues #4 / #7), one call at the session's last commit (clusters of two, the pair policy without
# its long-range exception for zero points / act-order):
#   1. tests/gpu (the whole tier) beside bench/partition_check.py against ad901d3 (artifacts/r9d_old; pair policy
#      off there, so every run must equal OLD bitwise)
#   2. bench_gemm.py and bench_moe.py, the full tables (BENCH_COMMIT set by the caller)
#   usage (device machine, repo root; carry .whl, artifacts/r9d_old):
#     BENCH_COMMIT=<rev> RET=$OUT bash bench/device_runs/gpu_r9e_final.sh
set -u
. bench/device_runs/device_env.sh
OLD=${AB_OLD:-artifacts/r9d_old}
mkdir -p "$OUT/results"
tier_and_partition "$OLD" r9e || { echo "TESTS FAILED: no tables"; exit 1; }
timeout 170 python3 bench/bench_gemm.py --out "$OUT/results" > "$OUT/bench_gemm.log" 2>&1; echo "bench_gemm rc=$?"
pack r9e
timeout 110 python3 bench/bench_moe.py --out "$OUT/results" > "$OUT/bench_moe.log" 2>&1; echo "bench_moe rc=$?"
tail -14 "$OUT/bench_moe.log"; pack r9e
