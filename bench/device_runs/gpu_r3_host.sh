#!/usr/bin/env bash
# Round 3, engineer "host" (issues #4 / #7): the Python launch path (plan caches, cuLaunchKernel on a reused argument
# block, batched MoE dispatches without per-dispatch views). Run from the repo root on the H200 with $OUT set, the
# numpy wheel installed and PYTHONPATH exported (by the lead); carry artifacts/r3_host_old (HEAD's gemm.py,
# gemm_abi.py, moe.py).
#   SKIP_AB=1 bash bench/device_runs/gpu_r3_host.sh   tests only (<= 120 s), in parallel:
#       launch_check.log  every launch branch, new (direct launch, first call and cached call) vs the CuPy-call launch
#                         vs HEAD's launch path, bitwise, and within tests/gpu's fp32 bound; graph capture of a cached
#                         call; batched MoE new vs HEAD vs a dense loop, bitwise; fused_moe new vs HEAD, bitwise
#       gemm_tests.log    tests/gpu/test_gemm.py without the random grid (streams, graphs, M = 0, strides, refusals)
#       moe_tests.log     tests/gpu/test_moe.py batched/fused/layer tests
#   ONLY_AB=1 bash bench/device_runs/gpu_r3_host.sh   A/B only (<= 90 s): bench/bench_host.py, old vs new host/wall/device us
# Writes $OUT/host/; ends by printing old / new / ratio per cell.
set -u
OUT=${OUT:-$PWD/artifacts/gpu_out}
D="$OUT/host"
OLD=${R3_HOST_OLD:-artifacts/r3_host_old}
mkdir -p "$D"
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-$PWD/artifacts/cupy_cache} NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0 \
  NUMBA_CUDA_WARN_ON_IMPLICIT_COPY=0
for f in gemm.py gemm_abi.py moe.py; do
  [ -f "$OLD/$f" ] || { echo "missing $OLD/$f (carry $OLD)"; exit 2; }
done

if [ -z "${ONLY_AB:-}" ]; then
start=$(date +%s)
timeout 115 python3 -m pytest -p no:cacheprovider -q -rs tests/gpu/test_gemm.py -k "not random_grid" \
  > "$D/gemm_tests.log" 2>&1 &
p_gemm=$!
timeout 115 python3 -m pytest -p no:cacheprovider -q -rs tests/gpu/test_moe.py \
  -k "phase_paths or fused_moe or expert_linear or skips_minus_one" > "$D/moe_tests.log" 2>&1 &
p_moe=$!
timeout 110 python3 - "$OLD" > "$D/launch_check.log" 2>&1 <<'PY' &
import dataclasses, pathlib, sys, traceback
import numpy as np, cupy as cp
sys.path.insert(0, "."); sys.path.insert(0, "bench")
import importlib.util
spec = importlib.util.spec_from_file_location("tg", "tests/gpu/test_gemm.py"); tg = importlib.util.module_from_spec(spec)
sys.modules["tg"] = tg; spec.loader.exec_module(tg)
import bench_host
from workbench import gemm, moe
from workbench.scalar_types import ScalarType as S
from workbench.weight import random_marlin_weight
gemm_old, moe_old = bench_host.load_old(pathlib.Path(sys.argv[1]))
F16, BF16 = np.dtype(np.float16), tg.BF16
CASES = [  # (m, k, n, type, group, act, act_order, k_full, mode)
    (1, 1024, 512, S.U4B8, 128, F16, False, True, "fp32"), (7, 1024, 256, S.U4, 64, BF16, False, True, "in_c"),
    (16, 512, 256, S.U8B128, 32, F16, False, True, "atomic"), (33, 1024, 512, S.U8, -1, BF16, False, True,
    "deterministic"), (1, 512, 256, S.FE4M3FN, 128, F16, False, True, "fp32"), (5, 1024, 256, S.U4B8, 128, F16,
    True, True, "fp32"), (5, 1024, 256, S.U4B8, 128, BF16, True, False, "in_c"), (64, 512, 512, S.U4, 128, F16,
    False, True, "fp32"), (1, 4096, 4096, S.U4B8, 128, F16, False, True, "fp32")]
