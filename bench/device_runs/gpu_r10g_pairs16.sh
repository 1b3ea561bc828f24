#!/usr/bin/env bash
# Round 10g, lead (issue #4): the pair policy's long-range exception widened to fp16 M = 9..16 (rows layout, late
# scaling flushing once per stage), after sweep r10f (u4b8 28672x8192 M = 16: two blocks per SM 44.63 -> pairs
# 43.07 µs). The bench-shape tests of 28672x8192 and the cluster cases, then an A/B against e6c5469
# (artifacts/r10_self) at M = 12, 16 (u4b8 fp16 changes; u4b8 bf16 and u4 + zero points must not).
#   usage (device machine, repo root; carry .whl, artifacts/r10_self):
#     RET=$OUT bash bench/device_runs/gpu_r10g_pairs16.sh
set -u
. bench/device_runs/device_env.sh
timeout 150 python3 -m pytest -p no:cacheprovider -q tests/gpu/test_gemm_bench_shapes.py tests/gpu/test_gemm.py \
  -k "28672 or cluster or late_scaling" > "$OUT/tests.log" 2>&1
echo "tests rc=$?"; tail -1 "$OUT/tests.log"; grep -E "^FAILED" "$OUT/tests.log" | head; pack r10g
timeout 120 python3 bench/ab_gemm.py --out "$OUT/ab" --old-dir artifacts/r10_self --variants new,old --m 12,16 \
  --no-tinygemm --shapes 28672x8192 --labels "u4b8 g128 fp16,u4b8 g128 bf16,u4 g128+zp fp16" > "$OUT/ab.log" 2>&1
echo "ab rc=$?"; grep -hE "\[(new|old)\]" "$OUT/ab.log" | cut -c1-100; pack r10g
