#!/usr/bin/env bash
# Round 4, engineer "host" (issue #7): fused_moe's host side. Cached choose_moe_config (moe.cached_moe_config) and
# per-layer plans (moe._LayerPlan): after a first, fully checked call, fused_moe launches align, gate_up, SiLU, down
# and the top-k sum through cuLaunchKernel on argument blocks made once, into intermediates kept per (layer, stream).
# Run from the repo root on the H200 with $OUT set, the numpy wheel installed and PYTHONPATH exported (by the lead);
# carry artifacts/r4_host_old (HEAD's gemm.py, gemm_abi.py, moe.py).
#   SKIP_AB=1 bash bench/device_runs/gpu_r4_host.sh   tests only (<= 120 s), in parallel:
#       plan_check.log   fused_moe new (first call = checked path, then plan calls with fresh values, a changed
#                        expert map in place, ids out of range, another stream) vs HEAD's fused_moe, bitwise, on
#                        top_k 1/2/6/8, every weight type, fp16/bf16, expert -1; one case against moe_reference
#       moe_tests.log    tests/gpu/test_moe.py fused/batched/layer tests; tests/cpu/test_moe_plan.py
#   ONLY_AB=1 bash bench/device_runs/gpu_r4_host.sh   A/B only (<= 90 s): bench/bench_host.py --moe-only, old (HEAD) vs new
#                        host / wall / device us per fused_moe call, Mixtral-like and DeepSeek-like, M = 1, 8, 64
# Writes $OUT/host/; ends by printing old / new / ratio per cell.
set -u
OUT=${OUT:-$PWD/artifacts/gpu_out}
D="$OUT/host"
OLD=${R4_HOST_OLD:-artifacts/r4_host_old}
mkdir -p "$D"
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-$PWD/artifacts/cupy_cache} NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0 \
  NUMBA_CUDA_WARN_ON_IMPLICIT_COPY=0
for f in gemm.py gemm_abi.py moe.py; do
  [ -f "$OLD/$f" ] || { echo "missing $OLD/$f (carry $OLD)"; exit 2; }
done

if [ -z "${ONLY_AB:-}" ]; then
start=$(date +%s)
timeout 115 python3 -m pytest -p no:cacheprovider -q -rs tests/gpu/test_moe.py \
  -k "phase_paths or fused_moe or skips_minus_one" > "$D/moe_tests.log" 2>&1 &
p_moe=$!
timeout 60 python3 -m pytest -p no:cacheprovider -q tests/cpu/test_moe_plan.py > "$D/cpu_plan_tests.log" 2>&1 &
p_cpu=$!
timeout 110 python3 - "$OLD" > "$D/plan_check.log" 2>&1 <<'PY' &
import pathlib, sys, time, traceback
from concurrent.futures import ThreadPoolExecutor
import numpy as np, cupy as cp
sys.path.insert(0, "."); sys.path.insert(0, "bench")
import bench_host
from workbench import gemm, moe
from workbench.scalar_types import ScalarType as S
gemm_old, moe_old = bench_host.load_old(pathlib.Path(sys.argv[1]))
import ml_dtypes
F16, BF16 = np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)
CASES = [  # (experts, hidden, inter, top_k, M, weight type, group, act, expert map: global experts or 0)
    (8, 512, 256, 2, 7, S.U4B8, 128, F16, 0), (8, 512, 256, 1, 1, S.U4, 64, BF16, 0),
    (16, 256, 128, 6, 5, S.U8B128, -1, F16, 24), (16, 512, 256, 8, 33, S.U8, 128, BF16, 0),
    (8, 512, 256, 2, 64, S.FE4M3FN, 128, BF16, 12), (64, 256, 128, 6, 1, S.U4B8, 128, F16, 0)]
rng = np.random.default_rng()
failures = []
def check(cond, what):
    if not cond:
        failures.append(what); print("FAIL", what, flush=True)
def bits(x):
    return cp.asnumpy(x).view(np.uint16)
t0 = time.time()
built = []
for e, hid, inter, top_k, m, wt, gs, act, glob in CASES:
    w13, r13 = moe.random_expert_stack(e, hid, 2 * inter, wt, gs, act_dtype=act, seed=int(rng.integers(1 << 20)))
    w2, r2 = moe.random_expert_stack(e, inter, hid, wt, gs, act_dtype=act, seed=int(rng.integers(1 << 20)))
    built.append((gemm.upload_weight(w13), gemm.upload_weight(w2), r13, r2))
print(f"weights in {time.time() - t0:.1f} s", flush=True)
def inputs(case, up):
    e, hid, inter, top_k, m, wt, gs, act, glob = case
    hidden = cp.asarray(rng.standard_normal((m, hid), dtype=np.float32).astype(act))
    ids = cp.asarray(np.stack([rng.choice(glob or e, top_k, replace=False) for _ in range(m)]).astype(np.int32))
    weights = cp.asarray(rng.uniform(0.1, 1, (m, top_k)).astype(np.float32))
    emap = None
    if glob:  # global -> local: every other global expert elsewhere (-1), the rest spread over the local ones
        host = np.full(glob, -1, np.int32)
        host[::2] = rng.permutation(e)[: len(host[::2])]
        emap = cp.asarray(host)
    return hidden, ids, weights, emap
# compile every case's kernels in parallel threads (NVRTC runs outside the GIL), then forget the plans
def warm(case, up):
    hidden, ids, weights, emap = inputs(case, None)
    moe.fused_moe(hidden, moe.MarlinExpertStack(up[0]), moe.MarlinExpertStack(up[1]), weights, ids, expert_map=emap)
