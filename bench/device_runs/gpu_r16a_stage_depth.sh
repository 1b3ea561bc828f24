#!/usr/bin/env bash
# Round 16a, lead (issue #4): pipeline depth on the cells still short of the INT4 x2.5 bar (u4b8 g128 fp16 4096^2 M =
# 1, 8, 16; 14336x4096 M = 1, 16; 4096x14336 M = 16), near the default (its thread shape, blocks per SM and swap),
# one-block stages 2, 3, 4, 5. Question: on 4096^2 a block has 4 steps and the 4-stage ring issues its last stage only
# after the first has landed (fetch_stage(it + STAGES - 1) while compute_stage(it)), so does 5 stages (all in the
# prologue) or 2-3 (arrivals spread out) change the unhidden compute r15a measured (1.3 us)? Every candidate is
# checked against the fp32 reference bound before it is timed (sweep_gemm.py).
#   usage (device machine, repo root; carry .whl):  RET=$OUT bash bench/device_runs/gpu_r16a_stage_depth.sh
set -u
. bench/device_runs/device_env.sh
timeout 400 python3 bench/sweep_gemm.py --out "$OUT/sweep" --cells 0,12,16,7,19,18 --near-default --stages 2,3,4,5 \
  --budget-s 370 > "$OUT/sweep.log" 2>&1; echo "sweep rc=$?"
grep -A9 "^| cell" "$OUT/sweep.log" | head -10; grep -E "^(###|\| [0-9]+ )" "$OUT/sweep.log" | cut -c1-100 | head -90
pack r16a
