"""The microscaled formats' speed in one run: the dense GEMM on NVFP4 / MXFP4 / MXFP8 weights beside cuBLAS fp16
(and vLLM's FP4 Marlin where ``--vllm`` builds it), and the Numba ports of their repacks beside a device copy.

    python bench/bench_fp4.py [--out DIR] [--m 1,16,64] [--layers KxN,...] [--formats nvfp4-fp16,mxfp4-bf16,...]

GEMM method: bench/timing.py's graphs (LAUNCHES launches per graph over weight copies rotated past 3 x L2,
interleaved medians), as bench/bench_gemm.py. Weights are random Marlin words and valid scale bytes (a GEMM's cost
does not depend on the values; tests/gpu/test_fp4_gemm.py checks the results). Bytes = weights + scale bytes + A + C.
Repack method: bench_repack.py's isolated call; bytes = read + written; pct_copy against the same run's copy;
``--old-dir OLD`` times OLD's kernels_numba/fp4_repack.py beside ours (same inputs, outputs compared bit for bit),
``--sweep`` the weight kernels' other launch shapes, and the scale rows carry the tile kernel's launch alone
(method ``ours_kernel``) beside the whole call, which waits for its error check.
Adds its rows to OUT/gemm.json and OUT/repack.json (HELPERS.md's schema): rows of the other weight types stay,
earlier rows of these formats are replaced, the meta is this run's (its notes and peers merged into the old ones).
"""
from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import numpy as np  # noqa: E402

import timing  # noqa: E402

