#!/usr/bin/env bash
# Round 11f, lead (issues #4, #7): the tables at 8e6de4a's policy, and the MoE timing question of r11e.
#   1. bench/probe_moe_decode.py: the fused MoE phase and the dense GEMM on the same bytes, timed as single calls after
#      a write flush (bench_moe's table), after a read flush, and in CUDA graphs on rotated inputs (bench_gemm's)
#   2. bench_moe.py (now with the "fused graph" columns) and bench_gemm.py, the full tables (BENCH_COMMIT set by the
#      caller). The tier ran in r11d on this policy (497 passed; the kernels there had the striped MoE form besides).
#   usage (device machine, repo root; carry .whl):  BENCH_COMMIT=<rev> RET=$OUT bash bench/device_runs/gpu_r11f_final.sh
set -u
. bench/device_runs/device_env.sh
mkdir -p "$OUT/results"
timeout 150 python3 bench/probe_moe_decode.py --out "$OUT/results" > "$OUT/probe.log" 2>&1; echo "probe rc=$?"
tail -36 "$OUT/probe.log"; pack r11f
timeout 170 python3 bench/bench_moe.py --out "$OUT/results" > "$OUT/bench_moe.log" 2>&1; echo "bench_moe rc=$?"
tail -14 "$OUT/bench_moe.log"; pack r11f
[ "${GEMM:-1}" = 0 ] && exit 0  # (GEMM=0: the second call, after the probe's and the routings' fixes)
timeout 170 python3 bench/bench_gemm.py --out "$OUT/results" > "$OUT/bench_gemm.log" 2>&1; echo "bench_gemm rc=$?"
pack r11f
