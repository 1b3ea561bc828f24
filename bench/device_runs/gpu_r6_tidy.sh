#!/usr/bin/env bash
# Round 6, engineer "tidy": (1) the inverse repacks' kernel and grid chosen by one function,
# kernels_numba.marlin_repack.weight_unpack_launch, which the wrappers and bench_repack.py both call (a pure refactor:
# same kernels, same grids; tests/sim/test_bench_dispatch.py records both launch lists and compares them); (2) the
# direct repack and the one-pass act-order gather share one device body (direct_kernel_body; per-kernel k-tile
# loaders): PTX (names aside) and sm_90 SASS of all 55 compile targets byte-identical to HEAD's, checked locally;
# (3) bench_moe.py's align columns: the CUDA C++ align that fused_moe launches (device time, and as a direct call)
# beside the Numba one (as a call).
#   usage (device machine, repo root, numpy wheel installed, PYTHONPATH exported; carry artifacts/r6_tidy_old only
#   for TIDY_FWD_AB=1):
#     SKIP_AB=1 bash bench/device_runs/gpu_r6_tidy.sh   tests only (<= 140 s): tests/gpu/test_numba_gpu.py
#     ONLY_AB=1 bash bench/device_runs/gpu_r6_tidy.sh   timing only (<= 60 s): bench_moe.py --m 1 --paths align
#                                                       (align columns, 3 configs), bench_repack.py --inverse-only
#     TIDY_FWD_AB=1 ...                                 also (<= 40 s) HEAD's direct / one-pass act-order repack
#                                                       kernels (artifacts/r6_tidy_old) vs the tree's, bit-compared
#                                                       (optional: the SASS is identical, so expected new/old 1.00)
# Writes $OUT/tidy/{numba_gpu_tests.log, moe_align.log, moe/, repack_inverse.log, repack/, fwd_ab.log, summary.txt}.
set -u
OUT=${OUT:-$PWD/artifacts/gpu_out}
D="$OUT/tidy"
OLD=${R6_TIDY_OLD:-artifacts/r6_tidy_old}
mkdir -p "$D"
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-$PWD/artifacts/cupy_cache} NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0 \
  NUMBA_CUDA_WARN_ON_IMPLICIT_COPY=0
: > "$D/summary.txt"

if [ -z "${ONLY_AB:-}" ]; then
  start=$(date +%s)
  timeout 140 python3 -m pytest -p no:cacheprovider -q -rs tests/gpu/test_numba_gpu.py > "$D/numba_gpu_tests.log" 2>&1
  rc=$?
  echo "tests/gpu/test_numba_gpu.py rc=$rc ($(( $(date +%s) - start )) s): $(tail -n 1 "$D/numba_gpu_tests.log")" \
    | tee -a "$D/summary.txt"
fi

if [ -z "${SKIP_AB:-}" ]; then
  start=$(date +%s)
  timeout 25 python3 bench/bench_moe.py --out "$D/moe" --m 1 --no-torch --paths align > "$D/moe_align.log" 2>&1
  echo "bench_moe --m 1 --paths align rc=$? ($(( $(date +%s) - start )) s)" | tee -a "$D/summary.txt"
  start=$(date +%s)
  timeout 35 python3 bench/bench_repack.py --inverse-only --reps 20 --out "$D/repack" > "$D/repack_inverse.log" 2>&1
  echo "bench_repack --inverse-only rc=$? ($(( $(date +%s) - start )) s)" | tee -a "$D/summary.txt"
  if [ -n "${TIDY_FWD_AB:-}" ]; then
    start=$(date +%s)
    timeout 40 python3 - "$OLD" > "$D/fwd_ab.log" 2>&1 <<'PY'
# HEAD's direct repack / one-pass act-order gather vs the tree's (shared opening and stores): same inputs, outputs
# poisoned then bit-compared, median of 20 L2-flushed runs each, interleaved old/new per kernel.
import sys
import numpy as np
sys.path.insert(0, "bench"); sys.path.insert(0, ".")
from bench_repack import load_old_module
from repack_timer import DeviceTimer
from kernels_numba import marlin_repack as new
old = load_old_module(sys.argv[1])
timer = DeviceTimer(20)
cp, cuda, stream = timer.cp, timer.cuda, timer.stream
k, n = (int(v) for v in (sys.argv[2] if len(sys.argv) > 2 else "8192x28672").split("x"))
bad = 0
for bits, kind, ktpt in ((4, "direct", None), (8, "direct", None), (8, "row_major", None), (4, "perm", None),
                         (8, "perm", None)):
    pf = 32 // bits
    src = timer.rand_words((1, n, k // 4) if kind == "row_major" else (1, k // pf, n))
    perm = timer.rand_perms(1, k)
    results = {}
    for label, mod in (("old", old), ("new", new)):
        out = cuda.device_array((1, k // 16, n * 16 // pf), np.uint32, stream=stream)
        cp.asarray(out).fill(0xDEADBEEF); cp.cuda.Device().synchronize()
        if kind == "perm":
            kern, grid = mod._perm_repack_kernel(bits), mod.perm_grid(k, n, bits, 1)
            launch = lambda kern=kern, grid=grid, out=out: kern[grid, mod.DIRECT_THREADS, stream](src, perm, out, n)
        else:
            source = "row_major_bytes" if kind == "row_major" else "gptq"
            kern, grid = mod._direct_repack_kernel(bits, source), mod.direct_grid(k, n, bits, 1)
            launch = lambda kern=kern, grid=grid, out=out: kern[grid, mod.DIRECT_THREADS, stream](src, out, n)
        results[label] = (timer.timed(launch), cp.asarray(out).copy())
    same = bool(cp.array_equal(results["old"][1], results["new"][1]))
    bad += not same
    t_old, t_new = results["old"][0] * 1e6, results["new"][0] * 1e6
    print(f"fwd {kind:9s} u{bits} {k}x{n}: old {t_old:8.1f} us  new {t_new:8.1f} us  new/old {t_new / t_old:5.3f}"
          f"  bitwise equal: {same}", flush=True)
sys.exit(1 if bad else 0)
PY
    echo "forward A/B rc=$? ($(( $(date +%s) - start )) s)" | tee -a "$D/summary.txt"
  fi
fi

echo "== tidy summary"
cat "$D/summary.txt"
[ -f "$D/moe_align.log" ] && grep -E "^\| (mixtral|dsv|config)" "$D/moe_align.log" | cut -d'|' -f2,3,12-14
# rc 1 from bench_repack = a round trip failed (or a section raised: "Error" lines)
[ -f "$D/repack_inverse.log" ] && grep -E "^\| .*marlin_to|Error" "$D/repack_inverse.log" | cut -c1-120
[ -f "$D/fwd_ab.log" ] && grep -E "^fwd|Error" "$D/fwd_ab.log"
exit 0
