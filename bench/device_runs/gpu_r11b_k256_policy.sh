#!/usr/bin/env bash
# Round 11b, lead (issue #4): the 256 x 64 tile before 128 x 64 in the small-M order (pairs on 4096-column layers),
# after sweep r11a. The whole GPU tier and the partition check (against the tree itself: late scaling now reaches the
# M = 16 pairs, so outputs differ from HEAD's by design), then an A/B against HEAD (artifacts/r11_old) on the two
# 4096-column bench layers for every bench type at M = 1, 8, 16.
#   usage (device machine, repo root; carry .whl, artifacts/r11_old, artifacts/r11_self):
#     RET=$OUT bash bench/device_runs/gpu_r11b_k256_policy.sh
set -u
. bench/device_runs/device_env.sh
[ -n "${SKIP_TIER:-}" ] || tier_and_partition artifacts/r11_self r11b || { echo "TESTS FAILED: no A/B"; exit 1; }
timeout 200 python3 bench/ab_gemm.py --out "$OUT/ab" --old-dir artifacts/r11_old --variants new,old --m 1,8,16 \
  --no-tinygemm --shapes 4096x4096,14336x4096 > "$OUT/ab.log" 2>&1; echo "ab rc=$?"
grep -hE "\[(new|old)\]" "$OUT/ab.log" | cut -c1-100; pack r11b