LAYERS = ((4096, 4096), (4096, 14336), (14336, 4096), (8192, 8192), (8192, 28672), (28672, 8192))  # (K, N)
# format-act -> (b_q_type, bits, group, scale byte range [lo, hi], global scale)
FORMATS = {
    "nvfp4-fp16": ("fe2m1f", 4, 16, (0x80, 0xE0), True),
    "nvfp4-bf16": ("fe2m1f", 4, 16, (0x80, 0xE0), True),
    "mxfp4-bf16": ("fe2m1f", 4, 32, (120, 134), False),
    "mxfp8-bf16": ("fe4m3fn", 8, 32, (120, 134), False),
}
REPACK_LAYERS = ((8192, 28672), (28672, 8192))  # >= 100 MB of E2M1 bytes + Marlin words


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "bench" / "results"), type=pathlib.Path)
    p.add_argument("--m", default="1,16,64")
    p.add_argument("--layers", default="")
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--no-repack", action="store_true")
    p.add_argument("--no-gemm", action="store_true")
    p.add_argument("--vllm", action="store_true", help="time vLLM's NVFP4 Marlin too (fp16; bench/peers.py builds it)")
    p.add_argument("--peers-src", default=str(ROOT / "_dev" / "peers_src"), type=pathlib.Path)
    p.add_argument("--budget-s", type=float, default=0)
    p.add_argument("--old-dir", default=None, type=pathlib.Path,
                   help="a previous checkout: time its fp4_repack module beside ours (repack rows, method 'old')")
    p.add_argument("--sweep", action="store_true", help="repack: time the weight kernels' other launch shapes too")
    p.add_argument("--rounds", type=int, default=11, help="repack: interleaved rounds")
    args = p.parse_args(argv)
    t_start = time.time()
    import cupy as cp
    import torch

    from workbench import gemm
    from workbench.scalar_types import ScalarType

    if args.no_gemm:
        dev = timing.device()
        ceil = timing.ceilings(dev)
        print(f"{dev.name}: ceilings {ceil}", flush=True)
        repack(args.out, dev, ceil, cp, torch, args.old_dir, args.sweep, args.rounds)
        return 0
    ms = [int(v) for v in args.m.split(",")]
    layers = [tuple(int(v) for v in s.split("x")) for s in args.layers.split(",")] if args.layers else list(LAYERS)
    formats = args.formats.split(",")
    dev = timing.device()
    ceil = timing.ceilings(dev)
    print(f"{dev.name}: ceilings {ceil}", flush=True)
    notes, versions = {}, {"cublas": f"torch {torch.__version__} (torch.matmul fp16)"}
    t0 = time.time()
    cfgs = []
    for f in formats:
        wq, bits, group, _, _ = FORMATS[f]
        act = ScalarType.F16 if f.endswith("fp16") else ScalarType.BF16
        for k, n in layers:
            for m in ms:
                cfg = gemm.config_for(act, ScalarType.parse(wq), m, n, k, group, False)
                cfgs.append(dataclasses.replace(cfg, e8m0_scales=f.startswith("mx")))
    gemm.precompile(cfgs, workers=16)
    notes["ours_compile_s"] = round(time.time() - t0, 1)
    print(f"compiled {len({c.name_expression for c in cfgs})} kernels in {notes['ours_compile_s']} s", flush=True)
    vllm = None
    if args.vllm:
        import peers as peer_mod

        try:
            if not peer_mod.vllm_build_record(["nvfp4"]):  # (a background build not done yet: not waited for)
                raise RuntimeError("the background build (peers.py build-vllm --wtypes nvfp4) has not finished")
            vops, secs = peer_mod.build_vllm_marlin(args.peers_src, ["nvfp4"])
            vllm_id = int(vops.type_id("nvfp4"))
            vllm = vops
            versions["vllm_marlin"] = peer_mod.peer_versions(args.peers_src).get("vllm_marlin", "unknown")
            notes["vllm_marlin_load_s"] = round(secs, 1)
            notes["vllm_marlin_build"] = peer_mod.vllm_build_record(["nvfp4"])
        except Exception as exc:  # a peer that does not build is reported, not fatal
            notes["vllm_marlin"] = f"not built: {type(exc).__name__}: {str(exc)[-400:]}"
            print(notes["vllm_marlin"], flush=True)
    v_workspace = torch.zeros(dev.sms * 4, dtype=torch.int32, device="cuda")
    workspace = torch.zeros(gemm.workspace_numel(dev.sms), dtype=torch.int32, device="cuda")
    c_tmp = torch.empty(gemm.c_tmp_numel(dev.sms), dtype=torch.float32, device="cuda")
    rows = []
    for k, n in layers:
        if args.budget_s and time.time() - t_start > args.budget_s:
            notes.setdefault("skipped_layers", []).append(f"{k}x{n}")
            continue
        name = f"{k}x{n}"
        w16 = [torch.randn(k, n, device="cuda", dtype=torch.float16) * 0.01
               for _ in range(timing.copies_for(k * n * 2, dev.l2_bytes))]
        weights = {}
        for f in formats:
            wq, bits, group, (lo, hi), has_g = FORMATS[f]
            nb = k * n * bits // 8 + (k // group) * n
            copies = timing.copies_for(nb, dev.l2_bytes)
            # Marlin tiles [K/16, N 16 bits / 32]
            weights[f] = [(torch.randint(-2**31, 2**31 - 1, (k // 16, n * bits // 2), dtype=torch.int32, device="cuda"),
                           torch.randint(lo, hi + 1, (k // group, n), dtype=torch.uint8, device="cuda"),
                           torch.ones(1, dtype=torch.float32, device="cuda") if has_g else None)
                          for _ in range(copies)], nb
        for m in ms:
            cells, agree = {}, {}
            a16 = [torch.randn(m, k, device="cuda", dtype=torch.float16) for _ in range(2)]
            abf = [x.to(torch.bfloat16) for x in a16]
            io = m * k * 2 + m * n * 2

            def launch_list(fn):
                return [(lambda i=i: fn(i)) for i in range(timing.LAUNCHES)]

            c16 = torch.empty(m, n, device="cuda", dtype=torch.float16)
            cells[("cublas", "fp16", "fp16")] = (
                launch_list(lambda i: torch.matmul(a16[i % 2], w16[i % len(w16)], out=c16)), k * n * 2 + io)
            for f in formats:
                ws, nb = weights[f]
                wq = FORMATS[f][0]
                a = a16 if f.endswith("fp16") else abf
                c = torch.empty(m, n, device="cuda", dtype=a[0].dtype)

                def call(i, ws=ws, a=a, c=c, wq=wq):
                    q, s, g = ws[i % len(ws)]
                    return gemm.gptq_marlin_gemm(a[i % 2], q, s, None, None, None, workspace, wq, m, n, k, c=c,
                                                 c_tmp=c_tmp, global_scale=g)

                cells[("ours",) + tuple(f.split("-"))] = (launch_list(call), nb + io)
                if vllm is not None and f == "nvfp4-fp16":
                    cv = torch.empty(m, n, device="cuda", dtype=torch.float16)

                    def vcall(i, ws=ws, a=a, cv=cv):
                        q, s, g = ws[i % len(ws)]
                        return vllm.gemm(a[i % 2], cv, q, None, s.view(torch.float8_e4m3fn), g, None, None, None,
                                         v_workspace, vllm_id, m, n, k, True, False, True, False)

                    cells[("vllm_marlin", "nvfp4", "fp16")] = (launch_list(vcall), nb + io)
                    call(0)
                    vcall(0)
                    torch.cuda.synchronize()
                    # the same inputs: both compute a @ (E2M1 x scale) x global in fp32; they may differ by the
                    # order of fp32 sums and one rounding of each
                    agree[f] = round(float((c.float() - cv.float()).abs().max() / cv.float().abs().max()), 6)
            timers = {}
            for key, (ls, _) in cells.items():
                try:
                    timers[key] = timing.GraphTimer(ls)
                except Exception as exc:
                    notes[f"{key}_{name}_m{m}"] = f"{type(exc).__name__}: {str(exc)[-300:]}"
                    print(f"{key} failed: {exc!r}", flush=True)
            stats = timing.interleaved(timers)
            cub = stats.get(("cublas", "fp16", "fp16"), {}).get("us")
            for (method, w, act), st in stats.items():
                nb = cells[(method, w, act)][1]
                g = timing.gbs(nb, st["us"])
                row = dict(layer=name, n=n, k=k, m=m, wtype=w, group=FORMATS[f"{w}-{act}"][2] if method == "ours"
                           else None, act=act, launch="graph", method=method, us=round(st["us"], 3),
                           q1=round(st["q1"], 3), q3=round(st["q3"], 3), gbs=round(g, 1),
                           pct_copy=round(100 * g / ceil["copy_gbs"], 1))
                if cub:
                    row["speedup_vs_cublas"] = round(cub / st["us"], 3)
                if f"{w}-{act}" in agree:
                    row["max_rel_diff_vllm"] = agree[f"{w}-{act}"]
                rows.append(row)
                print(f"{name:>11s} M={m:3d} {method:7s} {w:6s} {act:5s} {st['us']:9.2f} us {g:7.0f} GB/s "
                      f"x{row.get('speedup_vs_cublas', 0):.2f}", flush=True)
            del timers, cells
        del w16, weights
        torch.cuda.empty_cache()
    meta = timing.meta(ROOT, dev, ceil, {"launch": ["graph"], "launches_per_graph": timing.LAUNCHES, "notes": notes,
                                         "wall_s": round(time.time() - t_start, 1)},
                       versions)
    merge_results(args.out, "gemm", meta, rows, ("layer", "m", "wtype", "act", "method", "launch", "run"))
    if not args.no_repack:
        repack(args.out, dev, ceil, cp, torch, args.old_dir, args.sweep, args.rounds)
    print(f"done in {time.time() - t_start:.0f} s", flush=True)
    return 0


def merge_results(out: pathlib.Path, family: str, meta: dict, rows: list, key_fields: tuple) -> None:
    """This run's rows into OUT/<family>.json (tagged ``run`` = "fp4"): an old row with the same ``key_fields`` as a
    new one gives way, every other row stays (so runs of different cells add up); the meta is this run's with the
    old one's peers and, under ``fp4_run``, this run's method beside the old method."""
    import json

    def key(r):
        return tuple(r.get(f) for f in key_fields)

    rows = [{**r, "run": "fp4"} for r in rows]
    path = out / f"{family}.json"
    new_keys = {key(r) for r in rows}
    old_rows = []
    if path.exists():
        prior = json.loads(path.read_text())
        old_rows = [r for r in prior["rows"] if key(r) not in new_keys]
        old_meta = prior["meta"]
        meta = {**meta, "peers": {**old_meta.get("peers", {}), **meta.get("peers", {})},
                "method": {**old_meta.get("method", {}), "fp4_run": meta["method"]}}
    timing.write_results(out, family, meta, old_rows + rows)


REPACK_OPS = ("fp4_marlin_repack", "marlin_to_fp4", "mxfp8_marlin_repack", "nvfp4_marlin_scales", "mx_marlin_scales",
              "marlin_to_nvfp4_scales", "marlin_to_mx_scales")


def _old_module(old_dir: pathlib.Path):
    """OLD's kernels_numba/fp4_repack.py as module ``fp4_repack_old`` (it imports only modules both trees share)."""
    import importlib.util

    path = pathlib.Path(old_dir) / "kernels_numba" / "fp4_repack.py"
    spec = importlib.util.spec_from_file_location("fp4_repack_old", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def repack(out, dev, ceil, cp, torch, old_dir=None, sweep=False, rounds=11) -> None:
    """The FP4 family's Numba ports on the GPU: weights and scale routes, isolated calls (an L2 flush, a spin kernel
    ahead of the start event: the call's device work, and its host work where the call waits for the device, as
    the scale routes do for their error check). Methods: ``ours`` (the public wrapper), ``old`` (OLD's module, or
    for MXFP8 weights the block-FP8 transpose-tile route it dispatched to; outputs compared bit for bit with ours),
    ``ours_kernel`` (the scale tile kernel's launch alone, buffers allocated once), and with ``sweep`` the weight
    kernels' other launch shapes ``ours_g{groups}_{k|n}fast_w{warps}[_warpsync]``. Bytes = read + written."""
    from kernels_numba import fp4_repack as kf
    from kernels_numba import marlin_repack as kr
    from workbench import ops

    old = _old_module(old_dir) if old_dir else None
    rows, notes, t_start = [], {}, time.time()

    def stream():
        return torch.cuda.current_stream().cuda_stream

    shapes = ([(g, nf, 4, False) for g in (1, 2) for nf in (False, True)] + [(1, False, 8, False), (1, True, 8, False)]
              + [(1, False, 4, True), (1, True, 4, True)])
    for k, n in REPACK_LAYERS:
        fp4 = cp.random.randint(0, 256, size=(n, k // 2), dtype=cp.int32).astype(cp.uint8)
        fp8 = cp.random.randint(0, 0x7F, size=(n, k), dtype=cp.int32).astype(cp.uint8)
        e4m3 = cp.random.randint(0x30, 0x7E, size=(n, k // 16), dtype=cp.int32).astype(cp.uint8)
        e8m0 = cp.random.randint(110, 140, size=(n, k // 32), dtype=cp.int32).astype(cp.uint8)
        q4 = kf.fp4_marlin_repack(fp4, k, n)
        s_nv = kf.nvfp4_marlin_scales(e4m3, k, n, np.float16, 1.0)[0]
        s_mx = kf.mx_marlin_scales(e8m0, k, n, "mxfp4")
        cases = {  # op -> (wtype, bytes read + written, {method: call})
            "fp4_marlin_repack": ("fe2m1f", 2 * (k * n // 2), {
                "ours": lambda: ops.fp4_marlin_repack(fp4, k, n, backend="numba", stream=stream())}),
            "marlin_to_fp4": ("fe2m1f", 2 * (k * n // 2), {
                "ours": lambda: ops.marlin_to_fp4(q4, k, n, backend="numba", stream=stream())}),
            "mxfp8_marlin_repack": ("fe4m3fn", 2 * k * n, {
                "ours": lambda: ops.mxfp8_marlin_repack(fp8, k, n, backend="numba", stream=stream())}),
            "nvfp4_marlin_scales": ("fe4m3fn", 2 * (k // 16) * n, {
                "ours": lambda: ops.nvfp4_marlin_scales(e4m3, k, n, "float16", 1.0, backend="numba",
                                                        stream=stream())}),
            "mx_marlin_scales": ("fe8m0fnu", 2 * (k // 32) * n, {
                "ours": lambda: ops.mx_marlin_scales(e8m0, k, n, "mxfp4", backend="numba", stream=stream())}),
            "marlin_to_nvfp4_scales": ("fe4m3fn", 2 * (k // 16) * n, {
                "ours": lambda: ops.marlin_to_nvfp4_scales(s_nv, k, n, 1.0, backend="numba", stream=stream())}),
            "marlin_to_mx_scales": ("fe8m0fnu", 2 * (k // 32) * n, {
                "ours": lambda: ops.marlin_to_mx_scales(s_mx, k, n, "mxfp4", backend="numba", stream=stream())}),
        }
        if old is not None:
            cases["fp4_marlin_repack"][2]["old"] = lambda: old.fp4_marlin_repack(fp4, k, n, stream=stream())
            cases["marlin_to_fp4"][2]["old"] = lambda: old.marlin_to_fp4(q4, k, n, stream=stream())
            cases["mxfp8_marlin_repack"][2]["old"] = lambda: kr.block_fp8_group128_repack(fp8, k, n, stream=stream())
            cases["nvfp4_marlin_scales"][2]["old"] = lambda: old.nvfp4_marlin_scales(e4m3, k, n, np.float16, 1.0,
                                                                                    stream=stream())
            cases["mx_marlin_scales"][2]["old"] = lambda: old.mx_marlin_scales(e8m0, k, n, "mxfp4", stream=stream())
            cases["marlin_to_nvfp4_scales"][2]["old"] = lambda: old.marlin_to_nvfp4_scales(s_nv, k, n, 1.0,
                                                                                          stream=stream())
            cases["marlin_to_mx_scales"][2]["old"] = lambda: old.marlin_to_mx_scales(s_mx, k, n, "mxfp4",
                                                                                    stream=stream())
        # the scale tile kernels' launches alone (what the call adds: the memset of the error slot, the read-back)
        ng16, ng32 = k // 16, k // 32
        err = cp.zeros(6, dtype=cp.uint64)
        o16, o32 = cp.empty((1, ng16, n), cp.uint8), cp.empty((1, ng32, n), cp.uint8)
        b16, b32 = cp.empty((1, n, ng16), cp.uint8), cp.empty((1, n, ng32), cp.uint8)
        tile = {("nvfp4", True): (e4m3.reshape(1, n, ng16), o16, ng16),
                ("mx", True): (e8m0.reshape(1, n, ng32), o32, ng32),
                ("nvfp4", False): (s_nv.reshape(1, ng16, n), b16, ng16),
                ("mx", False): (s_mx.reshape(1, ng32, n), b32, ng32)}

        def kernel_call(kind, forward):
            src, dst, ng = tile[(kind, forward)]
            grid = kf._scale_grid(ng, n, 1)
            if forward:
                kern = kf._kernel("scale_tile", kind)
                return lambda: kern[grid, kf.SCALE_THREADS, stream()](src, dst, ng, n, 0, err)
            kern = kf._kernel("scale_untile", kind)
            return lambda: kern[grid, kf.SCALE_THREADS, stream()](src, dst, ng, n, 0)

        cases["nvfp4_marlin_scales"][2]["ours_kernel"] = kernel_call("nvfp4", True)
        cases["mx_marlin_scales"][2]["ours_kernel"] = kernel_call("mx", True)
        cases["marlin_to_nvfp4_scales"][2]["ours_kernel"] = kernel_call("nvfp4", False)
        cases["marlin_to_mx_scales"][2]["ours_kernel"] = kernel_call("mx", False)
        if sweep:
            for shape in shapes:
                tag = f"ours_g{shape[0]}_{'n' if shape[1] else 'k'}fast_w{shape[2]}{'_warpsync' if shape[3] else ''}"
                cases["fp4_marlin_repack"][2][tag] = (lambda shape=shape: kf.fp4_marlin_repack(
                    fp4, k, n, stream=stream(), launch=shape))
                cases["marlin_to_fp4"][2][tag] = (lambda shape=shape: kf.marlin_to_fp4(
                    q4, k, n, stream=stream(), launch=shape))
                cases["mxfp8_marlin_repack"][2][tag] = (lambda shape=shape: kf.mxfp8_marlin_repack(
                    fp8, k, n, stream=stream(), launch=shape))
        for op, (wtype, nbytes, methods) in cases.items():
            equal = {}
            try:
                ref = methods["ours"]()
                if isinstance(ref, tuple):
                    ref = ref[0]
                for m, fn in methods.items():
                    if m == "ours" or m == "ours_kernel":
                        continue
                    got = fn()
                    got = got[0] if isinstance(got, tuple) else got
                    equal[m] = bool(cp.array_equal(cp.asarray(got).view(cp.uint8).ravel(),
                                                   cp.asarray(ref).view(cp.uint8).ravel()))
                timers = {m: timing.IsolatedTimer(fn, dev.l2_bytes) for m, fn in methods.items()}
                stats = timing.interleaved(timers, rounds)
            except Exception as exc:
                notes[f"{op}_{k}x{n}"] = f"{type(exc).__name__}: {str(exc)[-300:]}"
                print(f"{op} failed: {exc!r}", flush=True)
                continue
            for m, st in stats.items():
                g = timing.gbs(nbytes, st["us"])
                row = dict(op=op, n=n, k=k, wtype=wtype, method=m, launch="isolated", us=round(st["us"], 2),
                           q1=round(st["q1"], 2), q3=round(st["q3"], 2), gbs=round(g, 1),
                           pct_copy=round(100 * g / ceil["copy_gbs"], 1), mb=round(nbytes / 2 / 1e6, 1))
                if m in equal:
                    row["bitwise_equal_ours"] = equal[m]
                rows.append(row)
                print(f"{op:22s} {k}x{n} {m:14s} {st['us']:9.1f} us {g:7.0f} GB/s {row['pct_copy']:5.1f}% copy"
                      f"{'' if m not in equal else ' equal=' + str(equal[m])}", flush=True)
            del timers
        del cases, tile, q4, s_nv, s_mx
        cp.get_default_memory_pool().free_all_blocks()
    meta = timing.meta(ROOT, dev, ceil, {"launch": ["isolated"], "rounds": rounds, "notes": notes,
                                         "old_dir": str(old_dir) if old_dir else None,
                                         "wall_s": round(time.time() - t_start, 1)}, {})
    merge_results(out, "repack", meta, rows, ("op", "n", "k", "wtype", "method", "launch", "run"))


if __name__ == "__main__":
    sys.exit(main())
