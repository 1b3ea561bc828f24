#!/usr/bin/env bash
# Round 9b, lead (issue #4), one call: slice sums inside thread-block clusters on sm_90 (marlin_gemm_cluster: slice-
# aligned grids with 2 / 4 / 8 blocks per slice sum their partials through distributed shared memory, in the fp32
# reduction's order, instead of C_tmp slots + lock + the first contributor's wait).
#   1. tests/gpu (the whole tier: the bench shapes now run clusters by default; test_gemm's cluster cases compare
#      them bit for bit with the global sum) beside bench/partition_check.py against HEAD (artifacts/r9_old)
#   2. A/B against HEAD: u4b8 g128 fp16 M = 1, 16 and u4 + zero points M = 1, FP8 M = 1, 16 (new, old, new-nocluster);
#      every cell must be bitwise equal to old
#   usage (device machine, repo root; carry .whl and artifacts/r9_old):  RET=$OUT bash bench/device_runs/gpu_r9b_cluster.sh
set -u
. bench/device_runs/device_env.sh
OLD=${AB_OLD:-artifacts/r9_old}
tier_and_partition "$OLD" r9b || { echo "TESTS FAILED: no A/B"; exit 1; }
timeout 110 python3 bench/ab_gemm.py --out "$OUT/ab" --old-dir "$OLD" --variants new,old,new-nocluster --m 1,16 \
  --no-tinygemm --labels "u4b8 g128 fp16" > "$OUT/ab.log" 2>&1; echo "ab rc=$?"
grep -hE "\[(new|old|new-nocluster)\]|bitwise" "$OUT/ab.log" | cut -c1-110; pack r9b
timeout 90 python3 bench/ab_gemm.py --out "$OUT/ab8" --old-dir "$OLD" --variants new,old --m 1,16 --no-tinygemm \
  --labels "fe4m3fn chan fp16,u4 g128+zp fp16" > "$OUT/ab8.log" 2>&1; echo "ab8 rc=$?"
grep -hE "\[(new|old)\]|bitwise" "$OUT/ab8.log" | cut -c1-110; pack r9b
