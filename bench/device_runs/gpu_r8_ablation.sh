#!/usr/bin/env bash
# Round 8, lead (issue #4): where the dense kernel's time goes after the first-contributor slice sum and the one-pass
# warp fold (NOTES_gemm.md "Round 8"): bench/ablation_probe.py's base / sinkfinish / nofold / finish_return on the
# default cells plus M = 16 on 8192^2 and 4096x14336 and FP8 M = 16. The run at eb4ac32 also timed a variant
# inline_m1 (the finishing inlined in the two-block M = 16 kernels: landed after it, so the probe no longer has it).
#   usage (device machine, repo root, numpy wheel installed, PYTHONPATH exported)
set -u
OUT=${OUT:-$PWD/artifacts/gpu_out}
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-$PWD/artifacts/cupy_cache}
CELLS="8192x28672:u4b8 g128 fp16:1,8192x28672:u4b8 g128 fp16:16,4096x14336:u4b8 g128 fp16:1,\
4096x14336:u4b8 g128 fp16:16,4096x4096:u4b8 g128 fp16:1,8192x8192:u4b8 g128 fp16:1,8192x8192:u4b8 g128 fp16:16,\
8192x28672:fe4m3fn chan fp16:1,8192x28672:fe4m3fn chan fp16:16"
timeout 400 python3 bench/ablation_probe.py --out "$OUT/ablation" --cells "$CELLS" \
  --variants base,sinkfinish,nofold,finish_return > "$OUT/ablation.log" 2>&1
echo "ablation rc=$?"
grep -E "^K=" "$OUT/ablation.log"
