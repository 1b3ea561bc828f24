#!/usr/bin/env bash
# Round 13d (issue #7): round 13c's routing read-ahead, with the finishing's output-row ids loaded an item ahead
# (the first item's at the kernel's start, before any copy) and their router weights when an item starts. r13c loaded
# both when an item started, the weights depending on the ids: used at once behind the ring of copies, they cost the
# one-item CTAs of V2-Lite-like M = 1 ~1 µs (10.43 -> 11.46 µs) while every other cell gained 1-6%. Prediction: M = 1
# back to old or better, the other cells as r13c; every output bitwise equal.
#   1. tests/gpu/test_moe.py; 2. bench_moe A/B (lone calls, device time) against artifacts/r13_old (04db8d4);
#   3. the fused paths of the table (fused graph = the bar's timing, copy graph).
#   usage (device machine, repo root; carry .whl, artifacts/r13_old):
#     RET=$OUT bash bench/device_runs/gpu_r13d_moe_out_rows.sh
set -u
. bench/device_runs/device_env.sh
mkdir -p "$OUT/ab" "$OUT/results"
timeout 200 python3 -m pytest -p no:cacheprovider -q -rs tests/gpu/test_moe.py > "$OUT/gpu_moe.log" 2>&1
echo "moe tests rc=$?" | tee -a "$OUT/gpu_moe.log"; tail -3 "$OUT/gpu_moe.log"; pack r13d
grep -q "rc=0" "$OUT/gpu_moe.log" || { echo "TESTS FAILED"; exit 1; }
timeout 250 python3 bench/bench_moe.py --out "$OUT/ab" --ab-old artifacts/r13_old --m 1,8,64 --variants "" \
  > "$OUT/ab.log" 2>&1; echo "ab rc=$?"; grep -E " (old|new) " "$OUT/ab.log" | cut -c1-110; pack r13d
timeout 150 python3 bench/bench_moe.py --out "$OUT/results" --paths fused > "$OUT/table.log" 2>&1
echo "table rc=$?"; tail -13 "$OUT/table.log" | cut -c1-250; pack r13d
