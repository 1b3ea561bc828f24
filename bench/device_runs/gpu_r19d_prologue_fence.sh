#!/usr/bin/env bash
# Round 19d, lead (issue #4, session 16): r19c's trimmed prologue put the activations' pointers and it_end after
# griddepcontrol.wait (ptxas hoists them above the first cp.async otherwise); the wide layers' M <= 8 cells, whose
# 112 / 224-block grids leave SMs free for the next grid's early blocks, lost 1-2% (work after the wait is no longer
# hidden under the grid before). new: the same instructions before the wait, behind a __syncwarp that ptxas keeps
# them after (first LDGSTS still at SASS instruction ~200). A/B against r19c's form (artifacts/r19d_v3), every type,
# M = 1 / 8 / 16; then the GPU tier and the partition check against 1026bbc (artifacts/r19b_old). ~7 min.
#   usage (device machine, repo root; carry .whl, artifacts/r19d_v3 and artifacts/r19b_old):
#     RET=$OUT bash bench/device_runs/gpu_r19d_prologue_fence.sh
set -u
. bench/device_runs/device_env.sh
ab_then_tier artifacts/r19d_v3 artifacts/r19b_old r19d 1,8,16 || exit 1
