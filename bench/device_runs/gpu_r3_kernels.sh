#!/usr/bin/env bash
# Round 3, engineer "kernels" (issues #7 / #4): the dense and fused-MoE Marlin kernels share one main loop
# (kernels_cuda/marlin_mainloop.cuh); the MoE kernel gains the per-group cached pairs and a two-CTA-per-SM variant.
#   usage (device machine, repo root, numpy wheel installed, PYTHONPATH exported, carry artifacts/r3_kernels_old):
#     bash bench/device_runs/gpu_r3_kernels.sh            tests, then A/B
#     SKIP_AB=1 bash bench/device_runs/gpu_r3_kernels.sh  tests only (<= 120 s): tests/gpu/test_gemm.py, tests/gpu/test_moe.py
#                                             and a dense partition check (bitwise = HEAD), in parallel
#     ONLY_AB=1 bash bench/device_runs/gpu_r3_kernels.sh  A/B only (<= 150 s): dense GEMM (bench/ab_gemm.py) and fused MoE
#                                             (bench/bench_moe.py --ab-old), old = HEAD copies in $R3_KERNELS_OLD
# Writes $OUT/kernels/{gemm_tests.log, moe_tests.log, partition_check.log, ab_gemm*.log, ab_gemm*/, ab_moe.log,
# ab_moe/, summary.txt}; ends by printing old / new / ratio per cell.
set -u
OUT=${OUT:-$PWD/artifacts/gpu_out}
D="$OUT/kernels"
OLD=${R3_KERNELS_OLD:-artifacts/r3_kernels_old}
mkdir -p "$D"
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-$PWD/artifacts/cupy_cache} NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0 \
  NUMBA_CUDA_WARN_ON_IMPLICIT_COPY=0
for f in gemm.py moe.py marlin_gemm.cu marlin_moe.cu dequant.cuh mma.cuh; do
  [ -f "$OLD/$f" ] || { echo "missing $OLD/$f (carry $OLD)"; exit 2; }
done

if [ -z "${ONLY_AB:-}" ]; then
start=$(date +%s)
timeout 115 python3 -m pytest -p no:cacheprovider -x -q -rs tests/gpu/test_gemm.py > "$D/gemm_tests.log" 2>&1 &
p_gemm=$!
timeout 115 python3 -m pytest -p no:cacheprovider -x -q -rs tests/gpu/test_moe.py > "$D/moe_tests.log" 2>&1 &
p_moe=$!
# Partitions the test module does not reach (it runs on all SMs, where small shapes give every block <= 1 step):
# few "SMs", so blocks straddle slices / share them with the deferred count. The shared loop must not change a bit:
# new == HEAD bitwise for every reduction mode and grid, within the fp32 bound, C fully written, bitwise repeatable.
timeout 100 python3 - "$OLD" > "$D/partition_check.log" 2>&1 <<'PY' &
import importlib.util, pathlib, sys
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
         (1, 4096, 1024, S.U4B8, 128, np.float16, 5), (16, 2048, 1024, S.U8B128, 128, np.float16, 5),
         (1, 2048, 1024, S.FE4M3FN, -1, BF16, 5), (64, 2048, 512, S.U8, 64, np.float16, 3)]
_, _, smem_limit, sm_smem = gemm.device_properties(0)
cfgs = {name: [mod.choose_config(gemm.act_scalar_type(act), wt, m, n, k, gs, False, smem_limit, sm_smem=sm_smem,
                                 sms=sms) for m, k, n, wt, gs, act, sms in CASES]
        for name, mod in (("new", gemm), ("old", old))}
# same kernel choice (name = template arguments) as HEAD, so the same partition
assert [c.name_expression for c in cfgs["new"]] == [c.name_expression for c in cfgs["old"]], cfgs
gemm.precompile(cfgs["new"], workers=8); old.precompile(cfgs["old"], workers=8)
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
    for mode in ("fp32", "deterministic", "in_c"):
        for align in (True, False):
            gemm.ALIGN_SLICES = old.ALIGN_SLICES = align
            out = tg.run(a, w, mode, sms=sms)  # poisoned C, locks left zero
            again = tg.run(a, w, mode, sms=sms)
            excess = float((np.abs(out - ref) - tg.error_bound(a, q.w_ref, act, mode, k)).max())
            same = np.array_equal(out, old_run(a, w, mode, sms))
            if not (np.all(np.isfinite(out)) and excess <= 0 and np.array_equal(out, again) and same):
                failures += 1
                print(f"FAIL m={m} k={k} n={n} {wt} {np.dtype(act)} sms={sms} {mode} align={align}: "
                      f"excess {excess:.3g}, bitwise = HEAD: {same}")
        gemm.ALIGN_SLICES = old.ALIGN_SLICES = True
    print(f"checked m={m} k={k} n={n} {wt} {np.dtype(act)} sms={sms} grid {gemm.grid_blocks(cfg, m, n, k, sms)}")
