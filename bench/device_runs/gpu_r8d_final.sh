#!/usr/bin/env bash
# Round 8d, lead (issues #4 / #7), one call: the non-first contributors count in with red.release.gpu instead of
# __threadfence() + atomicAdd (sm_90 SASS: MEMBAR.ALL.GPU + REDG instead of MEMBAR.SC.GPU + CCTL.IVALL + ATOMG), the
# lock-ordered mode without the all-thread fence before its release store. Then the tables at this commit.
#   1. tests/gpu (the whole tier) beside bench/partition_check.py against the previous commit (artifacts/r8c_old)
#   2. A/B against it: u4b8 g128 fp16 M = 1, 16 and FP8 M = 1 (bench/ab_gemm.py; every cell must be bitwise equal)
#   3. bench_gemm.py and bench_moe.py, the full tables (BENCH_COMMIT set by the caller)
# Results tarred into $RET/r8d.tgz after each step (the device returns only a few files per call).
#   usage (device machine, repo root; carry .whl and artifacts/r8c_old):  RET=$OUT bash bench/device_runs/gpu_r8d_final.sh
set -u
. bench/device_runs/device_env.sh
OLD=${AB_OLD:-artifacts/r8c_old}
mkdir -p "$OUT/results"
tier_and_partition "$OLD" r8d || { echo "TESTS FAILED: no A/B, no tables"; exit 1; }
timeout 50 python3 bench/ab_gemm.py --out "$OUT/ab" --old-dir "$OLD" --variants new,old --m 1,16 --no-tinygemm \
  --labels "u4b8 g128 fp16" > "$OUT/ab.log" 2>&1; echo "ab rc=$?"
timeout 35 python3 bench/ab_gemm.py --out "$OUT/ab8" --old-dir "$OLD" --variants new,old --m 1 --no-tinygemm \
  --labels "fe4m3fn chan fp16" > "$OUT/ab8.log" 2>&1; echo "ab8 rc=$?"
grep -hE "\[(new|old)\]|bitwise" "$OUT/ab.log" "$OUT/ab8.log" | cut -c1-100; pack r8d
timeout 160 python3 bench/bench_gemm.py --out "$OUT/results" > "$OUT/bench_gemm.log" 2>&1; echo "bench_gemm rc=$?"; pack r8d
timeout 100 python3 bench/bench_moe.py --out "$OUT/results" > "$OUT/bench_moe.log" 2>&1; echo "bench_moe rc=$?"; pack r8d
tail -16 "$OUT/bench_moe.log"
