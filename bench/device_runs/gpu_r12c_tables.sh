#!/usr/bin/env bash
# Round 12c (issues #4, #7): the tables with programmatic launches on by default (tests: r12b at 1ebd17f).
#   bench_gemm.py: the full grid, u4b8 and FP8 also with plain launches in the same run (PLAIN_TOO)
#   bench_moe.py: the MoE table with the size-matched copy ceiling ("copy graph"); the batched and dense-loop paths
#   launch dense plans, now programmatic
#   usage (device machine, repo root; carry .whl):
#     BENCH_COMMIT=<rev> RET=$OUT bash bench/device_runs/gpu_r12c_tables.sh
set -u
. bench/device_runs/device_env.sh
mkdir -p "$OUT/results"
timeout 200 python3 bench/bench_gemm.py --out "$OUT/results" > "$OUT/bench_gemm.log" 2>&1; echo "bench_gemm rc=$?"
pack r12c
timeout 200 python3 bench/bench_moe.py --out "$OUT/results" > "$OUT/bench_moe.log" 2>&1; echo "bench_moe rc=$?"
tail -14 "$OUT/bench_moe.log"; pack r12c
