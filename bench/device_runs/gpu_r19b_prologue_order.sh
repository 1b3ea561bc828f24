#!/usr/bin/env bash
# Round 19b, lead (issue #4, session 16): the block's first weight fetch before the activations' pointer arithmetic.
# After 1026bbc (no padding-row zeroing) ~260-400 instructions a thread still ran before a block's first load, of them
# ~60-120 forming A's copy pointers, which that fetch does not need. new: A's pointers after griddepcontrol.wait
# (first LDGSTS at SASS instruction 268 instead of 392 on the 4096^2 M = 16 kernel); v1 (artifacts/r19b_v1): the same
# order in the source, where ptxas hoisted most of them back (326). A/B against both, u4b8 / u4 + zp / FP8 at M = 1 /
# 8 / 16; then the GPU tier and the partition check against HEAD (artifacts/r19b_old; bitwise). ~8 min.
#   usage (device machine, repo root; carry .whl, artifacts/r19b_old and artifacts/r19b_v1):
#     RET=$OUT bash bench/device_runs/gpu_r19b_prologue_order.sh
set -u
. bench/device_runs/device_env.sh
for old in r19b_old r19b_v1; do
  timeout 150 python3 bench/ab_gemm.py --out "$OUT/ab_$old" --old-dir artifacts/$old --m 1,8,16 \
    --labels "u4b8 g128 fp16,fe4m3fn chan fp16,u4 g128" --variants new,old --no-tinygemm > "$OUT/ab_$old.log" 2>&1
  echo "ab $old rc=$?"; pack r19b
done
tier_and_partition artifacts/r19b_old r19b || { echo "TESTS FAILED"; exit 1; }
