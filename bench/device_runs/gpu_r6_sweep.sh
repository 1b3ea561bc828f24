#!/usr/bin/env bash
# Round 6, engineer "sweep" (issue #4): time every feasible (kernel configuration, grid) of the Marlin GEMM beside
# today's automatic choice, on the cells furthest from the bars (bench/sweep_gemm.py); nothing in the kernels changes.
#   usage (device machine, repo root, numpy wheel installed, PYTHONPATH exported; nothing extra to carry):
#     bash bench/device_runs/gpu_r6_sweep.sh            self-check, then the sweep
#     SKIP_AB=1 bash bench/device_runs/gpu_r6_sweep.sh  test phase (<= 140 s): bench/sweep_gemm.py --selfcheck — the
#                                             forced-configuration hook against the NumPy reference (all u4b8
#                                             candidates at M = 1 and 5, a sample of FP8 / u8b128 ones, on 4096x2048:
#                                             fp32 bound, poisoned C, locks left zero, bitwise repeatable) and the
#                                             sweep's own reference (identity activations = the dequantized weight,
#                                             bit for bit); plus tests/cpu/test_sweep_gemm.py (fake device)
#     ONLY_AB=1 bash bench/device_runs/gpu_r6_sweep.sh  the sweep (<= 150 s): 24 cells, ~5900 candidates, 264
#                                             instantiations compiled in 14 threads while earlier cells are timed;
#                                             stops cleanly at its budget (128 s) with every finished cell written;
#                                             SWEEP_KERNEL_DIR=DIR sweeps a copy of kernels_cuda/ (e.g. HEAD's)
# Writes $OUT/sweep/{selfcheck.log, cpu_tests.log, sweep.log, sweep/sweep_<gpu>.{json,md}, summary.txt}; ends by
# printing one line per cell: default vs the fastest correct candidate.
set -u
OUT=${OUT:-$PWD/artifacts/gpu_out}
D="$OUT/sweep"
mkdir -p "$D"
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-$PWD/artifacts/cupy_cache}

if [ -z "${ONLY_AB:-}" ]; then
start=$(date +%s)
# 8 compile threads: the other engineers' test phases run beside this one
timeout 130 python3 bench/sweep_gemm.py --selfcheck --workers 8 > "$D/selfcheck.log" 2>&1
echo "selfcheck: rc=$? after $(( $(date +%s) - start ))s" | tee -a "$D/selfcheck.log"
timeout 60 python3 -m pytest -p no:cacheprovider -q tests/cpu/test_sweep_gemm.py > "$D/cpu_tests.log" 2>&1
echo "cpu tests (fake device): rc=$? after $(( $(date +%s) - start ))s" | tee -a "$D/cpu_tests.log"
tail -3 "$D/selfcheck.log"
fi

if [ -z "${SKIP_AB:-}" ]; then
start=$(date +%s)
# SWEEP_KERNEL_DIR: sweep another copy of kernels_cuda/ (e.g. HEAD's, if the tree's kernel change is not kept)
timeout 148 python3 bench/sweep_gemm.py --out "$D/sweep" --budget-s 128 --workers 14 \
  ${SWEEP_KERNEL_DIR:+--kernel-dir "$SWEEP_KERNEL_DIR"} > "$D/sweep.log" 2>&1
echo "sweep: rc=$? in $(( $(date +%s) - start ))s" | tee -a "$D/sweep.log"
python3 - "$D" <<'PY' 2>&1 | tee "$D/summary.txt"
import glob, json, sys
files = glob.glob(f"{sys.argv[1]}/sweep/sweep_*.json")
if not files:
    print("no sweep results (see sweep.log)"); sys.exit(0)
data = json.load(open(files[0]))
print(f"stopped: {data['meta'].get('stopped')}; wall {data['meta'].get('wall_s')}s; "
      f"{data['meta'].get('instantiations')} instantiations, {data['meta'].get('candidates')} candidates")
print(f"{'cell':38} {'default':>18} {'us':>7} {'best':>24} {'us':>7} {'ratio':>6} {'wrong':>5} {'timed':>5} "
      f"{'drift':>6}  (drift: default timed last / first)")
for cell in data["cells"]:
    rows = cell["candidates"]
    good = sorted((r for r in rows if r.get("ok") and r.get("us") is not None), key=lambda r: r["us"])
    wrong = sum(1 for r in rows if r.get("ok") is False)
    d = cell.get("default_us")
    if not good or not d:
        print(f"{cell['label']:38} {'(no default timing)':>18}"); continue
    b = good[0]
    print(f"{cell['label']:38} {cell['default_config'] + ' ' + str(cell['default_grid']):>18} {d:7.2f} "
          f"{b['config'] + ' ' + str(b['grid']) + ' ' + '/'.join(b['grid_kinds']):>24} {b['us']:7.2f} "
          f"{b['us'] / d:6.3f} {wrong:5d} {len(good):5d} {cell['default_us_last'] / cell['default_us_first']:6.3f}"
          + ("" if cell.get("complete", True) else " INCOMPLETE"))
PY
fi