print("partition check:", "PASS" if failures == 0 else f"{failures} FAILURES")
sys.exit(1 if failures else 0)
PY
p_part=$!
wait $p_gemm; echo "gemm tests: pytest rc=$? after $(( $(date +%s) - start ))s" | tee -a "$D/gemm_tests.log"
wait $p_moe; echo "moe tests: pytest rc=$? after $(( $(date +%s) - start ))s" | tee -a "$D/moe_tests.log"
wait $p_part; echo "partition check: rc=$? after $(( $(date +%s) - start ))s" | tee -a "$D/partition_check.log"
tail -3 "$D/gemm_tests.log" "$D/moe_tests.log" "$D/partition_check.log"
fi

if [ -z "${SKIP_AB:-}" ]; then
# Dense: old (HEAD) vs new on the same weights, interleaved; bits_equal_old must be true on every cell (same
# partition, same summation order). Small layers first: the JSON is rewritten after every layer.
start=$(date +%s)
timeout 80 python3 bench/ab_gemm.py --out "$D/ab_gemm" --old-dir "$OLD" --variants new,old --m 1,16,64 \
  --no-tinygemm --labels "u4b8 g128 fp16" > "$D/ab_gemm.log" 2>&1
echo "ab gemm u4b8: rc=$? in $(( $(date +%s) - start ))s" | tee -a "$D/ab_gemm.log"
start=$(date +%s)
timeout 20 python3 bench/ab_gemm.py --out "$D/ab_gemm8" --old-dir "$OLD" --variants new,old --m 1 --no-tinygemm \
  --shapes 8192x8192 --labels "u8b128,fe4m3fn" > "$D/ab_gemm8.log" 2>&1
echo "ab gemm 8-bit: rc=$? in $(( $(date +%s) - start ))s" | tee -a "$D/ab_gemm8.log"
# MoE: old (HEAD) vs new (automatic), and new-b1 / new-b2 (forced one / two CTAs per SM) where both exist.
start=$(date +%s)
timeout 45 python3 bench/bench_moe.py --out "$D/ab_moe" --ab-old "$OLD" --m 1,8,64 --reps 9 > "$D/ab_moe.log" 2>&1
echo "ab moe: rc=$? in $(( $(date +%s) - start ))s" | tee -a "$D/ab_moe.log"

python3 - "$D" <<'PY' 2>&1 | tee "$D/summary.txt"
import glob, json, sys
d = sys.argv[1]
rows = [r for f in sorted(glob.glob(f"{d}/ab_gemm*/ab_*.json")) for r in json.load(open(f))["rows"]]
cells = {}
for r in rows:
    if "[" in r["method"]:
        label, variant = r["method"].rsplit(" [", 1)
        cells.setdefault((r["k"], r["n"], r["m"], label.replace("marlin ", "")), {})[variant[:-1]] = r
print("dense GEMM (us; bits = new output bitwise equal to HEAD's)")
print(f"{'K x N':>12} {'M':>3} {'weights':24} {'old':>8} {'new':>8} {'new/old':>8} {'config':>12} {'bits':>5}")
for (k, n, m, label), v in cells.items():
    if "old" in v and "new" in v:
        o, nw = v["old"]["us"], v["new"]["us"]
        print(f"{k:>5}x{n:<6} {m:>3} {label:24} {o:8.2f} {nw:8.2f} {nw / o:8.3f} {v['new'].get('config', ''):>12} "
              f"{str(v['new'].get('bits_equal_old')):>5}")
if not rows:
    print("  no dense A/B results (see ab_gemm*.log)")
moe = glob.glob(f"{d}/ab_moe/ab_moe.json")
print("\nfused MoE (us; b1 / b2 = forced one / two CTAs per SM; bits = every new variant bitwise equal to HEAD's)")
if not moe:
    print("  no MoE A/B results (see ab_moe.log)")
else:
    by = {}
    for r in json.load(open(moe[0]))["rows"]:
        by.setdefault((r["config"], r["m"]), {})[r["variant"]] = r
    print(f"{'config':>10} {'M':>3} {'old':>8} {'new':>8} {'new/old':>8} {'b1':>8} {'b2':>8} {'new shape':>22} "
          f"{'bits':>5}")
    for (cfg, m), v in by.items():
        if "old" not in v or "new" not in v:
            continue
        o, nw = v["old"]["us"], v["new"]["us"]
        b1, b2 = (v.get(x, {}).get("us", float("nan")) for x in ("new-b1", "new-b2"))
        bits = all(r["bits_equal_old"] for x, r in v.items() if x != "old")
        print(f"{cfg:>10} {m:>3} {o:8.2f} {nw:8.2f} {nw / o:8.3f} {b1:8.2f} {b2:8.2f} {v['new']['shape']:>22} "
              f"{str(bits):>5}")
PY
fi
