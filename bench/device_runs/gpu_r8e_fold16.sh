#!/usr/bin/env bash
# Round 8e, lead (issue #4): the one-pass warp fold for the row-layout one-m16-block kernels (M = 9..16; the fold
# buffer +8 KiB for 4 k groups). Tests (tests/gpu test_gemm + test_moe, partition check bitwise = d5752a2 in
# artifacts/r8e_old), then A/B u4b8 M = 1, 16 and u4 + zero points M = 16 (dense), and the fused MoE (its 16-row
# items fold the same way; its M = 1 kernels only got the larger buffer).
#   usage (device machine, repo root; carry .whl and artifacts/r8e_old):  RET=$OUT bash bench/device_runs/gpu_r8e_fold16.sh
set -u
. bench/device_runs/device_env.sh
OLD=${AB_OLD:-artifacts/r8e_old}
OUT=$OUT SKIP_AB=1 R6_KERNELS_OLD="$OLD" bash bench/device_runs/gpu_r6_kernels.sh || { pack r8e; exit 1; }
pack r8e
timeout 60 python3 bench/ab_gemm.py --out "$OUT/ab" --old-dir "$OLD" --variants new,old --m 1,16 --no-tinygemm \
  --labels "u4b8 g128 fp16,u4 g128+zp fp16" > "$OUT/ab.log" 2>&1; echo "ab rc=$?"
grep -hE "\[(new|old)\]|bitwise" "$OUT/ab.log" | cut -c1-100; pack r8e
timeout 40 python3 bench/bench_moe.py --out "$OUT/ab_moe" --ab-old "$OLD" --m 1,8,64 --reps 15 --variants new \
  > "$OUT/ab_moe.log" 2>&1; echo "ab moe rc=$?"; tail -12 "$OUT/ab_moe.log"; pack r8e
