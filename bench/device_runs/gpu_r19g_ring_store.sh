#!/usr/bin/env bash
# Round 19g, lead (issue #4, session 16): the finish of the two cells still short of the INT4 x2.5 bar (ablation r19f:
# 4096^2 M = 16 1.15 µs, 4096x14336 M = 16 1.46 µs). (1) An inlined row-layout finish whose block holds its last slice
# whole (4096x14336 M = 16: one block per slice) folds the warps in the idle ring and every thread stores the sums it
# made (store_ring_sums), instead of fold_warps' two passes of two barriers and C stored by k group 0's two warps.
# (2) The cluster finish of per-warp-pipeline kernels drops its first barrier (end_slice's barrier just before it
# already left the ring idle). Outputs must stay bitwise. A/B against ca5b326 (artifacts/r19g_old), every type, M = 1
# / 12 / 16, then the GPU tier and the partition check. ~6 min. Run once: correct (tier 530 / 1, partition and A/B
# bitwise) but no faster; not landed, the kernel edit is bench/attic/gemm_r19g_ring_store.patch (apply it first).
#   usage (device machine, repo root; carry .whl and artifacts/r19g_old):
#     RET=$OUT bash bench/device_runs/gpu_r19g_ring_store.sh
set -u
. bench/device_runs/device_env.sh
ab_then_tier artifacts/r19g_old artifacts/r19g_old r19g 1,12,16 || exit 1
