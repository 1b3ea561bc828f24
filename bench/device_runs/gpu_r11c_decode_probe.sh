#!/usr/bin/env bash
# Round 11c, lead (issue #7): probe before building a decode path. The dense kernel on the "virtual" layer of an MoE
# phase at M = 1 (top_k experts side by side: K x top_k N) against the fused kernel on the same bytes, same call.
#   usage (device machine, repo root; carry .whl, artifacts/r11_self):
#     RET=$OUT bash bench/device_runs/gpu_r11c_decode_probe.sh
set -u
. bench/device_runs/device_env.sh
timeout 150 python3 bench/ab_gemm.py --out "$OUT/dense" --old-dir artifacts/r11_self --variants new,old --m 1,8 \
  --no-tinygemm --shapes 4096x28672,7168x16384,2048x8448 --labels "u4b8 g128 fp16" > "$OUT/dense.log" 2>&1
echo "dense rc=$?"; grep -hE "\[new\]|cuBLAS|copy" "$OUT/dense.log" | cut -c1-120 | head -20
timeout 150 python3 bench/bench_moe.py --out "$OUT/moe" --m 1,8 --paths fused > "$OUT/moe.log" 2>&1
echo "moe rc=$?"; tail -30 "$OUT/moe.log" | cut -c1-160; pack probe
