#!/usr/bin/env bash
# Round 6, engineer "kernels" (issues #4 / #7): a lean per-stage fetch and loop bookkeeping in the shared main loop
# (kernels_cuda/marlin_mainloop.cuh, marlin_gemm.cu, marlin_moe.cu): per-thread global pointers formed once per slice
# (dense) / item (MoE), B copies of a thread at compile-time offsets, stage slots as 32-bit shared addresses with
# compile-time offsets (one slot = one whole stage), dense A at M <= 16 copies only rows < M (padding zeroed once).
# Same bytes in shared memory, same fp operations in the same order: every output must be bitwise = HEAD.
#   usage (device machine, repo root, numpy wheel installed, PYTHONPATH exported, carry artifacts/r6_kernels_old):
#     bash bench/device_runs/gpu_r6_kernels.sh            tests, then A/B
#     SKIP_AB=1 bash bench/device_runs/gpu_r6_kernels.sh  tests only (<= 140 s): tests/gpu/test_gemm.py,
#                                             tests/gpu/test_moe.py and bench/partition_check.py (bitwise = HEAD),
#                                             in parallel
#     ONLY_AB=1 bash bench/device_runs/gpu_r6_kernels.sh  A/B only (<= 150 s): dense GEMM (bench/ab_gemm.py: old, new;
#                                             8-bit also new-8bit2 = two blocks per SM for 8-bit weights) and fused
#                                             MoE (bench/bench_moe.py --ab-old: old, new); old = HEAD copies in
#                                             $R6_KERNELS_OLD
# Writes $OUT/kernels/{gemm_tests.log, moe_tests.log, partition_check.log, ab_gemm*.log, ab_gemm*/, ab_moe.log,
# ab_moe/, summary.txt}; ends by printing old / new / ratio / bitwise per cell.
set -u
OUT=${OUT:-$PWD/artifacts/gpu_out}
D="$OUT/kernels"
OLD=${R6_KERNELS_OLD:-artifacts/r6_kernels_old}
mkdir -p "$D"
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-$PWD/artifacts/cupy_cache} NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0 \
  NUMBA_CUDA_WARN_ON_IMPLICIT_COPY=0
for f in gemm.py moe.py marlin_gemm.cu marlin_moe.cu marlin_mainloop.cuh dequant.cuh mma.cuh; do
  [ -f "$OLD/$f" ] || { echo "missing $OLD/$f (carry $OLD)"; exit 2; }
done

if [ -z "${ONLY_AB:-}" ]; then
start=$(date +%s)
timeout 140 python3 -m pytest -p no:cacheprovider -x -q -rs tests/gpu/test_gemm.py > "$D/gemm_tests.log" 2>&1 &
p_gemm=$!
timeout 140 python3 -m pytest -p no:cacheprovider -x -q -rs tests/gpu/test_moe.py > "$D/moe_tests.log" 2>&1 &
p_moe=$!
# Partitions tests/gpu does not reach (few "SMs": blocks straddle / share slices; one and two m16 chunks, padding
# rows, G < BK): within the fp32 bound, C fully written, repeatable, and bitwise = HEAD in every run.
timeout 140 python3 bench/partition_check.py "$OLD" > "$D/partition_check.log" 2>&1 &
p_part=$!
wait $p_gemm; echo "gemm tests: pytest rc=$? after $(( $(date +%s) - start ))s" | tee -a "$D/gemm_tests.log"
wait $p_moe; echo "moe tests: pytest rc=$? after $(( $(date +%s) - start ))s" | tee -a "$D/moe_tests.log"
wait $p_part; echo "partition check: rc=$? after $(( $(date +%s) - start ))s" | tee -a "$D/partition_check.log"
tail -3 "$D/gemm_tests.log" "$D/moe_tests.log" "$D/partition_check.log"
# no A/B of a tree that fails its tests (exit status 1 tells a calling round script to stop too)
if grep -qE "rc=[1-9]" "$D"/*_tests.log "$D/partition_check.log"; then echo "TESTS FAILED: no A/B"; exit 1; fi
fi

if [ -z "${SKIP_AB:-}" ]; then
# Dense: old (HEAD) vs new on the same weights, interleaved (CUDA graphs); bits_equal_old must be true in every
# old/new cell (new-8bit2 runs another configuration: its bits may differ).
start=$(date +%s)
timeout 48 python3 bench/ab_gemm.py --out "$D/ab_gemm" --old-dir "$OLD" --variants new,old --m 1,8 \
  --no-tinygemm --labels "u4b8 g128 fp16" > "$D/ab_gemm.log" 2>&1
echo "ab gemm u4b8 M=1,8: rc=$? in $(( $(date +%s) - start ))s" | tee -a "$D/ab_gemm.log"
start=$(date +%s)
timeout 38 python3 bench/ab_gemm.py --out "$D/ab_gemm16" --old-dir "$OLD" --variants new,old --m 16,64 \
  --no-tinygemm --labels "u4b8 g128 fp16" > "$D/ab_gemm16.log" 2>&1
echo "ab gemm u4b8 M=16,64: rc=$? in $(( $(date +%s) - start ))s" | tee -a "$D/ab_gemm16.log"
start=$(date +%s)
timeout 34 python3 bench/ab_gemm.py --out "$D/ab_gemm8" --old-dir "$OLD" --variants new,old,new-8bit2 --m 1,16 \
  --no-tinygemm --shapes 8192x8192,8192x28672 --labels "u8b128,fe4m3fn" > "$D/ab_gemm8.log" 2>&1
echo "ab gemm 8-bit: rc=$? in $(( $(date +%s) - start ))s" | tee -a "$D/ab_gemm8.log"
# MoE: old (HEAD) vs new (automatic configuration, the same kernel template arguments as HEAD's).
start=$(date +%s)
timeout 30 python3 bench/bench_moe.py --out "$D/ab_moe" --ab-old "$OLD" --m 1,8,64 --reps 15 \
  --variants new > "$D/ab_moe.log" 2>&1
echo "ab moe: rc=$? in $(( $(date +%s) - start ))s" | tee -a "$D/ab_moe.log"

python3 bench/ab_summary.py "$D" 2>&1 | tee "$D/summary.txt"
fi
