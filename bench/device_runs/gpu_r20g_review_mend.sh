#!/usr/bin/env bash
# Round 20g, lead (session 17's review): helpers instead of repeated code in the kernel (block_range_start for the
# block-range expression, tree_sum_f4 for the two ring folds' tree) and in workbench/gemm.py (pipeline_steps). SASS
# counts unchanged (sass_loop_count, sm_90); outputs must be bitwise HEAD's. A/B against HEAD at M = 1, 16, 64 every
# type, then the GPU tier and the partition check. ~5 min.
#   before the call, here (with the change in the tree):  bash bench/device_runs/make_old.sh artifacts/r20g_old
#   usage (device machine, repo root; carry .whl and artifacts/r20g_old):
#     RET=$OUT bash bench/device_runs/gpu_r20g_review_mend.sh
set -u
. bench/device_runs/device_env.sh
ab_then_tier artifacts/r20g_old artifacts/r20g_old r20g 1,16,64 || exit 1
