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
moe_tests_ab_table artifacts/r13_old r13e || { echo "TESTS FAILED"; exit 1; }
