#!/usr/bin/env bash
# Round 12a (prepared in session 8, not run; issue #4): why two configurations launched in clusters of two lose under
# programmatic dependent launches (round 11g: u4b8 14336x4096 M = 1 13.75 -> 16.88 µs, FP8 4096x14336 M = 1 19.00 ->
# 25.29) while other cluster launches gain. Hypothesis: the next grid's clusters, placed on the GPCs as pairs of SMs
# free up, end on a worse placement than a fresh launch. Test: the same cells with programmatic launches and the
# slice sums in global memory (same tiles and grids, no clusters): if the loss goes, it is the cluster placement.
# Cells that gained (4096^2, 8192^2) beside them. Then, if nsys is on the machine, one timeline of each losing cell.
#   usage (device machine, repo root; carry .whl, artifacts/<HEAD copy>):
#     OLD=artifacts/<dir> RET=$OUT bash bench/device_runs/gpu_r12a_programmatic_clusters.sh
set -u
. bench/device_runs/device_env.sh
OLD=${OLD:?a HEAD copy of workbench/gemm.py and kernels_cuda/* (bench/device_runs/README.md)}
timeout 200 python3 bench/ab_gemm.py --out "$OUT/ab" --old-dir "$OLD" \
  --variants new-plain,new-programmatic,new-programmatic-nocluster,old --m 1,16 --no-tinygemm \
  --shapes 14336x4096,4096x14336,4096x4096,8192x8192 --labels "u4b8 g128 fp16,fe4m3fn chan fp16" \
  > "$OUT/ab.log" 2>&1; echo "ab rc=$?"; grep -hE "\[new" "$OUT/ab.log" | cut -c1-110; pack r12a
if command -v nsys > /dev/null; then
  WORKBENCH_PROGRAMMATIC_LAUNCH=1 timeout 120 nsys profile -o "$OUT/r12a_u4b8_14336x4096" --force-overwrite true \
    python3 bench/ab_gemm.py --out "$OUT/nsys_ab" --old-dir "$OLD" --variants new,old --m 1 --no-tinygemm \
    --shapes 14336x4096 --labels "u4b8 g128 fp16" > "$OUT/nsys.log" 2>&1; echo "nsys rc=$?"; pack r12a
fi
