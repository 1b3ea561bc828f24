#!/usr/bin/env bash
# Round 14j (issue #4), timing only: what the second cluster barrier of the slice sum costs. Its arrive has release
# semantics, which ptxas implements as MEMBAR.ALL.GPU, and the C stores are in flight then (ncu r14f: "membar"
# stalls 0.4-0.5 cycles per issued instruction on 4096^2). OLD (artifacts/r14j_relaxed) = this tree (cf7f1f6) with
# that arrive relaxed (barrier.cluster.arrive.relaxed.aligned + barrier.cluster.wait.aligned as the last
# cluster_sync of finish_slice_cluster); "new" = the tree. Cluster-sum kernels: 4096^2, 14336x4096, 8192^2, M = 1, 16.
#   usage (device machine, repo root; carry .whl, artifacts/r14j_relaxed):
#     RET=$OUT bash bench/device_runs/gpu_r14j_cluster_relaxed.sh
set -u
. bench/device_runs/device_env.sh
timeout 200 python3 bench/ab_gemm.py --out "$OUT/ab" --old-dir artifacts/r14j_relaxed --m 1,16 \
  --shapes 4096x4096,14336x4096,8192x8192 --labels "u4b8 g128 fp16,fe4m3fn chan fp16" --variants new,old \
  --no-tinygemm > "$OUT/ab.log" 2>&1
echo "ab rc=$?"; grep -E "\[(new|old)\]|bitwise" "$OUT/ab.log" | sed -E 's/ +/ /g' | cut -c1-72; pack r14j
