#!/usr/bin/env bash
# Round 2, repack: the direct act-order / AWQ kernels and the row-major FP8 transpose tile.
#   usage (device machine, repo root, numpy wheel installed, PYTHONPATH exported):  bash bench/device_runs/gpu_round2_repack.sh
# (1) tests/gpu/test_numba_gpu.py, and tests/sim/test_numba_weights.py on the real GPU (NUMBA_ENABLE_CUDASIM=0:
#     compiled integer semantics, every new kernel variant incl. partial k-blocks, poisoned outputs);
# (2) bench/bench_repack.py --ab: old kernels (HEAD code, still in the module, unchanged: staged kernel, direct
#     row-major kernel) against the new ones, one process, same inputs, each new output compared with the old.
# Writes $OUT/repack/{gpu_tests.log, weights_on_gpu.log, ab.log, ab_repack_<gpu>.json, summary.txt};
# ends by printing old µs / new µs / ratio and % of copy per path.
# Needs no carried folder.
set -u
OUT=${OUT:-$PWD/artifacts/gpu_out}
DIR="$OUT/repack"
mkdir -p "$DIR"
export NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0

if [ -z "${ONLY_AB:-}" ]; then
start=$(date +%s)
timeout 60 python3 -m pytest -p no:cacheprovider -x -q -rs tests/gpu/test_numba_gpu.py > "$DIR/gpu_tests.log" 2>&1
echo "tests/gpu/test_numba_gpu.py: pytest rc=$? in $(( $(date +%s) - start ))s" | tee -a "$DIR/gpu_tests.log"
tail -3 "$DIR/gpu_tests.log"
start=$(date +%s)
NUMBA_ENABLE_CUDASIM=0 timeout 90 python3 -m pytest -p no:cacheprovider -x -q -rs tests/sim/test_numba_weights.py \
  > "$DIR/weights_on_gpu.log" 2>&1
echo "tests/sim/test_numba_weights.py on the GPU: pytest rc=$? in $(( $(date +%s) - start ))s" \
  | tee -a "$DIR/weights_on_gpu.log"
tail -3 "$DIR/weights_on_gpu.log"

fi
if [ -z "${SKIP_AB:-}" ]; then
start=$(date +%s)
timeout 90 python3 bench/bench_repack.py --ab --reps 20 --out "$DIR" --ab-shapes 8192x28672,28672x8192 \
  > "$DIR/ab.log" 2>&1
echo "ab: rc=$? in $(( $(date +%s) - start ))s" | tee -a "$DIR/ab.log"

python3 - "$DIR" <<'PY' 2>&1 | tee "$DIR/summary.txt"
import glob, json, sys
files = glob.glob(f"{sys.argv[1]}/ab_repack_*.json")
if not files:
    sys.exit("no A/B results (see ab.log)")
rows = json.load(open(files[0]))["rows"]
by_path = {}
for r in rows:
    by_path.setdefault((r["shape"], r["path"]), []).append(r)
print(f"{'shape':11} {'path':25} {'old':18} {'old us':>8} {'new (best)':18} {'new us':>8} {'new/old':>8} "
      f"{'old %':>6} {'new %':>6} {'exact':>5}")
for (shape, path), rs in by_path.items():
    old = [r for r in rs if r["variant"].startswith("old")][0]
    new = min((r for r in rs if r["variant"].startswith("new")), key=lambda r: r["us"])
    exact = all(r["equals_old"] for r in rs)
    print(f"{shape:11} {path:25} {old['variant']:18} {old['us']:8.1f} {new['variant']:18} {new['us']:8.1f} "
          f"{new['us'] / old['us']:8.3f} {100 * old['fraction_of_copy']:6.1f} {100 * new['fraction_of_copy']:6.1f} "
          f"{str(exact):>5}")
PY
fi