gemm.precompile([gemm.config_for(gemm.act_scalar_type(act), wt, m, n, k, gs, ao and not kf, 0)
                 for m, k, n, wt, gs, act, ao, kf, _ in CASES], 0, workers=8)
rng = np.random.default_rng()
failures = []
def bits(x):
    return cp.asnumpy(x).view(np.uint16)
def check(cond, what):
    if not cond:
        failures.append(what); print("FAIL", what, flush=True)
for m, k, n, wt, gs, act, ao, kf, mode in CASES:
    where = f"m={m} k={k} n={n} {wt} g{gs} {act} act_order={ao}/{kf} {mode}"
    try:
        mw, q = random_marlin_weight(k, n, wt, gs, act_order=ao, act_dtype=act, seed=int(rng.integers(1 << 30)))
        w = gemm.upload_weight(dataclasses.replace(mw, is_k_full=kf))
        a_host = rng.standard_normal((m, k), dtype=np.float32).astype(act)
        a = cp.asarray(a_host)
        kw = tg.MODES[mode]
        runs = {}
        for label, mod, direct in (("new-first", gemm, True), ("new-cached", gemm, True), ("cupy-call", gemm, False),
                                   ("old", gemm_old, True)):
            gemm.DIRECT_LAUNCH = direct
            c = tg.poisoned(m, n, act)
            out = mod.marlin_gemm(a, w, c=c, **kw)
            check(out is c, f"{where} {label}: output is not c")
            runs[label] = out
        gemm.DIRECT_LAUNCH = True
        runs["gptq-alloc"] = gemm.gptq_marlin_gemm(a, w.qweight, w.scales, w.zeros, w.g_idx, w.perm,
                                                   gemm.scratch_buffers(0, 0, gemm.device_properties(0)[1])[0],
                                                   wt, m, n, k, is_k_full=kf, **kw)
        ref = a_host.astype(np.float32) @ q.w_ref
        bound = tg.error_bound(a_host, q.w_ref, act, mode, k)
        for label, out in runs.items():
            got = cp.asnumpy(out).astype(np.float32)
            check(np.all(np.isfinite(got)) and np.all(np.abs(got - ref) <= bound), f"{where} {label}: outside bound")
            if mode != "atomic":
                check(np.array_equal(bits(out), bits(runs["old"])), f"{where} {label}: not bitwise equal to HEAD")
        ws, _ = gemm.scratch_buffers(0, cp.cuda.get_current_stream().ptr, gemm.device_properties(0)[1])
        check(int(cp.count_nonzero(ws)) == 0, f"{where}: locks not left zero")
        print("ok?", where, flush=True)
    except Exception:
        failures.append(where); traceback.print_exc()
# a cached plan still refuses a misaligned address, and a CUDA graph captures the cached call
try:
    mw, q = random_marlin_weight(1024, 256, S.U4B8, 128, seed=7)
    w = gemm.upload_weight(mw)
    buf = cp.asarray(rng.standard_normal(8 * 1024 + 8, dtype=np.float32).astype(np.float16))
    good = buf[:8 * 1024].reshape(8, 1024)
    gemm.marlin_gemm(good, w)
    try:
        gemm.marlin_gemm(buf[1:1 + 8 * 1024].reshape(8, 1024), w)
        check(False, "misaligned A accepted on a cached plan")
    except ValueError as exc:
        check("aligned to 16 bytes" in str(exc), f"misaligned A: wrong message {exc}")
    stream = cp.cuda.Stream(non_blocking=True)
    sms = gemm.device_properties(0)[1]
    with stream:
        ws = cp.zeros(gemm.workspace_numel(sms), dtype=np.int32); ct = cp.empty(gemm.c_tmp_numel(sms), np.float32)
        c = tg.poisoned(8, 256, np.float16)
        gemm.marlin_gemm(good, w, c=c, workspace=ws, c_tmp=ct, stream=stream)
        want = bits(c); c.fill(np.nan)
        stream.begin_capture()
        gemm.marlin_gemm(good, w, c=c, workspace=ws, c_tmp=ct, stream=stream)
        graph = stream.end_capture()
        graph.launch(stream); stream.synchronize()
    check(np.array_equal(bits(c), want), "graph replay of a cached call differs")
    print("ok? misaligned + graph", flush=True)
