#!/usr/bin/env bash
# Round 15e, lead (issue #4, session 12; run: slower everywhere, not landed: bench/attic/gemm_r15e_cluster_push.patch,
# apply it to reproduce): the cluster sum one way. After the first cluster barrier each block writes
# its folded float4s of every other block's share into that block's landing slots (st.shared::cluster) and arrives on
# that block's mbarrier; each block waits on its own mbarrier, sums its share in rank order and writes C. No block
# reads another's shared memory, so the second cluster barrier goes. Prediction: -0.1..-0.25 µs on cluster cells
# (r14j's relaxed second barrier: -0.2..-0.5; r14k kept half). Bitwise equal to OLD (same sums, same order).
# Before the call: bash bench/device_runs/make_old.sh artifacts/r15e_old.
#   usage (device machine, repo root; carry .whl, artifacts/r15e_old):
#     RET=$OUT bash bench/device_runs/gpu_r15e_cluster_push.sh
set -u
. bench/device_runs/device_env.sh
tier_partition_ab artifacts/r15e_old r15e || exit 1
