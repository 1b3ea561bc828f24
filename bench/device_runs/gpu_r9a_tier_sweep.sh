#!/usr/bin/env bash
# Round 9a, lead (issue #4), one call: (1) the whole tests/gpu tier at HEAD (not run since the round-8g policy change;
# now with the two-stream full-grid test); (2) the configuration sweep on the cells that hold the ×2.5 bar: the two
# largest u4b8 layers at M = 1 and 16 (never swept since round 8's cheaper finishing) and 8192^2 at M = 1, 8, 16.
#   usage (device machine, repo root; carry .whl):  RET=$OUT bash bench/device_runs/gpu_r9a_tier_sweep.sh
set -u
. bench/device_runs/device_env.sh
s=$(date +%s)
timeout 300 python3 -m pytest -p no:cacheprovider -q -rs tests/gpu > "$OUT/gpu_tier.log" 2>&1
echo "gpu tier rc=$? after $(( $(date +%s) - s ))s" | tee -a "$OUT/gpu_tier.log"
tail -4 "$OUT/gpu_tier.log"; pack r9a
timeout 200 python3 bench/sweep_gemm.py --out "$OUT/sweep" --cells 26,27,24,25,1,13,17 --budget-s 180 \
  > "$OUT/sweep.log" 2>&1; echo "sweep rc=$?"
grep -A12 "^| cell" "$OUT/sweep.log" | head -14; ls "$OUT"; pack r9a
