#!/usr/bin/env bash
# Round 13b (issue #4): every prologue stage's weights fetched before the programmatic wait, the prologue's activations
# after it with plain loads (kernels_cuda/marlin_gemm.cu). Prediction: blocks that start while the grid before still
# runs have the whole prologue in flight at the wait: -0.3..-0.8 µs on the one-block-per-SM layers (4096², the
# 4096-wide ones), most where the prologue is a large part of a block's range (4096² pairs: 3 of 8 steps; M = 16 rows
# kernels: 7 of 16); plain launches unchanged (+-2%). A/B new / old / new-plain / old-plain (old = artifacts/r13_old,
# HEAD 04db8d4) on the six layers at M = 1, 8, 16; then the GPU tier and the partition check against r13_old
# (the same partition and the same fp operations: every bit must stay).
# Refuted and not landed (bench/NOTES_gemm.md "Round 13" item 2): the kernel change is no longer in the tree.
#   usage (device machine, repo root; carry .whl, artifacts/r13_old):
#     RET=$OUT bash bench/device_runs/gpu_r13b_deep_prologue.sh
set -u
. bench/device_runs/device_env.sh
timeout 300 python3 bench/ab_gemm.py --out "$OUT/ab" --old-dir artifacts/r13_old \
  --variants new,old,new-plain,old-plain --m 1,8,16 --no-tinygemm \
  --labels "u4b8 g128 fp16,fe4m3fn chan fp16,u4 g128+zp fp16" > "$OUT/ab.log" 2>&1; echo "ab rc=$?"
grep -hE "\[(new|old)" "$OUT/ab.log" | cut -c1-90; grep -c "bitwise equal: False" "$OUT/ab.log"; pack r13b
tier_and_partition artifacts/r13_old r13b || { echo "TESTS FAILED"; exit 1; }
