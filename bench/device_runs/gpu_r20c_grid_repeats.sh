#!/usr/bin/env bash
# Round 20c, lead (issue #4, session 17): r20b's grid at e9b464d met every bar cell, 4096^2 M = 16 by 1.3% (5.41 µs
# against 5.48), inside the call-to-call spread of cuBLAS (~1-5%). Three more full grids in one call, so the bar
# cells' verdict rests on four calls, not one: $OUT/results_{1,2,3}. ~1.5 min warm.
#   usage (device machine, repo root; carry .whl):
#     BENCH_COMMIT=e9b464d RET=$OUT bash bench/device_runs/gpu_r20c_grid_repeats.sh
set -u
. bench/device_runs/device_env.sh
for i in 1 2 3; do
  mkdir -p "$OUT/results_$i"
  timeout 150 python3 bench/bench_gemm.py --out "$OUT/results_$i" > "$OUT/bench_gemm_$i.log" 2>&1
  echo "grid $i rc=$?"; pack r20c
done
