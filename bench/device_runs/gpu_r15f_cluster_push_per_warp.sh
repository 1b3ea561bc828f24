#!/usr/bin/env bash
# Round 15f, lead (issue #4; prepared in session 12, NOT RUN: the session's device time was spent). r15e's one-way
# cluster sum (remote stores into the owner's ring, an mbarrier instead of the second cluster barrier) with one
# arrival per warp instead of per thread (bench/attic/gemm_r15f_cluster_push_per_warp.patch; nvcc sm_80 / sm_90: no
# spills). r15e lost 0.1-0.4 µs on every cluster cell; the guess is that its 256 remote arrivals per block and peer
# were the cost. Prediction: at least level with HEAD, at best r14j's -0.2..-0.3 µs. Bitwise equal to OLD.
# Before the call:
#   git apply bench/attic/gemm_r15f_cluster_push_per_warp.patch
#   mkdir -p artifacts/r15f_old && for f in marlin_gemm.cu marlin_mainloop.cuh dequant.cuh mma.cuh marlin_moe.cu; do
#     git show HEAD:kernels_cuda/$f > artifacts/r15f_old/$f; done
#   git show HEAD:workbench/gemm.py > artifacts/r15f_old/gemm.py
#   git show HEAD:workbench/moe.py > artifacts/r15f_old/moe.py
#   usage (device machine, repo root; carry .whl, artifacts/r15f_old):
#     RET=$OUT bash bench/device_runs/gpu_r15f_cluster_push_per_warp.sh
set -u
. bench/device_runs/device_env.sh
tier_and_partition artifacts/r15f_old r15f || { echo "TESTS FAILED"; exit 1; }
timeout 200 python3 bench/ab_gemm.py --out "$OUT/ab" --old-dir artifacts/r15f_old --m 1,8,16 \
  --shapes 4096x4096,14336x4096,8192x8192,28672x8192 --labels "u4b8 g128 fp16,fe4m3fn chan fp16,u4 g128" \
  --variants new,old --no-tinygemm > "$OUT/ab.log" 2>&1
echo "ab rc=$?"; grep -E "\[(new|old)\]|bitwise" "$OUT/ab.log" | sed -E 's/ +/ /g' | cut -c1-72; pack r15f
