"""Host (Python) time per call of the GEMM launch paths, beside the GPU time, old (HEAD copies) vs new.

    python bench/bench_host.py --out DIR [--old-dir artifacts/r3_host_old] [--cpu]

What a researcher pays when calling the ops in a loop (``bench/bench_gemm.py`` times kernels in CUDA graphs, which
hides this). Decode size: M = 1, u4b8 g128 fp16; dense 4096 x 4096; MoE Mixtral-like (8 experts, hidden 4096,
intermediate 14336, top-2; random weight words: speed does not depend on values).

Ops: ``gptq_marlin_gemm`` with every buffer given, the same with ``c`` allocated per call, ``marlin_gemm(a, w, c=c)``,
``gemm_phase_batched`` with 8 dispatches of one row (one per expert; per-dispatch figures divide by 8), and
``fused_moe`` (path "fused": align + two fused GEMMs + SiLU + top-k sum).

Per op and variant (GPU mode):
* host us/call: N calls back to back with no synchronisation, wall clock of the loop / N (the launch queue never
  fills: N x launches per call < 1024);
* wall us/call: the same loop plus one final synchronisation, / N (what the caller sees end to end);
* device us/call: a spin kernel keeps the GPU busy while the N calls are queued, events around the N calls: the GPU
  time with the host out of the way;
* the new variant's output equal bit for bit to the old one's (same kernels, same partition, same inputs).
Variants: ``old`` = HEAD's workbench/{gemm,moe}.py loaded from --old-dir as separate modules (with the working
tree's kernel sources and the kernel-configuration functions of the working tree, so both launch the same kernels),
``new`` = the working tree, ``new-cupy-call`` = the working tree launching through CuPy's RawKernel call instead of
cuLaunchKernel on a reused argument block (splits the gain between the plan cache and the direct launch).

--cpu: no GPU. Runs the ops on stand-in arrays and a stand-in driver (tests/fake_device.py) to the final launch call
(CuPy-called helper kernels and allocations are stand-ins too), old vs new, and prints per-call µs and a cProfile of
the new path: the validation / plan / record cost without the driver's.
Writes DIR/host_<gpu or cpu>.json and prints a table (old, new, ratio per cell).
"""
from __future__ import annotations

import argparse
import cProfile
import dataclasses
import datetime
import importlib.util
import io
import json
import pathlib
import pstats
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from workbench import gemm, moe  # noqa: E402
from workbench.policy import DEFAULT_GEMM_POLICY, DEFAULT_MOE_POLICY  # noqa: E402
from workbench.scalar_types import ScalarType as S  # noqa: E402
from workbench.weight import MarlinWeight  # noqa: E402

K, N = 4096, 4096
EXPERTS, HIDDEN, INTER, TOP_K = 8, 4096, 14336, 2
GROUP = 128
# working-tree functions the old modules borrow, so that old and new launch the same kernels (they belong to the
# kernel configuration, not to the launch path compared here)
GEMM_SHARED = ("KernelConfig", "choose_config", "grid_blocks", "c_tmp_numel", "workspace_numel", "kernel_source",
               "MAX_BLOCKS_PER_SM")
MOE_SHARED = ("MoeConfig", "choose_moe_config", "moe_kernel_source", "get_moe_kernel")
# fused_moe cells: (label, experts, hidden, intermediate, top_k) x M
MOE_MODELS = (("Mixtral", 8, 4096, 14336, 2), ("DeepSeek", 64, 2048, 1408, 6))
MOE_MS = (1, 8, 64)


def load_old(old_dir: pathlib.Path):
    """(gemm_old, moe_old): HEAD's launch code as separate modules; moe_old calls gemm_old."""
    def load(name, path):
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod  # dataclasses look their module up there
        spec.loader.exec_module(mod)
        return mod

    gemm_old = load("gemm_old", old_dir / "gemm.py")
    for name in GEMM_SHARED:
        setattr(gemm_old, name, getattr(gemm, name))
    moe_old = load("moe_old", old_dir / "moe.py")
    moe_old.gemm = gemm_old
    for name in MOE_SHARED:
        setattr(moe_old, name, getattr(moe, name))
    return gemm_old, moe_old


