#!/usr/bin/env bash
# Round 5, engineer "kernels" (issues #4 / #7): register double buffering in the shared main loop
# (kernels_cuda/marlin_mainloop.cuh): a warp's k16 tile i + 1 (B words, A ldmatrix, the group's scale / zero data,
# per-row scales) is loaded before tile i's dequant + mma, and a stage's first tile right after the stage barrier,
# before the next stage's global fetch is issued. Only load timing changes: every output must be bitwise = HEAD.
#   usage (device machine, repo root, numpy wheel installed, PYTHONPATH exported, carry artifacts/r5_kernels_old):
#     bash bench/device_runs/gpu_r5_kernels.sh            tests, then A/B
#     SKIP_AB=1 bash bench/device_runs/gpu_r5_kernels.sh  tests only (<= 140 s): tests/gpu/test_gemm.py, tests/gpu/test_moe.py
#                                             and a dense partition check against HEAD (bitwise), in parallel
#     ONLY_AB=1 bash bench/device_runs/gpu_r5_kernels.sh  A/B only (<= 150 s): dense GEMM (bench/ab_gemm.py: old, new) and fused
#                                             MoE (bench/bench_moe.py --ab-old: old, new); old = HEAD copies in
#                                             $R5_KERNELS_OLD
# Writes $OUT/kernels/{gemm_tests.log, moe_tests.log, partition_check.log, ab_gemm*.log, ab_gemm*/, ab_moe.log,
# ab_moe/, summary.txt}; ends by printing old / new / ratio / bitwise per cell.
set -u
OUT=${OUT:-$PWD/artifacts/gpu_out}
D="$OUT/kernels"
OLD=${R5_KERNELS_OLD:-artifacts/r5_kernels_old}
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
# Partitions the test module does not reach (it runs on all SMs, where small shapes give every block <= 1 step):
# few "SMs", so blocks straddle slices / share them with the deferred or immediate count. Within the fp32 bound, C
# fully written, bitwise repeatable, and new == HEAD bitwise in every run (same configuration, same partition, same
# fp operations in the same order: double buffering moves only loads).
timeout 140 python3 - "$OLD" > "$D/partition_check.log" 2>&1 <<'PY' &
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
         (1, 2048, 1024, S.FE4M3FN, -1, BF16, 5), (64, 2048, 512, S.U8, 64, np.float16, 3),
         (8, 2048, 1024, S.U4, 64, BF16, 7), (5, 1024, 1024, S.U8B128, 128, np.float16, 4),
         (12, 2048, 1024, S.U4B8, 128, np.float16, 5)]
_, _, smem_limit, sm_smem = gemm.device_properties(0)
cfgs = {name: [mod.choose_config(gemm.act_scalar_type(act), wt, m, n, k, gs, False, smem_limit, sm_smem=sm_smem,
                                 sms=sms) for m, k, n, wt, gs, act, sms in CASES]
        for name, mod in (("new", gemm), ("old", old))}
# the same kernel configuration and grid as HEAD, so the same partition
assert [c.name_expression for c in cfgs["new"]] == [c.name_expression for c in cfgs["old"]], cfgs
assert all(gemm.grid_blocks(a, m, n, k, sms) == old.grid_blocks(b, m, n, k, sms)
           for (m, k, n, wt, gs, act, sms), a, b in zip(CASES, cfgs["new"], cfgs["old"]))
gemm.precompile(cfgs["new"], workers=8); old.precompile(cfgs["old"], workers=8)
rng = np.random.default_rng()
def old_run(a, w, mode, sms):
    c = tg.poisoned(a.shape[0], w.size_n, a.dtype)
    return cp.asnumpy(old.marlin_gemm(cp.asarray(a), w, c=c, sms=sms, **tg.MODES[mode])).astype(np.float32)
failures = 0
swap_same = {}
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
            swap_same.setdefault(cfg.swap, []).append(same)
            if not (np.all(np.isfinite(out)) and excess <= 0 and np.array_equal(out, again)
                    and same):
                failures += 1
                print(f"FAIL m={m} k={k} n={n} {wt} {np.dtype(act)} sms={sms} {mode} align={align}: "
                      f"excess {excess:.3g}, bitwise = HEAD: {same}, repeatable: {np.array_equal(out, again)}")
        gemm.ALIGN_SLICES = old.ALIGN_SLICES = True
    print(f"checked m={m} k={k} n={n} {wt} {np.dtype(act)} sms={sms} grid {gemm.grid_blocks(cfg, m, n, k, sms)} "
          f"swap={cfg.swap} defer_count={cfg.defer_count}")
