#!/usr/bin/env bash
# Round 13d (issue #7): round 13c's routing read-ahead, with the finishing's output-row ids loaded an item ahead
# (the first item's at the kernel's start, before any copy) and their router weights when an item starts. r13c loaded
# both when an item started, the weights depending on the ids: used at once behind the ring of copies, they cost the
# one-item CTAs of V2-Lite-like M = 1 ~1 µs (10.43 -> 11.46 µs) while every other cell gained 1-6%. Prediction: M = 1
# back to old or better, the other cells as r13c; every output bitwise equal.
#   1. tests/gpu/test_moe.py; 2. bench_moe A/B (lone calls, device time) against artifacts/r13_old (04db8d4);
#   3. the fused paths of the table (fused graph = the bar's timing, copy graph).
#   usage (device machine, repo root; carry .whl, artifacts/r13_old):
#     RET=$OUT bash bench/device_runs/gpu_r13d_moe_out_rows.sh
set -u
. bench/device_runs/device_env.sh
moe_tests_ab_table artifacts/r13_old r13d || { echo "TESTS FAILED"; exit 1; }
