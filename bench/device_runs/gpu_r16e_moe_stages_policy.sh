#!/usr/bin/env bash
# Round 16e, lead: r16d's winner as the policy (workbench.moe.MOE_ONE_BLOCK_STAGES = (4, 3, 6, 8), 8 first before):
# tests/gpu/test_moe.py, bench_moe's A/B of lone calls against HEAD (M = 1, 8, 64), then the fused paths of the MoE
# table (BENCHMARKS.md). Prediction: dsv2-lite M = 1 -8% (graph 6.44 -> 5.89 us), mixtral M = 64 -1%, the rest equal.
# Before the call:  bash bench/device_runs/make_old.sh artifacts/r16d_old
#   usage (device machine, repo root; carry .whl, artifacts/r16d_old):
#     RET=$OUT bash bench/device_runs/gpu_r16e_moe_stages_policy.sh
set -u
. bench/device_runs/device_env.sh
moe_tests_ab_table artifacts/r16d_old r16e || { echo "TESTS FAILED"; exit 1; }
