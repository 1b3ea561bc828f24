#!/usr/bin/env bash
# Round 4, repack (issue #3): Marlin -> AWQ through the field transpose network on an n-fastest grid, Marlin ->
# row-major FP8 through a raw-staged Marlin tile ("staged_marlin"), act-order pass 2 on an n-fastest grid, unsigned
# array indices (no wraparound code) in those kernels and in pass 1, pass 1 with all its loads before the shared
# stores. Column-strip act-order removed.
#   usage (device machine, repo root, numpy wheel installed, PYTHONPATH exported, $OUT set):
#     bash bench/device_runs/gpu_r4_repack.sh            # tests, then the A/B
#     SKIP_AB=1 bash bench/device_runs/gpu_r4_repack.sh  # tests only (<= 120 s): tests/gpu/test_numba_gpu.py (the tests of this
#                                            # round's kernels first, then the rest of the module in the time left)
#                                            # and tests/sim/test_numba_weights.py on the real GPU, in parallel
#     ONLY_AB=1 bash bench/device_runs/gpu_r4_repack.sh  # A/B only (<= 150 s): bench_repack.py --ab, HEAD kernels loaded from
#                                            # artifacts/r4_repack_old/ vs the working tree, same inputs, bit-compared
# Carry: artifacts/r4_repack_old (the HEAD copy of kernels_numba/marlin_repack.py).
# Writes $OUT/repack/{gpu_tests.log, weights_on_gpu.log, ab.log, ab_repack_r4_<gpu>.json, summary.txt}.
set -u
OUT=${OUT:-$PWD/artifacts/gpu_out}
DIR="$OUT/repack"
mkdir -p "$DIR"
export NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0 NUMBA_CUDA_WARN_ON_IMPLICIT_COPY=0
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-$PWD/artifacts/cupy_cache}
OLD=artifacts/r4_repack_old

if [ -z "${ONLY_AB:-}" ]; then
  start=$(date +%s)
  # tests/gpu/test_numba_gpu.py in two runs inside one 115 s budget: first the tests that cover this round's kernels
  # (act-order two-pass, AWQ inverse, row-major inverse modes, GPTQ/AWQ/FP8 repacks, stacked experts), then the
  # rest of the module with whatever time is left; -v so a timeout still shows what passed, --durations for where
  # the time goes (round-4 target: the whole module <= 100 s)
  CHANGED="round3 or round4 or awq or gptq_repack or fp8_repacks or 64_stacked"
  (
    timeout 110 python3 -m pytest -p no:cacheprovider -v -rs --durations=15 tests/gpu/test_numba_gpu.py \
      -k "$CHANGED"
    rc1=$?
    left=$(( 113 - ($(date +%s) - start) ))
    echo "== changed-kernel tests: rc=$rc1 after $(( $(date +%s) - start ))s; the rest of the module gets ${left}s"
    if [ "$left" -gt 5 ]; then
      timeout "$left" python3 -m pytest -p no:cacheprovider -v -rs --durations=10 tests/gpu/test_numba_gpu.py \
        -k "not ($CHANGED)"
      rc2=$?
    else
      rc2=124
    fi
    echo "== rest of the module: rc=$rc2; whole module $(( $(date +%s) - start ))s"
    [ $rc1 -eq 0 ] && [ $rc2 -eq 0 ]
  ) > "$DIR/gpu_tests.log" 2>&1 &
  gpu_pid=$!
  NUMBA_ENABLE_CUDASIM=0 timeout 115 python3 -m pytest -p no:cacheprovider -q -rs tests/sim/test_numba_weights.py \
    > "$DIR/weights_on_gpu.log" 2>&1 &
  sim_pid=$!
  wait $gpu_pid; gpu_rc=$?
  gpu_s=$(( $(date +%s) - start ))
  wait $sim_pid; sim_rc=$?
  echo "tests/gpu/test_numba_gpu.py (changed-kernel tests, then the rest): rc=$gpu_rc in ${gpu_s}s" \
    | tee -a "$DIR/gpu_tests.log"
  grep -E "^== |passed|failed|error" "$DIR/gpu_tests.log" | tail -6
  echo "tests/sim/test_numba_weights.py on the GPU: pytest rc=$sim_rc" | tee -a "$DIR/weights_on_gpu.log"
  tail -2 "$DIR/weights_on_gpu.log"
  echo "test phase: $(( $(date +%s) - start ))s"
fi

if [ -z "${SKIP_AB:-}" ]; then
  [ -f "$OLD/marlin_repack.py" ] || { echo "missing $OLD/marlin_repack.py (carry artifacts/r4_repack_old)"; exit 2; }
  start=$(date +%s)
  timeout 145 python3 bench/bench_repack.py --ab --reps 20 --out "$DIR" --ab-old "$OLD" \
    --ab-shapes 8192x28672,28672x8192,64x2048x1408 > "$DIR/ab.log" 2>&1
  echo "ab: rc=$? in $(( $(date +%s) - start ))s" | tee -a "$DIR/ab.log"
  python3 - "$DIR" <<'PY' 2>&1 | tee "$DIR/summary.txt"
import glob, json, sys
files = glob.glob(f"{sys.argv[1]}/ab_repack_r4_*.json")
if not files:
    sys.exit("no A/B results (see ab.log)")
rows = json.load(open(files[0]))["rows"]
cells = {}
for r in rows:
    cells.setdefault((r["shape"], r["path"]), []).append(r)
print("old = HEAD's kernel for the path; new = the working tree's default variant (first 'new' row); "
      "best = fastest 'new' row")
print(f"{'shape':12} {'path':24} {'old us':>8} {'new us':>8} {'new/old':>7} {'old %':>6} {'new %':>6} "
      f"{'best new variant':34} {'best %':>6} {'exact':>5}")
for (shape, path), rs in cells.items():
    old = rs[0]
    news = [r for r in rs[1:] if r["variant"].startswith("new") and "only" not in r["variant"]]
    exact = all(r["equals_old"] is not False for r in rs)
    if not news:
        continue
    new, best = news[0], min(news, key=lambda r: r["us"])
    print(f"{shape:12} {path:24} {old['us']:8.1f} {new['us']:8.1f} {new['us'] / old['us']:7.3f} "
          f"{100 * old['fraction_of_copy']:6.1f} {100 * new['fraction_of_copy']:6.1f} {best['variant']:34} "
          f"{100 * best['fraction_of_copy']:6.1f} {str(exact):>5}")
print("every variant (us, % of copy, equals old):")
for r in rows:
    print(f"  {r['shape']:12} {r['path']:24} {r['variant']:38} {r['us']:9.1f} {100 * r['fraction_of_copy']:6.1f} "
          f"{r['equals_old']}")
PY
fi
