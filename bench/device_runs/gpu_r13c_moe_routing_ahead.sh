#!/usr/bin/env bash
# Round 13c (issue #7): the fused MoE kernel reads each item's routing one item ahead (kernels_cuda/marlin_moe.cu:
# the fetch loads the next item's expert and sorted ids when it enters an item, the first item's beside
# num_post_padded; the compute side loads the next expert, its output rows' ids and router weights when an item
# starts). Before, every item boundary waited on two dependent routing loads in the fetch and two more in the
# finishing. Prediction: V2-Lite-like M = 8 (33 experts, ~1.4 items of 8 stages per CTA) -3..-6%, M = 1 -3..-8%
# (one item per CTA: the start's loads); Mixtral / V3-like (long items) within 2%; every output bitwise equal.
#   1. tests/gpu/test_moe.py; 2. bench_moe A/B (lone calls, device time) against artifacts/r13_old (04db8d4);
#   3. the fused paths of the table (fused graph = the bar's timing, copy graph).
#   usage (device machine, repo root; carry .whl, artifacts/r13_old):
#     RET=$OUT bash bench/device_runs/gpu_r13c_moe_routing_ahead.sh
set -u
. bench/device_runs/device_env.sh
moe_tests_ab_table artifacts/r13_old r13c || { echo "TESTS FAILED"; exit 1; }
