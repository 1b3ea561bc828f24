#!/usr/bin/env bash
# Round 12h (issue #4): the bench-shape tests of the new 8-bit pairs (FP8 / u8b128 4096x14336 at M = 9, 16 against
# the fp32 reference), then bench_gemm's grid at the final policy (BENCH_COMMIT set by the caller).
#   usage (device machine, repo root; carry .whl):  BENCH_COMMIT=<rev> RET=$OUT bash bench/device_runs/gpu_r12h_final.sh
set -u
. bench/device_runs/device_env.sh
timeout 80 python3 -m pytest -p no:cacheprovider -q tests/gpu/test_gemm_bench_shapes.py \
  -k "14336 and (fe4m3fn or u8b128)" > "$OUT/tests.log" 2>&1; echo "tests rc=$?"; tail -3 "$OUT/tests.log"; pack r12h
mkdir -p "$OUT/results"
timeout 140 python3 bench/bench_gemm.py --out "$OUT/results" > "$OUT/bench_gemm.log" 2>&1; echo "bench_gemm rc=$?"
pack r12h
