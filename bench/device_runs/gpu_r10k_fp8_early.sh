#!/usr/bin/env bash
# Round 10k, lead (issue #4): FP8 kernels back to scaling every pair (no late scaling: the f9a717c grid had FP8
# 4096^2 M <= 8 1.7-2.8% slower than 1030a5c). Tests of the identity / swapped / late-scaling cases, then an A/B
# against f9a717c (artifacts/r10k_old) on the FP8 cells of the 4096-wide layers and 8192^2.
#   usage (device machine, repo root; carry .whl, artifacts/r10k_old):
#     RET=$OUT bash bench/device_runs/gpu_r10k_fp8_early.sh
set -u
. bench/device_runs/device_env.sh
timeout 120 python3 -m pytest -p no:cacheprovider -q tests/gpu/test_gemm.py -k "identity or late_scaling or arange" \
  > "$OUT/tests.log" 2>&1
echo "tests rc=$?"; tail -1 "$OUT/tests.log"; grep -E "^FAILED" "$OUT/tests.log" | head; pack r10k
timeout 100 python3 bench/ab_gemm.py --out "$OUT/ab" --old-dir artifacts/r10k_old --variants new,old --m 1,4,16 \
  --no-tinygemm --shapes 4096x4096,14336x4096,8192x8192 --labels "fe4m3fn chan fp16" > "$OUT/ab.log" 2>&1
echo "ab rc=$?"; grep -hE "\[(new|old)\]" "$OUT/ab.log" | cut -c1-100; pack r10k
