#!/usr/bin/env bash
# Round 14k (issue #4; prepared in session 11, run and landed in session 12): the cluster slice sum with its C stores
# after the second cluster barrier (then an attic patch, now in kernels_cuda/marlin_gemm.cu).
# The barrier keeps its release semantics (MEMBAR.ALL.GPU), but no C stores are in flight for it to wait for; r14j
# measured the barrier without release at -0.2..-0.5 µs on every cluster cell (4096^2 M = 1 6.10 -> 5.84).
# Prediction: most of that. Output bitwise equal to OLD (the same sums). Before the call:
#   (then: git apply the attic patch)
#   mkdir -p artifacts/r14k_old && for f in marlin_gemm.cu marlin_mainloop.cuh dequant.cuh mma.cuh marlin_moe.cu; do
#     git show HEAD:kernels_cuda/$f > artifacts/r14k_old/$f; done
#   git show HEAD:workbench/gemm.py > artifacts/r14k_old/gemm.py
#   git show HEAD:workbench/moe.py > artifacts/r14k_old/moe.py
#   usage (device machine, repo root; carry .whl, artifacts/r14k_old):
#     RET=$OUT bash bench/device_runs/gpu_r14k_cluster_stores.sh
set -u
. bench/device_runs/device_env.sh
tier_and_partition artifacts/r14k_old r14k || { echo "TESTS FAILED"; exit 1; }
timeout 200 python3 bench/ab_gemm.py --out "$OUT/ab" --old-dir artifacts/r14k_old --m 1,8,16 \
  --shapes 4096x4096,14336x4096,8192x8192,28672x8192 --labels "u4b8 g128 fp16,fe4m3fn chan fp16,u4 g128" \
  --variants new,old --no-tinygemm > "$OUT/ab.log" 2>&1
echo "ab rc=$?"; grep -E "\[(new|old)\]|bitwise" "$OUT/ab.log" | sed -E 's/ +/ /g' | cut -c1-72; pack r14k
