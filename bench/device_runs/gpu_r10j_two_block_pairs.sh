#!/usr/bin/env bash
# Round 10j, lead (issue #4): pairs of two-block kernels (choose_config: the first-choice tile's slices fill 80-100%
# of the SMs at two blocks each; swapped fp16 4-bit without zero points), after sweep r10i (u4b8 4096x14336 M = 1
# 13.76 -> 12.65 µs). Tests (cluster cases, the 4096x14336 bench shapes), then an A/B against HEAD before it
# (artifacts/r10h_old) on 4096x14336 and 8192x14336 (not a bench shape; the rule's other H200 case) at M = 1, 4, 8.
#   usage (device machine, repo root; carry .whl, artifacts/r10h_old):
#     RET=$OUT bash bench/device_runs/gpu_r10j_two_block_pairs.sh
set -u
. bench/device_runs/device_env.sh
timeout 150 python3 -m pytest -p no:cacheprovider -q tests/gpu/test_gemm_bench_shapes.py tests/gpu/test_gemm.py \
  -k "14336 or cluster" > "$OUT/tests.log" 2>&1
echo "tests rc=$?"; tail -1 "$OUT/tests.log"; grep -E "^FAILED" "$OUT/tests.log" | head; pack r10j
timeout 120 python3 bench/ab_gemm.py --out "$OUT/ab" --old-dir artifacts/r10h_old --variants new,old --m 1,4,8 \
  --no-tinygemm --shapes 4096x14336,8192x14336 --labels "u4b8 g128 fp16" > "$OUT/ab.log" 2>&1
echo "ab rc=$?"; grep -hE "\[(new|old)\]" "$OUT/ab.log" | cut -c1-100; pack r10j
