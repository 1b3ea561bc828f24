#!/usr/bin/env bash
# Round 20a (prepared in session 16, run in session 17 and landed as e9b464d): the divisions left before a block's
# first load replaced by the host's plans (fast_div with a magic number and a shift per divisor,
# PreparedLaunch._kernel_ints; kernel arguments 14 -> 22). SASS at sm_90: first LDGSTS at instruction 133 / 144 / 206
# (4096^2 M = 1, 4096^2 M = 16, 4096x14336 M = 16 kernels) against 200 / 206 / 232 at ca5b326; registers -2..-12 on
# most kernels, the zero-point two-block kernel's 16-byte spill gone. Prediction (round 19's ~1.5-2 ns per instruction
# before the first load): -0.1 µs on 4096^2, -0.05 on 4096x14336 M = 16. Outputs must be bitwise HEAD's. A/B against
# HEAD, every type, M = 1 / 8 / 16, then the GPU tier and the partition check. ~4 min warm.
#   before the call, here (with the change applied to the tree):
#     bash bench/device_runs/make_old.sh artifacts/r20a_old   (HEAD's files, not the tree's)
#   usage (device machine, repo root; carry .whl and artifacts/r20a_old):
#     RET=$OUT bash bench/device_runs/gpu_r20a_fast_div.sh
set -u
. bench/device_runs/device_env.sh
ab_then_tier artifacts/r20a_old artifacts/r20a_old r20a 1,8,16 || exit 1
