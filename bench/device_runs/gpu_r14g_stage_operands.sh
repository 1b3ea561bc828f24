#!/usr/bin/env bash
# Round 14g (issue #4), timing only: the shared stage loop without the group reload between a warp's k16 tiles
# (kStageReloads false: wrong for G < 16 K_WARP, right for the bench's g128 and channelwise) and with every tile's
# weight words and A fragments loaded at the stage's start (kPreload, 16-row tiles). After ncu r14f: 2 warps per
# scheduler, ~43% issue, "wait" ~1.1 cycles per instruction; the SASS has one scheduling region per k16 tile.
# A/B: the tree (both) against HEAD (artifacts/r14_head) and against artifacts/r14_v1 (no reload only). The
# variant's source is bench/attic/gemm_r14g_stage_operands.patch (r14_v1; the tree had kPreload = M_BLOCKS == 1).
#   usage (device machine, repo root; carry .whl, artifacts/r14_head, artifacts/r14_v1):
#     RET=$OUT bash bench/device_runs/gpu_r14g_stage_operands.sh
set -u
. bench/device_runs/device_env.sh
for old in r14_head r14_v1; do
  timeout 200 python3 bench/ab_gemm.py --out "$OUT/ab_$old" --old-dir "artifacts/$old" --m 1,16 \
    --shapes 14336x4096,4096x4096,8192x8192,4096x14336,8192x28672 --labels "u4b8 g128 fp16,fe4m3fn chan fp16" \
    --variants new,old --no-tinygemm > "$OUT/ab_$old.log" 2>&1
  echo "ab vs $old rc=$?"; grep -E "\[(new|old)\]|bitwise" "$OUT/ab_$old.log" | sed -E 's/ +/ /g' | cut -c1-75
  pack r14g
done
