#!/usr/bin/env bash
# Round 13f (issue #7): round 13e's kernel with no read-ahead past the CTA's last item (the next item's routing
# and output ids are loaded only when that item exists). r13e: V2-Lite-like M = 1 in lone calls 10.62 -> 11.36 µs
# (graph 6.23 -> 6.09), where every CTA has one item and its read-ahead read blocks it never runs, from DRAM after
# the flush. Prediction: M = 1 lone calls at old's time (+-3%), the rest as r13e. Then the whole GPU tier (the dense
# kernels are unchanged: the partition check must stay bitwise against r13_old).
#   1. tests/gpu/test_moe.py; 2. bench_moe A/B (lone calls, device time) against artifacts/r13_old (04db8d4);
#   3. the fused paths of the table (fused graph = the bar's timing, copy graph).
#   usage (device machine, repo root; carry .whl, artifacts/r13_old):
#     RET=$OUT bash bench/device_runs/gpu_r13f_moe_final.sh
set -u
. bench/device_runs/device_env.sh
moe_tests_ab_table artifacts/r13_old r13f || { echo "TESTS FAILED"; exit 1; }
tier_and_partition artifacts/r13_old r13f || { echo "TESTS FAILED"; exit 1; }
