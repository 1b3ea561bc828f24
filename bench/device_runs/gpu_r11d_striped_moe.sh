#!/usr/bin/env bash
# Round 11d, lead (issues #7, #4); ran with bench/attic/moe_round11_striped_phase.patch applied (not landed: the
# striped form lost). Decode-sized MoE phases on the dense kernel's partition (marlin_gemm_moe; the
# finishing's output rows behind DenseRows / MoeRows), with r11b's tile order. The whole GPU tier and the partition
# check against HEAD (artifacts/r11_old: the dense refactor must keep every bit), then the MoE A/B (M = 1, 4, 8:
# 1 and 4 take the striped path where entries <= 8) and a dense A/B on shapes the tile order leaves alone (the
# refactored finishing must not cost time).
#   usage (device machine, repo root; carry .whl, artifacts/r11_old):
#     RET=$OUT bash bench/device_runs/gpu_r11d_striped_moe.sh
set -u
. bench/device_runs/device_env.sh
[ -n "${SKIP_TIER:-}" ] || tier_and_partition artifacts/r11_old r11d || { echo "TESTS FAILED: no A/B"; exit 1; }
timeout 150 python3 bench/bench_moe.py --out "$OUT/ab_moe" --ab-old artifacts/r11_old --m 1,4,8 --reps 15 \
  --variants new > "$OUT/ab_moe.log" 2>&1; echo "ab_moe rc=$?"; tail -14 "$OUT/ab_moe.log"; pack r11d
timeout 120 python3 bench/ab_gemm.py --out "$OUT/ab" --old-dir artifacts/r11_old --variants new,old --m 1,16 \
  --no-tinygemm --shapes 8192x8192,28672x8192,8192x28672 --labels "u4b8 g128 fp16,fe4m3fn chan fp16" \
  > "$OUT/ab.log" 2>&1; echo "ab rc=$?"; grep -hE "\[(new|old)\]" "$OUT/ab.log" | cut -c1-100; pack r11d
