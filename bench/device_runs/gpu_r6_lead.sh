#!/usr/bin/env bash
# Round 6, lead.
#   SKIP_AB=1: tests/gpu/test_gemm_bench_shapes.py — the GEMM at the benchmark's layer shapes, with the library's own
#              configuration and grid, against the NumPy reference (<= 170 s, host-side weight builds dominate).
#   ONLY_AB=1: with FLOOR=1, the measurement floor under the GEMM / MoE tables (bench/floor_probe.py, <= 60 s).
set -u
OUT=${OUT:-$PWD/artifacts/gpu_out}
D="$OUT/lead"
mkdir -p "$D"
if [ -n "${SKIP_AB:-}" ]; then
  timeout 165 python3 -m pytest -p no:cacheprovider -q -rs tests/gpu/test_gemm_bench_shapes.py > "$D/bench_shapes.log" 2>&1
  echo "bench-shape tests: rc=$?" | tee -a "$D/bench_shapes.log"; tail -5 "$D/bench_shapes.log"
  exit 0
fi
[ -n "${FLOOR:-}" ] && timeout 60 python3 bench/floor_probe.py --out "$D" 2>&1 | tee "$D/floor.log"
exit 0
