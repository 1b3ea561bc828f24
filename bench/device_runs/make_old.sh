#!/usr/bin/env bash
# Run here (not on the device machine), before a device call that compares against HEAD: writes HEAD's GEMM and MoE
# kernels, workbench/gemm.py and workbench/moe.py into DIR (the layout bench/ab_gemm.py --old-dir, partition_check.py
# and bench_moe.py --ab-old load). Carry DIR with the call.
#   usage: bash bench/device_runs/make_old.sh artifacts/rNN_old
set -euo pipefail
dir=${1:?the folder to write, e.g. artifacts/r15f_old}
mkdir -p "$dir"
for f in marlin_gemm.cu marlin_mainloop.cuh dequant.cuh mma.cuh marlin_moe.cu; do
  git show "HEAD:kernels_cuda/$f" > "$dir/$f"
done
for f in gemm.py moe.py; do git show "HEAD:workbench/$f" > "$dir/$f"; done
