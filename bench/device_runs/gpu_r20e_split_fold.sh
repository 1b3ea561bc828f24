#!/usr/bin/env bash
# Round 20e, lead (issue #4 beyond its bars, session 17): the last slice's warp fold split over the k groups in the
# idle stage ring (fold_warps_split_in_ring, finish_slice_or_split): one barrier instead of two per m16 block, and
# every warp writes its share of the slot / C. Kernels with 64-row tiles of 256 columns (M = 49..64 and every chunk
# of larger M). Prediction (r20d's stall samples, r19f's nofold −2.06 µs): 4096^2 M = 64 18.7 -> ~16.7 µs, −1..−2 µs
# on the other layers at M = 64, less at M = 128 / 256; M <= 32 unchanged (not these kernels). Outputs must be
# bitwise HEAD's. A/B against HEAD at M = 32, 64, 128, 256 every type, then the GPU tier and the partition check.
#   before the call, here (with the change in the tree):  bash bench/device_runs/make_old.sh artifacts/r20e_old
#   usage (device machine, repo root; carry .whl and artifacts/r20e_old):
#     RET=$OUT bash bench/device_runs/gpu_r20e_split_fold.sh
set -u
. bench/device_runs/device_env.sh
ab_then_tier artifacts/r20e_old artifacts/r20e_old r20e 32,64,128,256 || exit 1
