#!/usr/bin/env bash
# Round 13f (issue #7): round 13e's kernel with no read-ahead past the CTA's last item (the next item's routing
# and output ids are loaded only when that item exists). r13e: V2-Lite-like M = 1 in lone calls 10.62 -> 11.36 µs
# (graph 6.23 -> 6.09), where every CTA has one item and its read-ahead read blocks it never runs, from DRAM after
# the flush. Prediction: M = 1 lone calls at old's time (+-3%), the rest as r13e. Then the whole GPU tier (the dense
# kernels are unchanged: the partition check must stay bitwise against r13_old).
#   1. tests/gpu/test_moe.py; 2. bench_moe A/B (lone calls, device time) against artifacts/r13_old (04db8d4);
#   3. the fused paths of the table (fused graph = the bar's timing, copy graph).
#   usage (device machine, repo root; carry .whl, artifacts/r13_old):
#     RET=$OUT bash bench/device_runs/gpu_r13f_moe_final.sh
set -u
. bench/device_runs/device_env.sh
mkdir -p "$OUT/ab" "$OUT/results"
timeout 200 python3 -m pytest -p no:cacheprovider -q -rs tests/gpu/test_moe.py > "$OUT/gpu_moe.log" 2>&1
echo "moe tests rc=$?" | tee -a "$OUT/gpu_moe.log"; tail -3 "$OUT/gpu_moe.log"; pack r13f
grep -q "rc=0" "$OUT/gpu_moe.log" || { echo "TESTS FAILED"; exit 1; }
timeout 250 python3 bench/bench_moe.py --out "$OUT/ab" --ab-old artifacts/r13_old --m 1,8,64 --variants "" \
  > "$OUT/ab.log" 2>&1; echo "ab rc=$?"; grep -E " (old|new) " "$OUT/ab.log" | cut -c1-110; pack r13f
timeout 150 python3 bench/bench_moe.py --out "$OUT/results" --paths fused > "$OUT/table.log" 2>&1
echo "table rc=$?"; tail -13 "$OUT/table.log" | cut -c1-250; pack r13f
tier_and_partition artifacts/r13_old r13f || { echo "TESTS FAILED"; exit 1; }
