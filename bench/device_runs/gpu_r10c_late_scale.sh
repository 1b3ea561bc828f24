#!/usr/bin/env bash
# Round 10c, lead (issue #4), one call: scales applied to fp32 partial sums (WarpLoop::kLateScale, one m16 block).
#   1. tests/gpu (the whole tier; the bounds now hold one more rounding u for the weight) beside
#      bench/partition_check.py against this tree itself (artifacts/r10_self: the outputs change by design, so
#      "bitwise = OLD" is only repeatability here; the bound, poison and repeat checks are the point)
#   2. A/B against HEAD (artifacts/r10_old): u4b8 g128 fp16 M = 1, 8, 16 on every shape; FP8, u4 + zero points,
#      u4b8 bf16, u8b128 at M = 1, 16 on three shapes; the fused MoE at M = 1, 8, 64
#   usage (device machine, repo root; carry .whl, artifacts/r10_old, artifacts/r10_self):
#     RET=$OUT bash bench/device_runs/gpu_r10c_late_scale.sh
set -u
. bench/device_runs/device_env.sh
OLD=${AB_OLD:-artifacts/r10_old}
[ -n "${SKIP_TIER:-}" ] || tier_and_partition artifacts/r10_self r10c || { echo "TESTS FAILED: no A/B"; exit 1; }
timeout 120 python3 bench/ab_gemm.py --out "$OUT/ab" --old-dir "$OLD" --variants new,old --m 1,8,16 \
  --no-tinygemm --labels "u4b8 g128 fp16" > "$OUT/ab.log" 2>&1; echo "ab rc=$?"
grep -hE "\[(new|old)\]" "$OUT/ab.log" | cut -c1-100; pack r10c
timeout 120 python3 bench/ab_gemm.py --out "$OUT/ab2" --old-dir "$OLD" --variants new,old --m 1,16 --no-tinygemm \
  --shapes 4096x14336,8192x8192,28672x8192 \
  --labels "fe4m3fn chan fp16,u4 g128+zp fp16,u4b8 g128 bf16,u8b128 g128 fp16" > "$OUT/ab2.log" 2>&1
echo "ab2 rc=$?"; grep -hE "\[(new|old)\]" "$OUT/ab2.log" | cut -c1-100; pack r10c
timeout 60 python3 bench/bench_moe.py --out "$OUT/ab_moe" --ab-old "$OLD" --m 1,8,64 --reps 15 --variants new \
  > "$OUT/ab_moe.log" 2>&1; echo "ab_moe rc=$?"; tail -12 "$OUT/ab_moe.log"; pack r10c
