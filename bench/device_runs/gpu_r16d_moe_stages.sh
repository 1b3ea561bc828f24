#!/usr/bin/env bash
# Round 16d, lead: does round 16's finding (a 3-stage ring beat deeper ones on the dense one-block pairs) carry over
# to the fused MoE kernel's one-CTA configurations (stage order 8, 6, 4, 3 since round 3)? bench_moe.py's A/B of lone
# calls against HEAD, variants new-s3 / new-s4 (workbench.moe.MOE_ONE_BLOCK_STAGES = (3, 4, 6, 8) / (4, 3, 6, 8)),
# timed only where they change the kernel (mixtral M >= 16 with 32-row items, dsv2-lite M = 1). Outputs are compared
# with old's (the stage count does not change the sums: bitwise equal expected).
# Before the call:  bash bench/device_runs/make_old.sh artifacts/r16d_old
#   usage (device machine, repo root; carry .whl, artifacts/r16d_old):
#     RET=$OUT bash bench/device_runs/gpu_r16d_moe_stages.sh
set -u
. bench/device_runs/device_env.sh
mkdir -p "$OUT/ab"
timeout 300 python3 bench/bench_moe.py --out "$OUT/ab" --ab-old artifacts/r16d_old --m 1,16,32,64 \
  --variants new-s3,new-s4 > "$OUT/ab.log" 2>&1; echo "ab rc=$?"
grep -E " (old|new|new-s3|new-s4) " "$OUT/ab.log" | cut -c1-120; tail -3 "$OUT/ab.log" | cut -c1-200; pack r16d
