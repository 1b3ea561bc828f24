#!/usr/bin/env bash
# Round 14k (issue #4; prepared in session 11, run and landed in session 12): the cluster slice sum with its C stores
# after the second cluster barrier (then an attic patch, now in kernels_cuda/marlin_gemm.cu).
# The barrier keeps its release semantics (MEMBAR.ALL.GPU), but no C stores are in flight for it to wait for; r14j
# measured the barrier without release at -0.2..-0.5 µs on every cluster cell (4096^2 M = 1 6.10 -> 5.84).
# Prediction: most of that. Output bitwise equal to OLD (the same sums). Before the call:
#   (then: git apply the attic patch)
#   bash bench/device_runs/make_old.sh artifacts/r14k_old
#   usage (device machine, repo root; carry .whl, artifacts/r14k_old):
#     RET=$OUT bash bench/device_runs/gpu_r14k_cluster_stores.sh
set -u
. bench/device_runs/device_env.sh
tier_partition_ab artifacts/r14k_old r14k || exit 1
