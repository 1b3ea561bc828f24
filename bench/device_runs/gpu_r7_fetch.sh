#!/usr/bin/env bash
# Round 7, lead (issues #4 / #7): 8-bit tiles stored in shared memory as in global memory (a lane's two 16-byte
# halves no longer 512 bytes apart), so every warp's cp.async has contiguous destinations.
# (The first try also gave 4-bit tiles 512-byte rows per warp: no change, not kept.)
# Same bytes reach the same registers in the same order: every output must be bitwise = HEAD. Tests and A/B by
# bench/device_runs/gpu_r6_kernels.sh (same phases) with HEAD's copies in artifacts/r7_old; then the fetch-alone
# ablation (bench/ablation_probe.py nocompute) to compare with bench/pattern_probe.py's plain streaming reads.
#   usage (device machine, repo root; carry artifacts/r7_old = HEAD's gemm.py, moe.py, kernels_cuda/*)
set -u
OUT=${OUT:-$PWD/artifacts/gpu_out}
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-$PWD/artifacts/cupy_cache}
R6_KERNELS_OLD=artifacts/r7_old bash bench/device_runs/gpu_r6_kernels.sh || exit 1  # tests, then (if they pass) the A/B
# where the 4-bit kernel's fetch-alone time goes (it is ~1.6x bench/pattern_probe.py's plain cp.async ring): without
# the slice finishing too
timeout 120 python3 bench/ablation_probe.py --out "$OUT/ablation" --grids policy,aligned \
  --variants base,nocompute,nocompute_nofinish,nofinish \
  --cells "8192x28672:u4b8 g128 fp16:1,4096x14336:u4b8 g128 fp16:1,4096x4096:u4b8 g128 fp16:1,8192x28672:fe4m3fn chan fp16:1" \
  > "$OUT/ablation.log" 2>&1; grep K= "$OUT/ablation.log"