with ThreadPoolExecutor(max_workers=6) as pool:
    list(pool.map(warm, CASES, built))
cp.cuda.Device().synchronize()
print(f"compiled in {time.time() - t0:.1f} s", flush=True)
for case, (up13, up2, r13, r2) in zip(CASES, built):
    e, hid, inter, top_k, m, wt, gs, act, glob = case
    where = f"E={e} K={hid} N={inter} top_k={top_k} M={m} {wt} g{gs} {act} map={glob}"
    try:
        new13, new2 = moe.MarlinExpertStack(up13), moe.MarlinExpertStack(up2)
        old13, old2 = moe_old.MarlinExpertStack(up13), moe_old.MarlinExpertStack(up2)
        hidden, ids, weights, emap = inputs(case, None)
        plans = len(new13._fused_plans)
        def both(label, **kw):
            new = moe.fused_moe(hidden, new13, new2, weights, ids, expert_map=emap, **kw)
            old = moe_old.fused_moe(hidden, old13, old2, weights, ids, expert_map=emap, **kw)
            check(np.array_equal(bits(new), bits(old)), f"{where} {label}: new != HEAD")
            return new
        first = both("first call (checked path)")
        check(len(new13._fused_plans) == plans + 1, f"{where}: no plan made")
        both("second call (plan)")
        # fresh values in the same arrays (in place): the plan reads them
        hidden[...] = cp.asarray(rng.standard_normal(hidden.shape, dtype=np.float32).astype(act))
        ids[...] = cp.asarray(np.stack([rng.choice(glob or e, top_k, replace=False) for _ in range(m)])
                              .astype(np.int32))
        weights[...] = cp.asarray(rng.uniform(0.1, 1, weights.shape).astype(np.float32))
        both("plan, new values")
        # some entries' experts stop being local (map entry -> -1, or ids out of range): their rows must stay 0
        if emap is not None:
            emap[int(cp.asnumpy(ids)[0, 0])] = -1
        else:
            ids[0, 0] = e + 3
        both("plan, dropped entries")
        s = cp.cuda.Stream(non_blocking=True)
        with s:
            both("plan on another stream", stream=s)
            both("plan on another stream again", stream=s)
        s.synchronize()
        check(len(new13._fused_plans) == plans + 2, f"{where}: expected a second plan for the stream")
        if case is CASES[0]:  # the plan's output against the NumPy layer within its derived bound
            got = cp.asnumpy(moe.fused_moe(hidden, new13, new2, weights, ids)).astype(np.float32)
            args = (cp.asnumpy(hidden), r13, r2, cp.asnumpy(weights), cp.asnumpy(ids))
            ref = moe.moe_reference(*args).astype(np.float32)
            check(np.all(np.abs(got - ref) <= moe.moe_error_bound(*args)), f"{where}: outside the reference bound")
        print("ok?", where, flush=True)
    except Exception:
        failures.append(where); traceback.print_exc()
# refusals on a warm plan: misaligned hidden, wrong dtype
try:
    case, (up13, up2, _, _) = CASES[0], built[0]
    e, hid, inter, top_k, m, wt, gs, act, glob = case
    new13, new2 = moe.MarlinExpertStack(up13), moe.MarlinExpertStack(up2)
    hidden, ids, weights, _ = inputs(case, None)
    moe.fused_moe(hidden, new13, new2, weights, ids); moe.fused_moe(hidden, new13, new2, weights, ids)
    buf = cp.zeros(m * hid + 8, dtype=act)
    try:
        moe.fused_moe(buf[1:1 + m * hid].reshape(m, hid), new13, new2, weights, ids)
        check(False, "misaligned hidden accepted by a warm plan")
    except ValueError as exc:
        check("aligned to 16 bytes" in str(exc), f"misaligned: wrong message {exc}")
    try:
        moe.fused_moe(hidden.astype(np.float32), new13, new2, weights, ids)
        check(False, "fp32 hidden accepted")
    except TypeError:
        pass
    print("ok? refusals", flush=True)
except Exception:
    failures.append("refusals"); traceback.print_exc()
print("plan check:", "PASS" if not failures else f"{len(failures)} FAILURES: {failures}")
sys.exit(1 if failures else 0)
PY
p_check=$!
wait $p_check; echo "plan check: rc=$? in $(( $(date +%s) - start ))s" | tee -a "$D/plan_check.log"
wait $p_moe; echo "moe tests: rc=$? in $(( $(date +%s) - start ))s" | tee -a "$D/moe_tests.log"
wait $p_cpu; echo "cpu plan tests: rc=$? in $(( $(date +%s) - start ))s" | tee -a "$D/cpu_plan_tests.log"
grep -E "FAIL|plan check|compiled" "$D/plan_check.log" | tail -8
tail -2 "$D/moe_tests.log"; tail -2 "$D/cpu_plan_tests.log"
fi

if [ -z "${SKIP_AB:-}" ]; then
start=$(date +%s)
timeout 88 python3 bench/bench_host.py --moe-only --out "$D/ab" --old-dir "$OLD" > "$D/ab.log" 2>&1
echo "host A/B: rc=$? in $(( $(date +%s) - start ))s" | tee -a "$D/ab.log"
sed -n '/^op /,$p' "$D/ab.log"
grep -E "FAILED|compiled" "$D/ab.log" | head -5
fi
