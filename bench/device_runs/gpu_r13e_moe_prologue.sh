#!/usr/bin/env bash
# Round 13e (issue #7): round 13d's kernel with its prologue loop not unrolled. r13d: V2-Lite-like M = 1 (one item
# per CTA, 8 stages) still 10.53 -> 11.65 µs in lone calls (L2 flushed by a memset before each), every other cell
# as r13c; the routing read-ahead made that kernel's SASS 3728 -> 4336 instructions, the item entry's code being
# copied into each of the 7 unrolled prologue stages, all run once and cold after the flush. Not unrolled: 2736.
# Prediction: M = 1 at old's time or better; the other cells as r13d; every output bitwise equal.
#   1. tests/gpu/test_moe.py; 2. bench_moe A/B (lone calls, device time) against artifacts/r13_old (04db8d4);
#   3. the fused paths of the table (fused graph = the bar's timing, copy graph).
#   usage (device machine, repo root; carry .whl, artifacts/r13_old):
#     RET=$OUT bash bench/device_runs/gpu_r13e_moe_prologue.sh
set -u
. bench/device_runs/device_env.sh
mkdir -p "$OUT/ab" "$OUT/results"
timeout 200 python3 -m pytest -p no:cacheprovider -q -rs tests/gpu/test_moe.py > "$OUT/gpu_moe.log" 2>&1
echo "moe tests rc=$?" | tee -a "$OUT/gpu_moe.log"; tail -3 "$OUT/gpu_moe.log"; pack r13e
grep -q "rc=0" "$OUT/gpu_moe.log" || { echo "TESTS FAILED"; exit 1; }
timeout 250 python3 bench/bench_moe.py --out "$OUT/ab" --ab-old artifacts/r13_old --m 1,8,64 --variants "" \
  > "$OUT/ab.log" 2>&1; echo "ab rc=$?"; grep -E " (old|new) " "$OUT/ab.log" | cut -c1-110; pack r13e
timeout 150 python3 bench/bench_moe.py --out "$OUT/results" --paths fused > "$OUT/table.log" 2>&1
echo "table rc=$?"; tail -13 "$OUT/table.log" | cut -c1-250; pack r13e
