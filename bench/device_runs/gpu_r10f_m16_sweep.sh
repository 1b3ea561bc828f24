#!/usr/bin/env bash
# Round 10f, lead (issue #4): the configuration sweep of the two largest u4b8 layers at M = 16 after late scaling
# (e6c5469), which made one-block rows-layout kernels with K_WARP >= 2 faster but not the two-block ones the policy
# takes there (28672x8192 M = 16: x2.49 over cuBLAS in the e6c5469 grid, the x2.5 bar 0.4% away).
#   usage (device machine, repo root; carry .whl):  RET=$OUT bash bench/device_runs/gpu_r10f_m16_sweep.sh
set -u
. bench/device_runs/device_env.sh
timeout 230 python3 bench/sweep_gemm.py --out "$OUT/sweep" --cells 27,26 --budget-s 210 > "$OUT/sweep.log" 2>&1
echo "sweep rc=$?"; grep -A4 "^| cell" "$OUT/sweep.log" | head -6; grep -B2 -A16 "^| rank" "$OUT/sweep.log" | head -44
pack r10f
