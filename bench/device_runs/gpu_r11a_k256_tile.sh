#!/usr/bin/env bash
# Round 11a (prepared in session 7, not run): the 256 x 64 tile ((n_tiles, k_warp) = (1, 2), in gemm._THREAD_SHAPES
# since session 7 but in no policy order) in the full sweep of the cells it could help: 4096^2 u4b8 M = 1, 2, 8, 16
# (tinygemm is faster at M <= 2: 6.8 vs 8.0 µs), FP8 4096^2 M = 1, and the 4096-wide u4b8 layers at M = 1, only that
# tile beside the default (--thread-shapes 1x2; the other shapes were swept in r10i). Every
# candidate is checked against the reference bound before it is timed (sweep_gemm.py); SELFCHECK=1 runs
# --selfcheck first.
#   usage (device machine, repo root; carry .whl):  RET=$OUT bash bench/device_runs/gpu_r11a_k256_tile.sh
set -u
. bench/device_runs/device_env.sh
if [ "${SELFCHECK:-0}" = 1 ]; then  # the sweep checks each candidate anyway; this checks the checker (done in r6)
  timeout 150 python3 bench/sweep_gemm.py --selfcheck > "$OUT/selfcheck.log" 2>&1; echo "selfcheck rc=$?"
  tail -3 "$OUT/selfcheck.log"; pack r11a
fi
timeout 260 python3 bench/sweep_gemm.py --out "$OUT/sweep" --cells 0,8,12,28,16,6,7 --thread-shapes 1x2 --budget-s 230 \
  > "$OUT/sweep.log" 2>&1; echo "sweep rc=$?"
grep -A9 "^| cell" "$OUT/sweep.log" | head -11; grep -E "^\| [0-9]+ .*\| 1,2," "$OUT/sweep.log" | head -20; pack r11a