class Variant:
    """A pair of modules and, for the working tree's, the policies its calls pass (``gkw`` / ``mkw``: keyword
    arguments of the dense and the MoE calls; empty for the old modules, which take none)."""

    def __init__(self, name, gemm_mod, moe_mod, direct=None):
        self.name, self.gemm, self.moe = name, gemm_mod, moe_mod
        self.gkw, self.mkw = {}, {}
        if direct is not None:
            g = DEFAULT_GEMM_POLICY  # (GemmPolicy.direct_launch was removed: every launch is direct)
            self.gkw = {"policy": g}
            self.mkw = {"policy": dataclasses.replace(DEFAULT_MOE_POLICY, gemm=g)}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def dense_weight(xp, k, n, experts=None, act=np.float16):
    lead = () if experts is None else (experts,)
    if xp is np:  # CPU mode: stand-ins
        from fake_device import FakeArray

        return MarlinWeight(FakeArray(lead + (k // 16, n * 2), np.int32), FakeArray(lead + (k // GROUP, n), act),
                            None, None, None, k, n, GROUP, S.U4B8, np.dtype(act), num_experts=experts)
    words = xp.random.randint(-(2 ** 31), 2 ** 31 - 1, size=lead + (k // 16, n * 2), dtype=np.int64).astype(np.int32)
    scales = (xp.random.random(lead + (k // GROUP, n), dtype=np.float32) * 0.01 + 0.001).astype(act)
    return MarlinWeight(words, scales, None, None, None, k, n, GROUP, S.U4B8, np.dtype(act), num_experts=experts)


def make_ops(v: Variant, xp, arrays):
    """name -> (calls per op for the per-dispatch column, fn() -> output array)."""
    g, m, gkw, mkw = v.gemm, v.moe, v.gkw, v.mkw
    a, w, c, ws, ct = arrays["a"], arrays["w"], arrays["c"], arrays["ws"], arrays["ct"]
    stack13 = arrays["stacks"][v.name][0]
    x8, y8 = arrays["x8"], arrays["y8"]
    dispatches = [(e, e, e, 1) for e in range(EXPERTS)]
    ops = {
        "gptq_marlin_gemm (buffers given)": (1, lambda: g.gptq_marlin_gemm(
            a, w.qweight, w.scales, None, None, None, ws, "u4b8", 1, N, K, c=c, c_tmp=ct, **gkw)),
        "gptq_marlin_gemm (c allocated)": (1, lambda: g.gptq_marlin_gemm(
            a, w.qweight, w.scales, None, None, None, ws, "u4b8", 1, N, K, c_tmp=ct, **gkw)),
        "marlin_gemm (c given)": (1, lambda: g.marlin_gemm(a, w, c=c, **gkw)),
        "gemm_phase_batched (8 dispatches)": (EXPERTS, lambda: stack13.gemm_phase_batched(x8, dispatches, y8,
                                                                                           **mkw)),
    }
    t = arrays.get("torch")
    if t is not None and v.name == "new":  # the same arrays as torch tensors (zero-copy views): torch's stream
        ops["gptq_marlin_gemm torch (buffers given)"] = (1, lambda: g.gptq_marlin_gemm(
            t["a"], t["qweight"], t["scales"], None, None, None, t["ws"], "u4b8", 1, N, K, c=t["c"], c_tmp=t["ct"],
            **gkw))
        ops["gptq_marlin_gemm torch (c allocated)"] = (1, lambda: g.gptq_marlin_gemm(
            t["a"], t["qweight"], t["scales"], None, None, None, t["ws"], "u4b8", 1, N, K, c_tmp=t["ct"], **gkw))
    if arrays.get("dense_only"):
        return ops
    if "hidden" in arrays:
        stack2 = arrays["stacks"][v.name][1]
        hidden, tw, ti = arrays["hidden"], arrays["topk_weights"], arrays["topk_ids"]
        ops["fused_moe (fused, M=1)"] = (1, lambda: m.fused_moe(hidden, stack13, stack2, tw, ti, path="fused",
                                                                **mkw))
    if arrays.get("moe_only"):
        ops = {}
    for (label, mm), layer in arrays.get("layers", {}).items():
        s13, s2 = arrays["model_stacks"][label][v.name]
        ops[f"fused_moe {label} M={mm}"] = (1, (lambda h, a, b, w, i: lambda: m.fused_moe(h, a, b, w, i, **mkw))(
            layer[0], s13, s2, layer[1], layer[2]))
    return ops


def moe_layers(xp, variants, array_fn, ids_fn):
    """(model stacks per variant, {(model, M): (hidden, topk_weights, topk_ids)}) for MOE_MODELS x MOE_MS."""
    stacks, layers = {}, {}
    rng = np.random.default_rng(1)
    for label, e, hid, inter, top_k in MOE_MODELS:
        w13 = dense_weight(xp, hid, 2 * inter, e)
        w2 = dense_weight(xp, inter, hid, e)
        stacks[label] = {v.name: (v.moe.MarlinExpertStack(w13), v.moe.MarlinExpertStack(w2)) for v in variants}
        for mm in MOE_MS:
            ids = np.stack([rng.choice(e, top_k, replace=False) for _ in range(mm)]).astype(np.int32)
            weights = rng.uniform(0.1, 1, (mm, top_k)).astype(np.float32)
            layers[(label, mm)] = (array_fn((mm, hid)), ids_fn(weights), ids_fn(ids))
    return stacks, layers


# ---------------------------------------------------------------------------------------------------------------
# GPU mode
# ---------------------------------------------------------------------------------------------------------------
SPIN = r'''
extern "C" __global__ void spin(long long cycles) {
  long long start = clock64();
  while (clock64() - start < cycles) { }
}
'''


def time_gpu(cp, fn, calls: int, spin) -> dict:
    for _ in range(3):
        fn()
    cp.cuda.Device().synchronize()
    t0 = time.perf_counter_ns()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter_ns()
    cp.cuda.Device().synchronize()
    t2 = time.perf_counter_ns()
    host_us, wall_us = (t1 - t0) / calls / 1e3, (t2 - t0) / calls / 1e3
    # device time: the GPU spins (~host_us x calls + 2 ms) while the calls are queued behind it
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    spin((1,), (1,), (np.int64(int((host_us * calls + 2000) * 2000)),))
    start.record()
    for _ in range(calls):
        fn()
    stop.record()
    stop.synchronize()
    device_us = cp.cuda.get_elapsed_time(start, stop) * 1e3 / calls
    return dict(host_us=host_us, wall_us=wall_us, device_us=device_us)


def gpu_arrays(cp, variants):
    rng = cp.random
    arrays = dict(a=(rng.standard_normal((1, K), dtype=np.float32)).astype(np.float16),
                  w=dense_weight(cp, K, N),
                  c=cp.empty((1, N), dtype=np.float16))
    sms = gemm.device_properties(0)[1]
    arrays["ws"] = cp.zeros(gemm.workspace_numel(sms), dtype=np.int32)
    arrays["ct"] = cp.empty(gemm.c_tmp_numel(sms), dtype=np.float32)
    w13 = dense_weight(cp, HIDDEN, 2 * INTER, EXPERTS)
    w2 = dense_weight(cp, INTER, HIDDEN, EXPERTS)
    arrays["stacks"] = {v.name: (v.moe.MarlinExpertStack(w13), v.moe.MarlinExpertStack(w2)) for v in variants}
    arrays["x8"] = rng.standard_normal((EXPERTS, HIDDEN), dtype=np.float32).astype(np.float16)
    arrays["y8"] = cp.empty((EXPERTS, 2 * INTER), dtype=np.float16)
    arrays["hidden"] = rng.standard_normal((1, HIDDEN), dtype=np.float32).astype(np.float16)
    arrays["topk_ids"] = cp.asarray(np.random.default_rng(0).choice(EXPERTS, size=(1, TOP_K), replace=False)
                                    .astype(np.int32))
    arrays["topk_weights"] = cp.asarray(np.array([[0.6, 0.4]], np.float32))
    arrays["model_stacks"], arrays["layers"] = moe_layers(
        cp, variants, lambda shape: rng.standard_normal(shape, dtype=np.float32).astype(np.float16), cp.asarray)
    try:
        import torch
    except ImportError:  # (no torch: the torch cells are left out)
        return arrays
    w = arrays["w"]
    arrays["torch"] = {name: torch.as_tensor(x, device="cuda") for name, x in (
        ("a", arrays["a"]), ("qweight", w.qweight), ("scales", w.scales), ("ws", arrays["ws"]), ("c", arrays["c"]),
        ("ct", arrays["ct"]))}
    return arrays


def run_gpu(args, variants) -> dict:
    import cupy as cp

    arrays = gpu_arrays(cp, variants)
    arrays["moe_only"], arrays["dense_only"] = args.moe_only, args.dense_only
    sms = gemm.device_properties(0)[1]
    # compile first, in parallel threads (NVRTC runs outside the GIL): the dense kernels, and the MoE chain through
    # one warm-up fused_moe call (align, two fused GEMMs, SiLU, top-k sum)
    from concurrent.futures import ThreadPoolExecutor

    _, _, smem_limit, sm_smem = gemm.device_properties(0)
    dense = [gemm.choose_config(S.F16, S.U4B8, 1, n, k, GROUP, False, smem_limit, sm_smem=sm_smem, sms=sms)
             for k, n in ((K, N), (HIDDEN, 2 * INTER))]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=8) as pool:
        jobs = [] if args.dense_only else [pool.submit(lambda: moe.fused_moe(
            arrays["hidden"], *arrays["stacks"]["new"], arrays["topk_weights"], arrays["topk_ids"]))]
        if not args.moe_only:
            jobs.append(pool.submit(gemm.precompile, dense, 0, 4))
        jobs += [pool.submit((lambda h, st, w, i: lambda: moe.fused_moe(h, *st, w, i))(
            hidden, arrays["model_stacks"][label]["new"], tw, ti)) for (label, _), (hidden, tw, ti) in
            arrays["layers"].items() if not args.dense_only]
        for job in jobs:
            job.result()
    cp.cuda.Device().synchronize()
    print(f"compiled in {time.perf_counter() - t0:.1f} s", flush=True)
    spin = cp.RawKernel(SPIN, "spin")
    rows, outputs = [], {}
    for v in variants:
        with v:
            for name, (per, fn) in make_ops(v, cp, arrays).items():
                calls = 50 if name.startswith("fused_moe") else (25 if per > 1 else 200)
                t0 = time.perf_counter()
                try:
                    r = time_gpu(cp, fn, calls, spin)
                except Exception as exc:  # keep the other cells (an old path may not run on a changed kernel)
                    print(f"{v.name} {name}: FAILED {type(exc).__name__}: {exc}", flush=True)
                    continue
                out = fn()
                cp.cuda.Device().synchronize()
                outputs[(v.name, name)] = cp.asnumpy(cp.asarray(out)).copy()  # (torch outputs: a zero-copy view)
                r.update(variant=v.name, op=name, calls=calls, per_op=per, seconds=round(time.perf_counter() - t0, 2))
                rows.append(r)
                print(f"{v.name:14} {name:36} host {r['host_us']:8.1f} us  wall {r['wall_us']:8.1f} us  "
                      f"device {r['device_us']:8.1f} us", flush=True)
    for row in rows:
        old_op = row["op"].replace(" torch", "")  # (the torch cells against old's CuPy cell)
        if row["variant"] != "old" and ("old", old_op) in outputs:
            row["bitwise_equal_old"] = bool(np.array_equal(outputs[(row["variant"], row["op"])].view(np.uint16),
                                                           outputs[("old", old_op)].view(np.uint16)))
    # where the new path's host time goes
    v = variants[1]
    with v:
        ops = make_ops(v, cp, arrays)
        profiles = {}
        for name, calls in (("gptq_marlin_gemm (buffers given)", 2000), ("gemm_phase_batched (8 dispatches)", 200),
                            ("fused_moe (fused, M=1)", 100), ("fused_moe Mixtral M=1", 200)):
            if name in ops:
                profiles[name] = profile(ops[name][1], calls)
            cp.cuda.Device().synchronize()
    return dict(rows=rows, profiles=profiles, gpu=cp.cuda.runtime.getDeviceProperties(0)["name"].decode())


def profile(fn, calls: int) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(14)
    return out.getvalue()


# ---------------------------------------------------------------------------------------------------------------
# CPU mode (stand-ins)
# ---------------------------------------------------------------------------------------------------------------
def run_cpu(args, variants) -> dict:
    import fake_device
    from fake_device import FakeArray

    rows = []
    with fake_device.installed() as (fake, driver):
        gemm_old = variants[0].gemm
        old_patches = dict(_cupy=lambda: fake, device_properties=lambda device: fake_device.PROPS,
                           get_kernel=lambda name, device, smem=0: (lambda *a, **k: None),
                           resident_blocks=lambda name, device: 2)
        for name, value in old_patches.items():
            setattr(gemm_old, name, value)
        # HEAD's launch on the fakes (a tree before workbench.cuda kept these in gemm; its launches plain, as the
        # stand-in's default policy)
        from workbench.cuda import arrays as rt_arrays

        for name, value in (("_cupy_module", fake), ("_driver_module", driver), ("_FAST_ARRAY", FakeArray),
                            ("function_ptr", gemm.kernels.function_ptr), ("PROGRAMMATIC_LAUNCH", False)):
            if name in vars(gemm_old):
                setattr(gemm_old, name, value)
        assert rt_arrays._cupy_module is fake
        driver.launchKernel = lambda *a: None  # the stand-in's decoding is test machinery, not launch cost
        no_kernel = (lambda *a, **k: (lambda *x, **y: None))  # the MoE helper kernels (CuPy calls) as no-ops
        saved_moe = [(mod, mod.get_moe_kernel) for mod in (variants[0].moe, moe)]
        for mod, _ in saved_moe:
            mod.get_moe_kernel = no_kernel
        sms = fake_device.SMS
        arrays = dict(a=FakeArray((1, K), np.float16), w=dense_weight(np, K, N), c=FakeArray((1, N), np.float16),
                      ws=FakeArray((gemm.workspace_numel(sms),), np.int32),
                      ct=FakeArray((gemm.c_tmp_numel(sms),), np.float32),
                      x8=FakeArray((EXPERTS, HIDDEN), np.float16), y8=FakeArray((EXPERTS, 2 * INTER), np.float16))
        w13 = dense_weight(np, HIDDEN, 2 * INTER, EXPERTS)
        w2 = dense_weight(np, INTER, HIDDEN, EXPERTS)
        arrays["stacks"] = {v.name: (v.moe.MarlinExpertStack(w13), v.moe.MarlinExpertStack(w2)) for v in variants}
        arrays.update(hidden=FakeArray((1, HIDDEN), np.float16), topk_ids=FakeArray((1, TOP_K), np.int32),
                      topk_weights=FakeArray((1, TOP_K), np.float32), moe_only=args.moe_only,
                      dense_only=args.dense_only)
        arrays["model_stacks"], arrays["layers"] = moe_layers(
            np, variants, lambda shape: FakeArray(shape, np.float16), lambda x: FakeArray(x.shape, x.dtype))
        for v in variants:
            with v:
                for name, (per, fn) in make_ops(v, np, arrays).items():
                    if v.gkw and not v.gkw["policy"].direct_launch:
                        continue  # the CuPy call cannot run on stand-ins
                    fn()
                    calls = 300 if per > 1 or name.startswith("fused") else 2000
                    best = min(_loop(fn, calls) for _ in range(5))
                    rows.append(dict(variant=v.name, op=name, per_op=per, host_us=best))
                    print(f"{v.name:14} {name:36} host {best:8.1f} us/call (stand-ins, best of 5)", flush=True)
        profiles = {}
        with variants[1]:
            ops = make_ops(variants[1], np, arrays)
            for name in ("gptq_marlin_gemm (buffers given)", "gemm_phase_batched (8 dispatches)",
                         "fused_moe (fused, M=1)", "fused_moe Mixtral M=1"):
                if name in ops:
                    profiles[name] = profile(ops[name][1], 500)
        for mod, fn in saved_moe:
            mod.get_moe_kernel = fn
    return dict(rows=rows, profiles=profiles, gpu="cpu stand-ins")


def _loop(fn, calls):
    t0 = time.perf_counter_ns()
    for _ in range(calls):
        fn()
    return (time.perf_counter_ns() - t0) / calls / 1e3


def table(rows) -> str:
    by = {(r["variant"], r["op"]): r for r in rows}
    ops = list(dict.fromkeys(r["op"] for r in rows))
    lines = [f"{'op':36} {'metric':10} {'old':>9} {'new':>9} {'new/old':>8} {'cupy-call':>9}  per dispatch new"]
    for op in ops:
        for metric in ("host_us", "wall_us", "device_us"):
            o, n, cc = (by.get((v, op), {}).get(metric) for v in ("old", "new", "new-cupy-call"))
            if n is None:
                continue
            per = by[("new", op)]["per_op"]
            fmt = (lambda x: f"{x:9.1f}" if x is not None else f"{'-':>9}")
            ratio = f"{n / o:8.3f}" if o else f"{'-':>8}"
            lines.append(f"{op:36} {metric:10} {fmt(o)} {fmt(n)} {ratio} {fmt(cc)}  "
                         f"{n / per:8.1f}" + (f"  bitwise={by[('new', op)].get('bitwise_equal_old')}"
                                              if metric == "host_us" and "bitwise_equal_old" in by[("new", op)] else ""))
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--old-dir", type=pathlib.Path, default=ROOT / "artifacts" / "r4_host_old")
    parser.add_argument("--cpu", action="store_true", help="stand-in arrays and driver (no GPU)")
    parser.add_argument("--moe-only", action="store_true", help="only the fused_moe cells (MOE_MODELS x MOE_MS)")
    parser.add_argument("--dense-only", action="store_true", help="only the dense GEMM cells (and torch's)")
    args = parser.parse_args()
    gemm_old, moe_old = load_old(args.old_dir)
    variants = [Variant("old", gemm_old, moe_old), Variant("new", gemm, moe, direct=True)]
    result = run_cpu(args, variants) if args.cpu else run_gpu(args, variants)
    result.update(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  shapes=dict(dense=(1, K, N), moe=dict(experts=EXPERTS, hidden=HIDDEN, inter=INTER, top_k=TOP_K)))
    args.out.mkdir(parents=True, exist_ok=True)
    tag = "cpu" if args.cpu else result["gpu"].replace(" ", "_")
    (args.out / f"host_{tag}.json").write_text(json.dumps(result, indent=1))
    for name, text in result["profiles"].items():
        print(f"\n--- cProfile, new path: {name} ---\n{text}")
    print(table(result["rows"]))


if __name__ == "__main__":
    main()
