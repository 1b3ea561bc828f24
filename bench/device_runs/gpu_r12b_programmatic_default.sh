#!/usr/bin/env bash
# Round 12b (issue #4): programmatic launches on by default, their shared memory pinned to the planned blocks per SM.
#   1. the whole GPU tier with it on, beside the partition check against HEAD before the change (artifacts/r12_old:
#      the launch changes no arithmetic, so every output bit must stay)
#   2. bench_gemm's full grid (BENCH_COMMIT set by the caller)
#   3. A/B of the bench types r12a did not time (u4 + zero points, u8b128, u4b8 bf16): new (programmatic, pinned) /
#      new-plain / old on the six layers at M = 1, 16
#   usage (device machine, repo root; carry .whl, artifacts/r12_old):
#     BENCH_COMMIT=<rev> RET=$OUT bash bench/device_runs/gpu_r12b_programmatic_default.sh
set -u
. bench/device_runs/device_env.sh
tier_and_partition artifacts/r12_old r12b || { echo "TESTS FAILED: no tables"; exit 1; }
mkdir -p "$OUT/results"
timeout 170 python3 bench/bench_gemm.py --out "$OUT/results" > "$OUT/bench_gemm.log" 2>&1; echo "bench_gemm rc=$?"
pack r12b
timeout 150 python3 bench/ab_gemm.py --out "$OUT/ab" --old-dir artifacts/r12_old --variants new,new-plain,old \
  --m 1,16 --no-tinygemm --labels "u4 g128+zp fp16,u8b128 g128 fp16,u4b8 g128 bf16" > "$OUT/ab.log" 2>&1
echo "ab rc=$?"; grep -hE "\[new" "$OUT/ab.log" | cut -c1-100; pack r12b
