#!/usr/bin/env bash
# Round 15c, lead (issue #4, session 12): the cluster kernels fold their warps in the idle ring with every thread at
# work (finish_slice_cluster), instead of fold_warps' one warp in passes (ablation r15b: the fold cost 0.13 / 0.55 µs
# of u4b8 4096² M = 1 / 16, 0.40 of 14336×4096 M = 16). Prediction: most of that; output bitwise equal to OLD (the
# same tree). Before the call: artifacts/r15c_old from HEAD (kernels, gemm.py, moe.py; see gpu_r14k_cluster_stores.sh).
#   usage (device machine, repo root; carry .whl, artifacts/r15c_old):
#     RET=$OUT bash bench/device_runs/gpu_r15c_cluster_fold.sh
set -u
. bench/device_runs/device_env.sh
tier_and_partition artifacts/r15c_old r15c || { echo "TESTS FAILED"; exit 1; }
timeout 200 python3 bench/ab_gemm.py --out "$OUT/ab" --old-dir artifacts/r15c_old --m 1,8,16 \
  --shapes 4096x4096,14336x4096,8192x8192,28672x8192 --labels "u4b8 g128 fp16,fe4m3fn chan fp16,u4 g128,u4b8 g128 bf16" \
  --variants new,old --no-tinygemm > "$OUT/ab.log" 2>&1
echo "ab rc=$?"; grep -E "\[(new|old)\]|bitwise" "$OUT/ab.log" | sed -E 's/ +/ /g' | cut -c1-72; pack r15c
