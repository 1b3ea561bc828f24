#!/usr/bin/env bash
# Round 19c, lead (issue #4, session 16): the code before a block's first load, trimmed. On top of r19b's order (A's
# pointers after griddepcontrol.wait): it_end computed after the wait too, the first fetch unconditional (the host
# never launches an empty range: grid <= pipeline steps), the first iteration's divisions unsigned. First LDGSTS at
# SASS instruction 198 / 205 / 232 (4096^2 M = 1, M = 16, 4096x14336 M = 16 kernels) against 328 / 392 / 408 at
# 1026bbc. A/B against 1026bbc (artifacts/r19b_old) on every type at M = 1 / 8 / 16, then the GPU tier and the
# partition check (bitwise). ~7 min.
#   usage (device machine, repo root; carry .whl and artifacts/r19b_old):
#     RET=$OUT bash bench/device_runs/gpu_r19c_prologue_trim.sh
set -u
. bench/device_runs/device_env.sh
ab_then_tier artifacts/r19b_old artifacts/r19b_old r19c 1,8,16 || exit 1
