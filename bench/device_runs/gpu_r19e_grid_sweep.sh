#!/usr/bin/env bash
# Round 19e, lead (issue #4, session 16): the full grid at ca5b326 (r19d's tier passed at its kernels, 530 / 1), then
# the two M = 16 cells still short of the INT4 x2.5 bar swept near their defaults (stages and grids) under the trimmed
# prologue. ~4 min.
#   usage (device machine, repo root; carry .whl):
#     BENCH_COMMIT=ca5b326 RET=$OUT bash bench/device_runs/gpu_r19e_grid_sweep.sh
set -u
. bench/device_runs/device_env.sh
gemm_grid r19e
timeout 100 python3 bench/sweep_gemm.py --out "$OUT/sweep" --cells 16,18 --near-default --budget-s 90 \
  > "$OUT/sweep.log" 2>&1
echo "sweep rc=$?"; head -8 "$OUT"/sweep/sweep_*.md; pack r19e
