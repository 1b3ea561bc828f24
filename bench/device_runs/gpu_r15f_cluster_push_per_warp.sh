#!/usr/bin/env bash
# Round 15f, lead (issue #4; prepared in session 12, NOT RUN: the session's device time was spent). r15e's one-way
# cluster sum (remote stores into the owner's ring, an mbarrier instead of the second cluster barrier) with one
# arrival per warp instead of per thread (bench/attic/gemm_r15f_cluster_push_per_warp.patch; nvcc sm_80 / sm_90: no
# spills). r15e lost 0.1-0.4 µs on every cluster cell; the guess is that its 256 remote arrivals per block and peer
# were the cost. Prediction: at least level with HEAD, at best r14j's -0.2..-0.3 µs. Bitwise equal to OLD.
# Before the call:
#   git apply bench/attic/gemm_r15f_cluster_push_per_warp.patch
#   bash bench/device_runs/make_old.sh artifacts/r15f_old
#   usage (device machine, repo root; carry .whl, artifacts/r15f_old):
#     RET=$OUT bash bench/device_runs/gpu_r15f_cluster_push_per_warp.sh
set -u
. bench/device_runs/device_env.sh
tier_partition_ab artifacts/r15f_old r15f || exit 1
