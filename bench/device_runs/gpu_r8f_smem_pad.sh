#!/usr/bin/env bash
# Round 8f, lead: diagnostic for round 8e's slowdown. artifacts/r8f_pad = this tree's kernels with workbench/gemm.py
# launching one-m16-block kernels with 4 k groups with 8 KiB more dynamic shared memory than they use (nothing else
# differs). If the padded "old" is ~7% slower at M = 16 too, the cost was the shared-memory carve-out (less L1), not
# the one-pass fold. A/B u4b8 g128 fp16 M = 1, 16.
# First run: no result. The padded launch failed with CUDA_ERROR_INVALID_VALUE (raised, nothing aborted): both modules
# resolve the same kernel name to one function whose max dynamic shared-memory attribute the unpadded module set. A
# second run gives the padded copy its own kernel name: a dummy template argument `int PAD = 0` after SWAP in its
# marlin_gemm.cu, and name_expression ending in ", 1>" in its gemm.py. Result: padded = unpadded within ±0.4%
# (NOTES_gemm.md "Round 8" item 7).
#   usage (device machine, repo root; carry .whl and artifacts/r8f_pad):  RET=$OUT bash bench/device_runs/gpu_r8f_smem_pad.sh
set -u
. bench/device_runs/device_env.sh
timeout 60 python3 bench/ab_gemm.py --out "$OUT/ab" --old-dir artifacts/r8f_pad --variants new,old --m 1,16 \
  --no-tinygemm --labels "u4b8 g128 fp16" > "$OUT/ab.log" 2>&1; echo "ab rc=$?"
grep -hE "\[(new|old)\]|bitwise" "$OUT/ab.log" | cut -c1-100
pack r8f