except Exception:
    failures.append("misaligned/graph"); traceback.print_exc()
# MoE: batched (several lanes, one dispatch, repeated m) new vs HEAD vs a dense loop; fused_moe new vs HEAD
try:
    e, k, n = 8, 512, 256
    w13, _ = moe.random_expert_stack(e, k, 2 * n, S.U4, 128, seed=int(rng.integers(1 << 20)))
    w2, _ = moe.random_expert_stack(e, n, k, S.U4, 128, seed=int(rng.integers(1 << 20)))
    up13, up2 = gemm.upload_weight(w13), gemm.upload_weight(w2)
    x = cp.asarray(rng.standard_normal((24, k), dtype=np.float32).astype(np.float16))
    for dispatches in ([(3, 0, 0, 24)], [(i, 3 * i, 21 - 3 * i, 3) for i in range(8)],
                       [(0, 0, 4, 4), (5, 4, 0, 4), (2, 8, 8, 16)]):
        new_stack, old_stack = moe.MarlinExpertStack(up13), moe_old.MarlinExpertStack(up13)
        outs = {}
        for label, stack in (("new", new_stack), ("new-again", new_stack), ("old", old_stack)):
            y = tg.poisoned(24, 2 * n, np.float16)
            stack.gemm_phase_batched(x, dispatches, y)  # "new-again": the plans checked by the first call
            outs[label] = y
        loop = tg.poisoned(24, 2 * n, np.float16)
        for ex, r_in, r_out, mm in dispatches:
            gemm.marlin_gemm(x[r_in:r_in + mm], up13.expert(ex), c=loop[r_out:r_out + mm])
        for label in ("new", "new-again"):
            check(np.array_equal(bits(outs[label]), bits(outs["old"])), f"batched {dispatches[:2]} {label} != HEAD")
            check(np.array_equal(bits(outs[label]), bits(loop)), f"batched {dispatches[:2]} {label} != dense loop")
    print("ok? batched", flush=True)
    hidden = cp.asarray(rng.standard_normal((7, k), dtype=np.float32).astype(np.float16))
    ids = cp.asarray(np.stack([rng.choice(e, 2, replace=False) for _ in range(7)]).astype(np.int32))
    weights = cp.asarray(rng.uniform(0.1, 1, (7, 2)).astype(np.float32))
    for path in ("fused", "batched"):
        new = moe.fused_moe(hidden, moe.MarlinExpertStack(up13), moe.MarlinExpertStack(up2), weights, ids, path=path)
        old = moe_old.fused_moe(hidden, moe_old.MarlinExpertStack(up13), moe_old.MarlinExpertStack(up2), weights, ids,
                                path=path)
        check(np.array_equal(bits(new), bits(old)), f"fused_moe path={path}: new != HEAD")
    print("ok? fused_moe", flush=True)
except Exception:
    failures.append("moe"); traceback.print_exc()
print("launch check:", "PASS" if not failures else f"{len(failures)} FAILURES: {failures}")
sys.exit(1 if failures else 0)
PY
p_check=$!
wait $p_check; echo "launch check: rc=$? in $(( $(date +%s) - start ))s" | tee -a "$D/launch_check.log"
wait $p_gemm; echo "gemm tests: rc=$? in $(( $(date +%s) - start ))s" | tee -a "$D/gemm_tests.log"
wait $p_moe; echo "moe tests: rc=$? in $(( $(date +%s) - start ))s" | tee -a "$D/moe_tests.log"
grep -E "FAIL|launch check" "$D/launch_check.log" | tail -8
tail -2 "$D/gemm_tests.log"; tail -2 "$D/moe_tests.log"
fi

if [ -z "${SKIP_AB:-}" ]; then
start=$(date +%s)
timeout 88 python3 bench/bench_host.py --out "$D/ab" --old-dir "$OLD" > "$D/ab.log" 2>&1
echo "host A/B: rc=$? in $(( $(date +%s) - start ))s" | tee -a "$D/ab.log"
sed -n '/^op /,$p' "$D/ab.log"
grep -E "FAILED" "$D/ab.log" | head -5
fi
