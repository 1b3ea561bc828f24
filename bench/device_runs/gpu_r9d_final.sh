#!/usr/bin/env bash
# Round 9d, lead (issue #4), one call: the cluster slice sums + pair policy (e26bbee) against ad901d3
# (artifacts/r9d_old), then the table at this commit.
#   1. tests/gpu (the whole tier) beside bench/partition_check.py (pair policy off there: OLD's tiles and grids, so
#      every run must equal OLD bitwise; clusters where a slice has two blocks)
#   2. A/B against ad901d3: u4b8 g128 fp16 M = 1, 8, 16; FP8 and u4 + zero points M = 1, 16 (cells whose tile or grid
#      the pair policy changed are not bitwise equal: another K split)
#   3. bench_gemm.py, the full table (BENCH_COMMIT set by the caller)
# First run (e26bbee): the tier failed in the two pair-policy cluster cases (their global-sum run switched the pair
# policy off with the sums: another tile); fixed in the test's commit, rerun with QUICK=1.
#   usage (device machine, repo root; carry .whl, artifacts/r9d_old):
#     BENCH_COMMIT=<rev> RET=$OUT bash bench/device_runs/gpu_r9d_final.sh
set -u
. bench/device_runs/device_env.sh
OLD=${AB_OLD:-artifacts/r9d_old}
mkdir -p "$OUT/results"
# QUICK=1 (second run, after a test-only fix): test_gemm's cluster cases instead of the tier, no partition check
if [ -n "${QUICK:-}" ]; then
  timeout 120 python3 -m pytest -p no:cacheprovider -q -rs tests/gpu/test_gemm.py -k cluster > "$OUT/gpu_tier.log" 2>&1 \
    || { tail -20 "$OUT/gpu_tier.log"; echo "TESTS FAILED: no A/B"; exit 1; }
  tail -1 "$OUT/gpu_tier.log"; pack r9d
else
  tier_and_partition "$OLD" r9d || { echo "TESTS FAILED: no A/B"; exit 1; }
fi
timeout 80 python3 bench/ab_gemm.py --out "$OUT/ab" --old-dir "$OLD" --variants new,old --m 1,8,16 --no-tinygemm \
  --labels "u4b8 g128 fp16" > "$OUT/ab.log" 2>&1; echo "ab rc=$?"
timeout 70 python3 bench/ab_gemm.py --out "$OUT/ab8" --old-dir "$OLD" --variants new,old --m 1,16 --no-tinygemm \
  --labels "fe4m3fn chan fp16,u4 g128+zp fp16" > "$OUT/ab8.log" 2>&1; echo "ab8 rc=$?"
grep -hE "\[(new|old)\]|bitwise" "$OUT/ab.log" "$OUT/ab8.log" | cut -c1-100; pack r9d
[ -n "${SKIP_BENCH:-}" ] && exit 0
timeout 170 python3 bench/bench_gemm.py --out "$OUT/results" > "$OUT/bench_gemm.log" 2>&1; echo "bench_gemm rc=$?"
tail -5 "$OUT/bench_gemm.log"; pack r9d
