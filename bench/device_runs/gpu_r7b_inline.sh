#!/usr/bin/env bash
# Round 7b, lead (issues #4 / #7): the slice finishing inlined into the dense kernel for one-m16-block configurations
# (M <= 16), after bench/ablation_probe.py found the out-of-line call alone costing ~10 us on 8192x28672 M = 1
# (bench/NOTES_gemm.md "Round 7"). Same operations in the same order: outputs must be bitwise = HEAD.
# Tests and A/B by bench/device_runs/gpu_r6_kernels.sh with HEAD's copies in artifacts/r7b_old, then the ablation
# (base vs sinkfinish: what the finishing still costs).
#   usage (device machine, repo root; carry artifacts/r7b_old = HEAD's gemm.py, moe.py, kernels_cuda/*)
set -u
OUT=${OUT:-$PWD/artifacts/gpu_out}
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-$PWD/artifacts/cupy_cache}
R6_KERNELS_OLD=artifacts/r7b_old bash bench/device_runs/gpu_r6_kernels.sh || exit 1  # tests, then (if they pass) the A/B
timeout 100 python3 bench/ablation_probe.py --out "$OUT/ablation" --grids policy --variants base,sinkfinish \
  --cells "8192x28672:u4b8 g128 fp16:1,4096x14336:u4b8 g128 fp16:1,4096x4096:u4b8 g128 fp16:1,8192x28672:fe4m3fn chan fp16:1,8192x28672:u4b8 g128 fp16:16" \
  > "$OUT/ablation.log" 2>&1; grep K= "$OUT/ablation.log"