for sw, flags in sorted(swap_same.items()):
    print(f"{'swapped' if sw else 'unswapped'} loop: bitwise = HEAD in {sum(flags)} of {len(flags)} runs")
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
# Dense: old (HEAD) vs new on the same weights, interleaved (CUDA graphs); bits_equal_old must be true in every cell.
start=$(date +%s)
timeout 55 python3 bench/ab_gemm.py --out "$D/ab_gemm" --old-dir "$OLD" --variants new,old --m 1,8 \
  --no-tinygemm --labels "u4b8 g128 fp16" > "$D/ab_gemm.log" 2>&1
echo "ab gemm u4b8 M<=8: rc=$? in $(( $(date +%s) - start ))s" | tee -a "$D/ab_gemm.log"
start=$(date +%s)
timeout 40 python3 bench/ab_gemm.py --out "$D/ab_gemm16" --old-dir "$OLD" --variants new,old --m 16,64 \
  --no-tinygemm --labels "u4b8 g128 fp16" > "$D/ab_gemm16.log" 2>&1
echo "ab gemm u4b8 M=16,64: rc=$? in $(( $(date +%s) - start ))s" | tee -a "$D/ab_gemm16.log"
start=$(date +%s)
timeout 20 python3 bench/ab_gemm.py --out "$D/ab_gemm8" --old-dir "$OLD" --variants new,old --m 1 \
  --no-tinygemm --shapes 8192x8192 --labels "u8b128,fe4m3fn" > "$D/ab_gemm8.log" 2>&1
echo "ab gemm 8-bit: rc=$? in $(( $(date +%s) - start ))s" | tee -a "$D/ab_gemm8.log"
# MoE: old (HEAD) vs new (automatic configuration, the same kernel template arguments as HEAD's).
start=$(date +%s)
timeout 35 python3 bench/bench_moe.py --out "$D/ab_moe" --ab-old "$OLD" --m 1,8,64 --reps 15 \
  --variants new > "$D/ab_moe.log" 2>&1
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
nan = float("nan")
print("dense GEMM (us; bits = new bitwise = HEAD, required)")
print(f"{'K x N':>12} {'M':>3} {'weights':16} {'old':>8} {'new':>8} {'new/old':>8} {'config':>14} {'bits':>5}")
for (k, n, m, label), v in cells.items():
    if "old" in v and "new" in v:
        o, nw = v["old"]["us"], v["new"]["us"]
        print(f"{k:>5}x{n:<6} {m:>3} {label:16} {o:8.2f} {nw:8.2f} {nw / o:8.3f} "
              f"{v['new'].get('config', ''):>14} {str(v['new'].get('bits_equal_old')):>5}")
if not rows:
    print("  no dense A/B results (see ab_gemm*.log)")
moe = glob.glob(f"{d}/ab_moe/ab_moe.json")
print("\nfused MoE (median us [IQR] of interleaved, warmed, host-free calls; bits = new bitwise = HEAD, required)")
if not moe:
    print("  no MoE A/B results (see ab_moe.log)")
else:
    by = {}
    for r in json.load(open(moe[0]))["rows"]:
        by.setdefault((r["config"], r["m"]), {})[r["variant"]] = r
    print(f"{'config':>10} {'M':>3} {'old':>17} {'new':>17} {'new/old':>8} {'new shape':>22} {'bits':>5}")
    iq = lambda r: f"{r['us']:7.2f}[{r.get('us_q75', nan) - r.get('us_q25', nan):4.1f}]"
    for (cfg, m), v in by.items():
        if "old" not in v or "new" not in v:
            continue
        o, nw = v["old"]["us"], v["new"]["us"]
        bits = all(r["bits_equal_old"] for x, r in v.items() if x != "old")
        print(f"{cfg:>10} {m:>3} {iq(v['old']):>17} {iq(v['new']):>17} {nw / o:8.3f} {v['new']['shape']:>22} "
              f"{str(bits):>5}")
PY
fi
