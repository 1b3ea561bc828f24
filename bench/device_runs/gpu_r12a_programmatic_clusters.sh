#!/usr/bin/env bash
# Round 12a (issue #4): why two configurations lose under programmatic dependent launches (round 11g: u4b8 14336x4096
# M = 1 13.75 -> 16.88 µs, FP8 4096x14336 M = 1 19.00 -> 25.29) while others gain. Hypotheses: (1) stacking: a
# programmatic grid's blocks take whatever SM space is free while the grid before runs, so the SMs that grid leaves
# idle (grids of fewer blocks than SMs) take as many blocks as fit, where a fresh launch spreads them one per SM; the
# pinned launch (PROGRAMMATIC_PIN_OCCUPANCY, new-programmatic) asks for enough shared memory that only the planned
# blocks per SM fit, new-programmatic-unpinned is round 11g's launch; (2) cluster placement: new-programmatic-nocluster
# sums slices in global memory on the same tiles and grids. ab rows carry resident= (blocks per SM that fit unpinned).
# Then, if the pinned launch loses nowhere, a wider A/B (six layers, M = 1 to 256, u4b8 and FP8) for the default.
#   usage (device machine, repo root; carry .whl, artifacts/r12_old):
#     RET=$OUT bash bench/device_runs/gpu_r12a_programmatic_clusters.sh
set -u
. bench/device_runs/device_env.sh
OLD=artifacts/r12_old
timeout 200 python3 bench/ab_gemm.py --out "$OUT/ab" --old-dir "$OLD" \
  --variants new-programmatic,new-programmatic-unpinned,new-programmatic-nocluster,new-plain,old --m 1,16 \
  --no-tinygemm --shapes 14336x4096,4096x14336,4096x4096,8192x8192 --labels "u4b8 g128 fp16,fe4m3fn chan fp16" \
  > "$OUT/ab.log" 2>&1; echo "ab rc=$?"; grep -hE "\[new" "$OUT/ab.log" | cut -c1-120; pack r12a
timeout 330 python3 bench/ab_gemm.py --out "$OUT/ab_wide" --old-dir "$OLD" \
  --variants new-programmatic,new-plain,old --m 1,4,16,64,256 --no-tinygemm \
  --labels "u4b8 g128 fp16,fe4m3fn chan fp16" > "$OUT/ab_wide.log" 2>&1; echo "ab wide rc=$?"
grep -hE "\[new" "$OUT/ab_wide.log" | cut -c1-100; pack r12a
