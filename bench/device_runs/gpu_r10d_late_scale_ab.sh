#!/usr/bin/env bash
# Round 10d, lead (issue #4): after round 10c's tier run (471 passed; 4 MoE cases failed only the one- vs two-CTA
# bitwise comparison, which now skips kernels that scale differently), the changed and new tests, then round 10c's
# A/B part (its tier step is skipped: the kernels are unchanged since that run).
#   usage (device machine, repo root; carry .whl, artifacts/r10_old, artifacts/r10_self):
#     RET=$OUT bash bench/device_runs/gpu_r10d_late_scale_ab.sh
set -u
. bench/device_runs/device_env.sh
timeout 150 python3 -m pytest -p no:cacheprovider -q tests/gpu/test_moe.py tests/gpu/test_gemm.py \
  -k "every_type or late_scaling" > "$OUT/tests.log" 2>&1
echo "tests rc=$?"; tail -1 "$OUT/tests.log"; grep -E "^FAILED" "$OUT/tests.log" | head; pack r10d
SKIP_TIER=1 RET=$RET bash bench/device_runs/gpu_r10c_late_scale.sh
