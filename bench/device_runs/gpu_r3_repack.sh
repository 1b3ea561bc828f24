#!/usr/bin/env bash
# Round 3, repack (issue #3): Marlin -> row-major FP8 with all Marlin loads in flight before the stage stores,
# Marlin -> AWQ with 8-byte stores, Marlin -> GPTQ 8-bit with two columns per thread and 8-byte stores, and the
# two-pass act-order repack (GPTQ rows -> N-packed rows -> Marlin through perm).
#   usage (device machine, repo root, numpy wheel installed, PYTHONPATH exported, $OUT set):
#     bash bench/device_runs/gpu_r3_repack.sh            # tests, then the A/B
#     SKIP_AB=1 bash bench/device_runs/gpu_r3_repack.sh  # tests only (<= 120 s): the repack part of tests/gpu/test_numba_gpu.py
#                                            # and tests/sim/test_numba_weights.py on the real GPU, in parallel
#     ONLY_AB=1 bash bench/device_runs/gpu_r3_repack.sh  # A/B only (<= 150 s): bench_repack.py --ab, HEAD kernels loaded from
#                                            # artifacts/r3_repack_old/ vs the working tree, same inputs, bit-compared
# Carry: artifacts/r3_repack_old (the HEAD copy of kernels_numba/marlin_repack.py).
# GPU test subset: the round-3 switch tests (every switch value at 4096x14336, 14336x4096, 16x64), the row-major
# inverse modes, the 64-expert stacks, the FP8 torch-in tests; the 70B shapes are checked by the A/B itself (every
# new output bit-compared with the HEAD kernel's on the same input).
# Writes $OUT/repack/{gpu_tests.log, weights_on_gpu.log, ab.log, ab_repack_r3_<gpu>.json, summary.txt}.
set -u
OUT=${OUT:-$PWD/artifacts/gpu_out}
DIR="$OUT/repack"
mkdir -p "$DIR"
export NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0 NUMBA_CUDA_WARN_ON_IMPLICIT_COPY=0
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-$PWD/artifacts/cupy_cache}
OLD=artifacts/r3_repack_old

if [ -z "${ONLY_AB:-}" ]; then
  start=$(date +%s)
  timeout 110 python3 -m pytest -p no:cacheprovider -q -rs tests/gpu/test_numba_gpu.py \
    -k "round3 or fp8_repacks or 64_stacked" \
    > "$DIR/gpu_tests.log" 2>&1 &
  gpu_pid=$!
  NUMBA_ENABLE_CUDASIM=0 timeout 110 python3 -m pytest -p no:cacheprovider -q -rs tests/sim/test_numba_weights.py \
    > "$DIR/weights_on_gpu.log" 2>&1 &
  sim_pid=$!
  wait $gpu_pid; gpu_rc=$?
  wait $sim_pid; sim_rc=$?
  echo "tests/gpu/test_numba_gpu.py (repack subset): pytest rc=$gpu_rc" | tee -a "$DIR/gpu_tests.log"
  tail -3 "$DIR/gpu_tests.log"
  echo "tests/sim/test_numba_weights.py on the GPU: pytest rc=$sim_rc" | tee -a "$DIR/weights_on_gpu.log"
  tail -3 "$DIR/weights_on_gpu.log"
  echo "test phase: $(( $(date +%s) - start ))s"
fi

if [ -z "${SKIP_AB:-}" ]; then
  [ -f "$OLD/marlin_repack.py" ] || { echo "missing $OLD/marlin_repack.py (carry artifacts/r3_repack_old)"; exit 2; }
  start=$(date +%s)
  timeout 145 python3 bench/bench_repack.py --ab --reps 20 --out "$DIR" --ab-old "$OLD" \
    --ab-shapes 8192x28672,28672x8192,64x2048x1408 > "$DIR/ab.log" 2>&1
  echo "ab: rc=$? in $(( $(date +%s) - start ))s" | tee -a "$DIR/ab.log"
  python3 - "$DIR" <<'PY' 2>&1 | tee "$DIR/summary.txt"
import glob, json, sys
files = glob.glob(f"{sys.argv[1]}/ab_repack_r3_*.json")
if not files:
    sys.exit("no A/B results (see ab.log)")
rows = json.load(open(files[0]))["rows"]
cells = {}
for r in rows:
    cells.setdefault((r["shape"], r["path"]), []).append(r)
print(f"{'shape':12} {'path':24} {'old':22} {'old us':>8} {'new (best)':26} {'new us':>8} {'new/old':>7} "
      f"{'old %':>6} {'new %':>6} {'exact':>5}")
info = []
for (shape, path), rs in cells.items():
    old = rs[0]
    news = [r for r in rs[1:] if r["variant"].startswith("new") and "only" not in r["variant"]]
    info += [r for r in rs[1:] if r not in news]
    exact = all(r["equals_old"] is not False for r in rs)
    if not news:
        continue
    new = min(news, key=lambda r: r["us"])
    print(f"{shape:12} {path:24} {old['variant']:22} {old['us']:8.1f} {new['variant']:26} {new['us']:8.1f} "
          f"{new['us'] / old['us']:7.3f} {100 * old['fraction_of_copy']:6.1f} {100 * new['fraction_of_copy']:6.1f} "
          f"{str(exact):>5}")
print("every variant (us, % of copy, equals old):")
for r in rows:
    print(f"  {r['shape']:12} {r['path']:24} {r['variant']:36} {r['us']:9.1f} {100 * r['fraction_of_copy']:6.1f} "
          f"{r['equals_old']}")
PY
fi
