#!/usr/bin/env bash
# Round 12d (issue #7): the MoE kernels as programmatic dependent launches (each of marlin_moe.cu's kernels lets the
# next start and waits before it touches data; fused_moe's layer plan and gemm_phase_fused launch through
# cuLaunchKernelEx, the GEMMs' shared memory pinned as the dense GEMM's; the zeroing memset moved before align).
#   1. the whole GPU tier (new: fused_moe layers and fused phases back to back, plain / programmatic, in a graph)
#      beside the partition check against artifacts/r12_old (dense kernels unchanged: bitwise)
#   2. bench_moe.py: the table with "fused graph" (programmatic) beside "fused graph plain" and the copy ceiling
#   usage (device machine, repo root; carry .whl, artifacts/r12_old):
#     BENCH_COMMIT=<rev> RET=$OUT bash bench/device_runs/gpu_r12d_moe_programmatic.sh
set -u
. bench/device_runs/device_env.sh
tier_and_partition artifacts/r12_old r12d || { echo "TESTS FAILED: no table"; exit 1; }
mkdir -p "$OUT/results"
timeout 200 python3 bench/bench_moe.py --out "$OUT/results" > "$OUT/bench_moe.log" 2>&1; echo "bench_moe rc=$?"
tail -14 "$OUT/bench_moe.log" | cut -c1-250; pack r12d
