#!/usr/bin/env bash
# Round 2, GEMM: tests/gpu/test_gemm.py on the working tree, then an A/B of the HEAD GEMM (copies in
# artifacts/round2_gemm_old/, carried by the lead) against the working tree, in one process on the same inputs.
#   usage (device machine, repo root, numpy wheel installed, PYTHONPATH exported):  bash bench/device_runs/gpu_round2_gemm.sh
# Writes $OUT/gemm/{gpu_tests.log, partition_check.log, ab.log, ab/, probe.log, probe/, summary.txt}; ends by printing
# old / new / ratio per cell.
set -u
OUT=${OUT:-$PWD/artifacts/gpu_out}
DIR="$OUT/gemm"
OLD=artifacts/round2_gemm_old
mkdir -p "$DIR"
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-$PWD/artifacts/cupy_cache}
for f in gemm.py marlin_gemm.cu dequant.cuh mma.cuh; do
  [ -f "$OLD/$f" ] || { echo "missing $OLD/$f (carry artifacts/round2_gemm_old)"; exit 2; }
done

if [ -z "${ONLY_AB:-}" ]; then
start=$(date +%s)
timeout 90 python3 -m pytest -p no:cacheprovider -x -q -rs tests/gpu/test_gemm.py > "$DIR/gpu_tests.log" 2>&1
echo "gemm tests: pytest rc=$? in $(( $(date +%s) - start ))s" | tee -a "$DIR/gpu_tests.log"
tail -5 "$DIR/gpu_tests.log"

# Partitions the test module does not reach (it runs on all SMs, where small shapes give every block <= 1 step):
# few "SMs" so that blocks straddle two slices (the deferred count) or get slice-aligned grids. Checks: poisoned C
# fully written, within the fp32 bound of tests/gpu, locks left zero, bitwise repeatable, the new kernel on the
# HEAD grid (ALIGN_SLICES off) bitwise equal to HEAD (same partition = same summation order), identity activations
# exact under both grids.
start=$(date +%s)
timeout 45 python3 - "$OLD" > "$DIR/partition_check.log" 2>&1 <<'PY'
import importlib.util, math, pathlib, sys
import numpy as np, cupy as cp
sys.path.insert(0, ".")
def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path); mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod; spec.loader.exec_module(mod); return mod
tg = load("tg", "tests/gpu/test_gemm.py")
old = load("gemm_old", pathlib.Path(sys.argv[1]) / "gemm.py")
old.KERNEL_DIR = pathlib.Path(sys.argv[1]); old.kernel_source.cache_clear()
from workbench import gemm
from workbench.scalar_types import ScalarType as S
from workbench.weight import random_marlin_weight
BF16 = tg.BF16
CASES = [(1, 2048, 1024, S.U4B8, 128, np.float16, 5), (1, 2048, 1024, S.U4B8, 128, BF16, 12),
         (1, 2048, 1024, S.U4B8, 128, np.float16, 16), (40, 1024, 512, S.U4, 128, np.float16, 5),
         (40, 1024, 512, S.U4, 128, BF16, 7), (1, 4096, 1024, S.U4B8, 128, np.float16, 5),
         (16, 2048, 1024, S.U8B128, 128, np.float16, 5), (1, 2048, 1024, S.FE4M3FN, -1, BF16, 5),
         (64, 2048, 512, S.U8, 64, np.float16, 3)]
_, _, smem_limit, sm_smem = gemm.device_properties(0)
cfgs = {name: [mod.choose_config(gemm.act_scalar_type(act), wt, m, n, k, gs, False, smem_limit, sm_smem=sm_smem,
                                 sms=sms) for m, k, n, wt, gs, act, sms in CASES]
        for name, mod in (("new", gemm), ("old", old))}
gemm.precompile(cfgs["new"], workers=16); old.precompile(cfgs["old"], workers=16)
rng = np.random.default_rng()
def old_run(a, w, mode, sms):
    c = tg.poisoned(a.shape[0], w.size_n, a.dtype)
    return cp.asnumpy(old.marlin_gemm(cp.asarray(a), w, c=c, sms=sms, **tg.MODES[mode])).astype(np.float32)
failures = 0
for (m, k, n, wt, gs, act, sms), cfg in zip(CASES, cfgs["new"]):
    mw, q = random_marlin_weight(k, n, wt, gs, act_dtype=act, seed=int(rng.integers(1 << 30)))
    w = gemm.upload_weight(mw)
    a = rng.standard_normal((m, k), dtype=np.float32).astype(act)
    ref = a.astype(np.float32) @ q.w_ref
    grids = {}
    for mode in ("fp32", "deterministic", "in_c"):
        outs = {}
        for align in (True, False):
            gemm.ALIGN_SLICES = align
            grids[align] = gemm.grid_blocks(cfg, m, n, k, sms)
            out = tg.run(a, w, mode, sms=sms)  # poisoned C, locks left zero
            again = tg.run(a, w, mode, sms=sms)
            excess = float((np.abs(out - ref) - tg.error_bound(a, q.w_ref, act, mode, k)).max())
            ok = np.all(np.isfinite(out)) and excess <= 0 and np.array_equal(out, again)
            outs[align] = out
            if not ok:
                failures += 1
                print(f"FAIL m={m} k={k} n={n} {wt} {np.dtype(act)} sms={sms} {mode} align={align}: excess {excess:.3g}")
        gemm.ALIGN_SLICES = True
        if not np.array_equal(outs[False], old_run(a, w, mode, sms)):
            failures += 1
            print(f"FAIL m={m} k={k} n={n} {wt} sms={sms} {mode}: striped grid not bitwise equal to HEAD")
    print(f"ok? m={m} k={k} n={n} {wt} {np.dtype(act)} sms={sms} grid striped {grids[False]} aligned {grids[True]}")
