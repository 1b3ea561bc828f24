#!/usr/bin/env bash
# Round 13i (issue #7): bench_moe's A/B mode now also times each variant as the table's "fused graph" (the bar's
# method: 20 phases on rotated routings in a CUDA graph, 3 interleaved rounds). Old (artifacts/r13_old, 04db8d4)
# against new (the routing read ahead, 2596834) at M = 1, 8, 64: the graph comparison interleaved on the same
# routings, which r13c-r13f had only from separate table runs.
#   usage (device machine, repo root; carry .whl, artifacts/r13_old):
#     RET=$OUT bash bench/device_runs/gpu_r13i_moe_ab_graph.sh
set -u
. bench/device_runs/device_env.sh
mkdir -p "$OUT/ab"
timeout 250 python3 bench/bench_moe.py --out "$OUT/ab" --ab-old artifacts/r13_old --m 1,8,64 --variants "" \
  > "$OUT/ab.log" 2>&1; echo "ab rc=$?"; grep -E " (old|new) |^\|" "$OUT/ab.log" | cut -c1-200; pack r13i
