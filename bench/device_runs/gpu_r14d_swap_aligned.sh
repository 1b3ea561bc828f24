#!/usr/bin/env bash
# Round 14d (issue #4): swapped two-block kernels on the slice-aligned grid (gemm.ALIGNED_SWAP_TWO_BLOCKS, after sweep
# r14c: u4b8 8192x28672 M = 1 on 224 blocks 32.75 µs against 36.88 on the striped 264). tests/gpu's bench-shape file
# (the cells the policy changed, with bf16 there now), then the A/B against OLD (HEAD before round 14) on the layers
# both round-14 rules touch: 8192x28672 (this grid) and 14336x4096 / 4096^2 (the 512 x 64 pairs, r14b), 4-bit types.
#   usage (device machine, repo root; carry .whl, artifacts/r14_old):
#     RET=$OUT bash bench/device_runs/gpu_r14d_swap_aligned.sh
set -u
. bench/device_runs/device_env.sh
timeout 250 python3 -m pytest -p no:cacheprovider -q -rs tests/gpu/test_gemm_bench_shapes.py \
  > "$OUT/bench_shapes.log" 2>&1
echo "bench-shape tests rc=$?"; tail -3 "$OUT/bench_shapes.log"; pack r14d
grep -q " passed" "$OUT/bench_shapes.log" && ! grep -q " failed" "$OUT/bench_shapes.log" \
  || { echo "TESTS FAILED"; exit 1; }
timeout 250 python3 bench/ab_gemm.py --out "$OUT/ab" --old-dir artifacts/r14_old --m 1,8,16 \
  --shapes 8192x28672,14336x4096,4096x4096 --labels "u4b8,u4 g128" --variants new,old --no-tinygemm \
  > "$OUT/ab.log" 2>&1
echo "ab rc=$?"; grep -E "\[(new|old)\]" "$OUT/ab.log" | cut -c1-90; pack r14d
