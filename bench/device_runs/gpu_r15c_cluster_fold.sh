#!/usr/bin/env bash
# Round 15c, lead (issue #4, session 12): the cluster kernels fold their warps in the idle ring with every thread at
# work (finish_slice_cluster), instead of fold_warps' one warp in passes (ablation r15b: the fold cost 0.13 / 0.55 µs
# of u4b8 4096² M = 1 / 16, 0.40 of 14336×4096 M = 16). Prediction: most of that; output bitwise equal to OLD (the
# same tree). Before the call: bash bench/device_runs/make_old.sh artifacts/r15c_old.
#   usage (device machine, repo root; carry .whl, artifacts/r15c_old):
#     RET=$OUT bash bench/device_runs/gpu_r15c_cluster_fold.sh
set -u
. bench/device_runs/device_env.sh
tier_partition_ab artifacts/r15c_old r15c "u4b8 g128 fp16,fe4m3fn chan fp16,u4 g128,u4b8 g128 bf16" || exit 1
