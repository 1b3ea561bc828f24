#!/usr/bin/env bash
# Round 13a (prepared in session 9, not run): the whole GPU tier at the session's end (the tests added after r12d
# ran only in part: the graph-replay helper shared by the chain tests, the pinned-occupancy check of programmatic
# plans, the 8-bit pair bench shapes) beside the partition check against artifacts/<OLD> (a copy of HEAD's files,
# bench/device_runs/README.md; the dense kernels are unchanged since 67ebc83, so every bit must stay).
#   usage (device machine, repo root; carry .whl, artifacts/<OLD>):
#     OLD=artifacts/<dir> RET=$OUT bash bench/device_runs/gpu_r13a_tier.sh
set -u
. bench/device_runs/device_env.sh
tier_and_partition "${OLD:?a copy of the gemm.py and kernels_cuda files of HEAD}" r13a \
  || { echo "TESTS FAILED"; exit 1; }