# identity activations: the output is the dequantized weight, exactly, whatever the partition
for wt, gs, sms in ((S.U4B8, 128, 3), (S.U8B128, 64, 3), (S.FE4M3FN, 128, 3)):
    mw, q = random_marlin_weight(256, 256, wt, gs, seed=int(rng.integers(1 << 30)))
    w = gemm.upload_weight(mw)
    eye = np.eye(256, dtype=np.float16)
    for mode in ("fp32", "in_c"):
        res = []
        for align in (True, False):
            gemm.ALIGN_SLICES = align
            res.append(tg.run(eye, w, mode, sms=sms))
        gemm.ALIGN_SLICES = True
        want = old_run(eye, w, mode, sms)
        if not (np.array_equal(res[0], want) and np.array_equal(res[1], want)):
            failures += 1
            print(f"FAIL identity {wt} g{gs} sms={sms} {mode}: not bitwise equal to HEAD")
print("partition check:", "PASS" if failures == 0 else f"{failures} FAILURES")
sys.exit(1 if failures else 0)
PY
echo "partition check: rc=$? in $(( $(date +%s) - start ))s" | tee -a "$DIR/partition_check.log"
tail -3 "$DIR/partition_check.log"

fi
if [ -z "${SKIP_AB:-}" ]; then
# new = working tree (slice-aligned grid + kernel finish changes), new-striped = working tree kernel on the HEAD grid,
# old = HEAD. Small shapes first: the JSON is rewritten after every shape, so a timeout keeps what was done.
# 4096x14336 keeps the striped grid (deferred counts only); the others get slice-aligned grids.
start=$(date +%s)
timeout 70 python3 bench/ab_gemm.py --out "$DIR/ab" --old-dir "$OLD" --variants new,old,new-striped --m 1,64 \
  --shapes 4096x4096,4096x14336,14336x4096,8192x8192 --labels "u4b8 g128 fp16,u8b128,fe4m3fn" \
  > "$DIR/ab.log" 2>&1
echo "ab: rc=$? in $(( $(date +%s) - start ))s" | tee -a "$DIR/ab.log"
# Fixed-cost probe, M = 1, N = 4096: K = 256 is one step per block and no cross-block sum (32 blocks), K = 1024 one
# step per block and 4 contributors per slice, K = 4096 the 4096x4096 cell above (4 steps each).
start=$(date +%s)
timeout 15 python3 bench/ab_gemm.py --out "$DIR/probe" --old-dir "$OLD" --variants new,old --m 1 --no-tinygemm \
  --shapes 256x4096,1024x4096 --labels "u4b8 g128 fp16" > "$DIR/probe.log" 2>&1
echo "probe: rc=$? in $(( $(date +%s) - start ))s" | tee -a "$DIR/probe.log"

python3 - "$DIR" <<'PY' 2>&1 | tee "$DIR/summary.txt"
import glob, json, sys
files = sorted(glob.glob(f"{sys.argv[1]}/ab/ab_*.json")) + sorted(glob.glob(f"{sys.argv[1]}/probe/ab_*.json"))
if not files:
    sys.exit("no A/B results (see ab.log)")
rows = [r for f in files for r in json.load(open(f))["rows"]]
cells = {}
for r in rows:
    if "[" in r["method"]:
        label, variant = r["method"].rsplit(" [", 1)
        cells.setdefault((r["k"], r["n"], r["m"], label.replace("marlin ", "")), {})[variant[:-1]] = r
    elif r["method"] == "tinygemm bf16":
        cells.setdefault((r["k"], r["n"], r["m"], "tinygemm"), {})["old"] = r
print(f"{'K x N':>12} {'M':>3} {'weights':24} {'old us':>8} {'new us':>8} {'new/old':>8} {'striped':>8} "
      f"{'grid old->new':>14} {'rel diff':>9}")
for (k, n, m, label), v in cells.items():
    if label == "tinygemm" or "old" not in v or "new" not in v:
        continue
    o, nw, st = v["old"]["us"], v["new"]["us"], v.get("new-striped", {}).get("us", float("nan"))
    print(f"{k:>5}x{n:<6} {m:>3} {label:24} {o:8.2f} {nw:8.2f} {nw / o:8.3f} {st:8.2f} "
          f"{v['old'].get('grid', 0):>6}->{v['new'].get('grid', 0):<6} {v['new'].get('rel_diff_vs_old', -1):9.1e}")
    t = cells.get((k, n, m, "tinygemm"))
    if t and label.startswith("u4b8"):
        print(f"{'':>16} {'tinygemm bf16':24} {t['old']['us']:8.2f}")
PY
fi
