#!/usr/bin/env bash
# Round 15d, lead (issue #4, session 12): the swapped loop's 16-row form (KernelConfig.swap = 2: two mma per
# sub-block on the transposed problem) for M = 9..16, plain weights. Tier (with its new tests: identity rows exact,
# random data in the bound, one and two blocks per SM, clusters), partition check against HEAD, then A/B: new (the
# policy: row layout at M = 9..16, swap 1 at M <= 8 — bitwise HEAD's), new-swap16 (SWAP_MAX_M = 16: the swap
# policies of M <= 8 at M = 9..16), old (HEAD). Prediction: M = 16 near the swapped M = 8 times (14336x4096 11.5 us,
# 4096x14336 10.9) + 5-15%, i.e. -10..-15% against the row layout; the two-block kernels there run without late
# scaling (128 registers). Before the call: bash bench/device_runs/make_old.sh artifacts/r15d_old.
#   usage (device machine, repo root; carry .whl, artifacts/r15d_old):
#     RET=$OUT bash bench/device_runs/gpu_r15d_swap16.sh
set -u
. bench/device_runs/device_env.sh
if [ -n "${ONLY_NEW_TESTS:-}" ]; then  # (second call: the tier ran; its swap16 tests fixed)
  # (the swapped-loop tests: both forms' identity rows, the 16-row form's bound; "16_row" when r15d ran)
  timeout 120 python3 -m pytest -p no:cacheprovider -q -rs tests/gpu/test_gemm.py -k "swapped" > "$OUT/gpu_tier.log" 2>&1
  echo "swap16 tests rc=$?"; tail -3 "$OUT/gpu_tier.log"
else
  tier_and_partition artifacts/r15d_old r15d || { echo "TESTS FAILED"; exit 1; }
fi
timeout 300 python3 bench/ab_gemm.py --out "$OUT/ab" --old-dir artifacts/r15d_old --m 12,16 \
  --shapes 4096x4096,4096x14336,14336x4096,8192x8192,8192x28672,28672x8192 \
  --labels "u4b8 g128 fp16,u4b8 g128 bf16,fe4m3fn chan fp16" \
  --variants new,new-swap16,old --no-tinygemm > "$OUT/ab.log" 2>&1
echo "ab rc=$?"; grep -E "\[(new|new-swap16|old)\]" "$OUT/ab.log" | sed -E 's/ +/ /g' | cut -c1-80; pack r15d
