#!/usr/bin/env bash
# Round 12f (issue #4): the policy was swept with plain launches; with programmatic ones (on by default since
# 1ebd17f) another configuration may win where the bars are still missed: u4b8 at M = 16 on 4096^2, 4096x14336,
# 14336x4096 (cells 16, 19, 18) and FP8 4096x14336 M = 16 (cell 31), as far as 200 s take it.
#   usage (device machine, repo root; carry .whl):  RET=$OUT bash bench/device_runs/gpu_r12f_m16_sweep.sh
set -u
. bench/device_runs/device_env.sh
timeout 240 python3 bench/sweep_gemm.py --out "$OUT/sweep" --cells 16,19,18,31 --budget-s 200 \
  > "$OUT/sweep.log" 2>&1; echo "sweep rc=$?"; grep -E "^\[|best|default" "$OUT/sweep.log" | cut -c1-160 | tail -40
pack r12f
