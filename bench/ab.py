"""A/B timing of ours against a previous version of the tree, and of policy variants, in one process, on the same
inputs, interleaved (GPU).

    git archive REV | tar -x -C OLD          # OLD: a whole previous checkout
    python bench/ab.py gemm --old-dir OLD [--m 1,16,64] [--layers 4096x14336,...] [--wtypes u4b8,fe4m3fn]
                            [--variant nopdl:programmatic_launch=False ...] [--tree NAME=DIR ...]
                            [--launch graph,isolated] [--rounds 7] [--out DIR]
    python bench/ab.py moe  --old-dir OLD [--m 1,8,64] [--models mixtral,dsv3] [--variant b1:blocks_per_sm=1 ...]
    python bench/ab.py host --old-dir OLD [--rounds 5]   (host µs per planned call, CuPy and torch inputs)

OLD's ``workbench`` package is loaded as a second package, ``workbench_old`` (a copy whose ``workbench`` imports are
renamed, beside links to OLD's kernel folders), so its kernels compile from OLD's sources. Variants: ``new`` (this
tree, default policy), ``old`` (OLD, its defaults), each ``--tree NAME=DIR`` (another whole checkout loaded the same
way as ``workbench_NAME``, its defaults: e.g. this tree with a compile-time constant of a kernel changed), and each
``--variant NAME:field=value,...``: this tree with ``dataclasses.replace`` of its default policy (GemmPolicy for
gemm, MoePolicy for moe; values are Python literals). Method: bench/timing.py, ``--launch`` graph (a graph of
LAUNCHES calls on rotated inputs) and/or isolated (one call after an L2 flush, a spin kernel ahead of the start event:
device time of a lone launch), ``--rounds`` interleaved rounds, median and quartiles. Each variant's first output
(into a NaN-poisoned buffer) is compared with old's: ``bits_equal_old`` (what a change that keeps the partition and
the summation order must give), ``max_rel_old`` = max |x - old| / max |old| and ``written`` (no poison left). ``host``: host µs per planned call (HOST_CALLS calls queued
without a synchronisation, wall clock / calls; median of ``--rounds`` interleaved batches) of gptq_marlin_gemm on
CuPy arrays and on torch tensors, marlin_gemm, one fused MoE phase and fused_moe at M = 1 (policy variants apply to
the dense calls). Writes OUT/ab_<family>.json (default: the current directory) and
prints a table.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import pathlib
import re
import shutil
import sys
import tempfile
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import timing  # noqa: E402

IMPORT = re.compile(r"^(\s*(?:from|import)\s+)workbench\b", re.M)


def parse_variant(spec: str) -> tuple[str, dict]:
    """"name:field=value,field=value" -> (name, {field: value}); values are Python literals."""
    name, sep, body = spec.partition(":")
    if not sep or not name or not body:
        raise ValueError(f"variant {spec!r}: expected NAME:field=value[,field=value...]")
    fields = {}
    for item in re.split(r",(?=\s*\w+\s*=)", body):  # a comma inside a tuple value does not split
        field, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"variant {spec!r}: {item!r} is not field=value")
        try:
            fields[field.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError) as exc:
            raise ValueError(f"variant {spec!r}: {value!r} is not a Python literal") from exc
    return name, fields


def policy_variant(default, fields: dict):
    """dataclasses.replace of ``default``; ValueError naming unknown fields (before any launch)."""
    known = {f.name for f in dataclasses.fields(default)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"{type(default).__name__} has no field(s) {unknown}")
    return dataclasses.replace(default, **fields)


def variants_of(new_mod, old_mod, default, specs, trees=None) -> dict:
    """name -> (module, policy or None): new (the default policy), old (its own defaults), one per --tree (name ->
    module, its own defaults), one per --variant."""
    variants = {"new": (new_mod, default), "old": (old_mod, None)}
    for name, mod in (trees or {}).items():
        if name in variants:
            raise ValueError(f"tree name {name!r} is taken (new and old are built in)")
        variants[name] = (mod, None)
    for spec in specs:
        name, fields = parse_variant(spec)
        if name in variants:
            raise ValueError(f"variant name {name!r} is taken (new and old are built in)")
        variants[name] = (new_mod, policy_variant(default, fields))
    return variants


def parse_tree(spec: str) -> tuple[str, pathlib.Path]:
    """"NAME=DIR" -> (NAME, DIR); NAME must make a package name (workbench_NAME)."""
    name, sep, folder = spec.partition("=")
    if not sep or not re.fullmatch(r"[a-z][a-z0-9_]*", name) or not folder:
        raise ValueError(f"tree {spec!r}: expected NAME=DIR, NAME in lower-case letters, digits and _")
    return name, pathlib.Path(folder)


def load_old(old_dir: pathlib.Path, package: str = "workbench_old"):
    """OLD's workbench as package ``package``: its modules copied with their ``workbench`` imports renamed, OLD's
    kernel folders linked beside (the package finds its kernels relative to itself)."""
    old_dir = pathlib.Path(old_dir).resolve()
    if not (old_dir / "workbench" / "__init__.py").exists():
        raise FileNotFoundError(f"{old_dir} holds no workbench package (expected a whole previous checkout)")
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="ab_old_"))
    dest = tmp / package
    shutil.copytree(old_dir / "workbench", dest, ignore=shutil.ignore_patterns("__pycache__"))
    for py in dest.rglob("*.py"):
        text = py.read_text()
        py.write_text(IMPORT.sub(rf"\g<1>{package}", text).replace("import_module(\"workbench.",
                                                                   f"import_module(\"{package}."))
    for folder in ("kernels_cuda", "kernels_numba"):
        if (old_dir / folder).exists():
            (tmp / folder).symlink_to(old_dir / folder)
    sys.path.insert(1, str(tmp))
    import importlib

    return importlib.import_module(package)


def compare(torch, out, ref) -> dict:
    """Bit for bit (the raw 16-bit words: a poisoned NaN left in both still differs from a value), the largest
    difference relative to max |ref|, and whether ``out`` was written everywhere (no poison NaN left)."""
    same = out.shape == ref.shape and bool(torch.equal(out.view(torch.int16), ref.view(torch.int16)))
    o, r = out.float(), ref.float()
    scale = float(r.nan_to_num(0).abs().max()) or 1.0
    return {"bits_equal_old": same, "max_rel_old": float((o - r).abs().nan_to_num(float("inf")).max()) / scale,
            "written": not bool(torch.isnan(o).any())}


def package_of(mod):
    """The package (workbench, workbench_old, workbench_NAME) a variant's module belongs to."""
    return sys.modules[mod.__name__.split(".")[0]]


def timers_of(launches: list[str], calls: list, l2_bytes: int) -> dict:
    """launch kind -> timer of the zero-argument ``calls`` (rotated inputs): graph (all of them in one graph) or
    isolated (the first, alone after an L2 flush)."""
    timers = {}
    for launch in launches:
        if launch == "graph":
            timers[launch] = timing.GraphTimer(calls)
        elif launch == "isolated":
            timers[launch] = timing.IsolatedTimer(calls[0], l2_bytes)
        else:
            raise ValueError(f"launch {launch!r} is not one of graph, isolated")
    return timers


def precompile_gemm(variants, cells, group) -> None:
    """Every variant's kernels for ``cells`` (k, n, wtype, m) compiled up front in parallel threads, each package
    with its own configuration choice and sources (a failure is printed; the first call then compiles)."""
    for name, (mod, pol) in variants.items():
        t0 = time.time()
        try:
            st = importlib_module(package_of(mod), "scalar_types").ScalarType
            kw = {} if pol is None else {"policy": pol}
            cfgs = [mod.config_for(st.F16, st.parse(w), m, n, k, group[w], False, **kw) for k, n, w, m in cells]
            mod.precompile(cfgs, workers=16)
            print(f"{name}: {len({c.name_expression for c in cfgs})} kernels compiled in {time.time() - t0:.1f} s",
                  flush=True)
        except Exception as exc:  # noqa: BLE001 (a tree whose API differs compiles on first use instead)
            print(f"{name}: precompile failed ({type(exc).__name__}: {exc}); compiling on first use", flush=True)


def ab_gemm(args, torch, old, trees) -> list[dict]:
    import bench_gemm as bg
    from workbench import gemm
    from workbench.policy import DEFAULT_GEMM_POLICY
    from workbench.scalar_types import ScalarType

    old_gemm = importlib_module(old, "gemm")
    variants = variants_of(gemm, old_gemm, DEFAULT_GEMM_POLICY, args.variant,
                           {name: importlib_module(pkg, "gemm") for name, pkg in trees.items()})
    dev = timing.device()
    rows = []
    layers = [tuple(int(v) for v in s.split("x")) for s in args.layers.split(",")] if args.layers else bg.LAYERS
    ms = [int(v) for v in args.m.split(",")]
    precompile_gemm(variants, [(k, n, w, m) for k, n in layers for w in args.wtypes.split(",") for m in ms], bg.GROUP)
    workspace = torch.zeros(gemm.workspace_numel(dev.sms), dtype=torch.int32, device="cuda")
    c_tmp = torch.empty(gemm.c_tmp_numel(dev.sms), dtype=torch.float32, device="cuda")
    for k, n in layers:
        for w in args.wtypes.split(","):
            wt = ScalarType.parse(w)
            nb = bg.weight_bytes(k, n, wt.bits, bg.GROUP[w], wt.has_zero_points)
            ws = [bg.random_weight(torch, k, n, wt, bg.GROUP[w]) for _ in range(timing.copies_for(nb, dev.l2_bytes))]
            # the same arrays as each package's own MarlinWeight
            weights = {pkg.__name__: ws if mod is gemm else [old_weight(pkg, x) for x in ws]
                       for mod, _ in variants.values() for pkg in [package_of(mod)]}
            for m in ms:
                a = [torch.randn(m, k, device="cuda", dtype=torch.float16) for _ in range(2)]
                outs, timers = {}, {}
                for name, (mod, pol) in variants.items():
                    c = torch.full((m, n), float("nan"), device="cuda", dtype=torch.float16)  # poisoned
                    wl = weights[package_of(mod).__name__]
                    kw = {} if pol is None else {"policy": pol}

                    def call(i, mod=mod, c=c, wl=wl, kw=kw):
                        return mod.marlin_gemm(a[i % 2], wl[i % len(wl)], c=c, workspace=workspace, c_tmp=c_tmp, **kw)

                    call(0)
                    torch.cuda.synchronize()
                    outs[name] = c.clone()
                    # the timers write c from their own streams (torch's: not ordered after the default stream)
                    torch.cuda.synchronize()
                    for launch, timer in timers_of(args.launch, [(lambda i=i, f=call: f(i))
                                                                 for i in range(timing.LAUNCHES)], dev.l2_bytes).items():
                        timers[(name, launch)] = timer
                stats = timing.interleaved(timers, args.rounds)
                for (name, launch), st in stats.items():
                    row = dict(layer=bg.layer_name(k, n), n=n, k=k, m=m, wtype=w, group=bg.GROUP[w], act="fp16",
                               launch=launch, method=name, us=round(st["us"], 3), q1=round(st["q1"], 3),
                               q3=round(st["q3"], 3), gbs=round(timing.gbs(nb + m * k * 2 + m * n * 2, st["us"]), 1),
                               ratio_old=round(stats[("old", launch)]["us"] / st["us"], 4),
                               **compare(torch, outs[name], outs["old"]))
                    rows.append(row)
                    print(f"{row['layer']:>11s} M={m:4d} {w:8s} {name:10s} {launch:8s} {st['us']:9.2f} us "
                          f"[{st['q1']:.2f}-{st['q3']:.2f}] x{row['ratio_old']:.3f} vs old "
                          f"bits_equal={row['bits_equal_old']}", flush=True)
                del timers
    return rows


def ab_moe(args, torch, old, trees) -> list[dict]:
    import cupy as cp

    import bench_moe as bm
    from workbench import moe
    from workbench.formats.moe_align import moe_align_block_size as align_ref
    from workbench.policy import DEFAULT_MOE_POLICY
    from workbench.scalar_types import ScalarType
    from workbench.weight import MarlinWeight

    old_moe = importlib_module(old, "moe")
    variants = variants_of(moe, old_moe, DEFAULT_MOE_POLICY, args.variant,
                           {name: importlib_module(pkg, "moe") for name, pkg in trees.items()})
    dev = timing.device()
    rng = np.random.default_rng(0)
    rows = []
    for model in args.models.split(","):
        e, k, n, top_k = bm.MODELS[model]
        words = cp.random.randint(-2**31, 2**31 - 1, size=(e, k // 16, n * 2), dtype=np.int64).astype(np.int32)
        scales = (cp.random.random((e, k // bm.GROUP, n), dtype=np.float32) * 0.01 + 0.001).astype(np.float16)
        new_w = MarlinWeight(words, scales, None, None, None, k, n, bm.GROUP, ScalarType.U4B8, np.dtype(np.float16),
                             num_experts=e)
        # one stack per package, over the same arrays
        stacks = {pkg.__name__: (mod.MarlinExpertStack(new_w) if mod is moe else
                                 mod.MarlinExpertStack(old_weight(pkg, new_w)))
                  for mod, _ in variants.values() for pkg in [package_of(mod)]}
        for m in (int(v) for v in args.m.split(",")):
            block = moe.choose_block_size(m, top_k, e)
            routings = bm.rotated_routings(rng, m, e, top_k, timing.LAUNCHES)
            aligned = [tuple(cp.asarray(x) for x in align_ref(ids, block, e)) for ids in routings]
            a = cp.asarray(rng.standard_normal((m, k), dtype=np.float32).astype(np.float16))
            outs, timers = {}, {}
            for name, (mod, pol) in variants.items():
                stack = stacks[package_of(mod).__name__]
                out = cp.full((m * top_k, n), np.nan, dtype=np.float16)  # poisoned (rows no block names stay so)
                kw = {} if pol is None else {"policy": pol}

                def call(r, stack=stack, out=out, kw=kw):
                    return stack.gemm_phase_fused(a, *r, out, m, block, top_k,
                                                  stream=torch.cuda.current_stream().cuda_stream, **kw)

                call(aligned[0])
                torch.cuda.synchronize()
                outs[name] = torch.from_dlpack(out).clone()
                torch.cuda.synchronize()  # (as for the GEMM: the timers write out from their own streams)
                for launch, timer in timers_of(args.launch, [(lambda r=r, f=call: f(r)) for r in aligned],
                                               dev.l2_bytes).items():
                    timers[(name, launch)] = timer
            stats = timing.interleaved(timers, args.rounds)
            for (name, launch), st in stats.items():
                row = dict(model=model, experts=e, topk=top_k, n=n, k=k, m=m, wtype="u4b8", group=bm.GROUP,
                           act="fp16", launch=launch, method=name, us=round(st["us"], 3), q1=round(st["q1"], 3),
                           q3=round(st["q3"], 3), ratio_old=round(stats[("old", launch)]["us"] / st["us"], 4),
                           **compare(torch, outs[name], outs["old"]))
                rows.append(row)
                print(f"{model:8s} M={m:4d} {name:10s} {launch:8s} {st['us']:9.2f} us [{st['q1']:.2f}-{st['q3']:.2f}]"
                      f" x{row['ratio_old']:.3f} vs old  bits_equal={row['bits_equal_old']}", flush=True)
            del timers
    return rows


HOST_K = HOST_N = 4096  # the dense host cells: M = 1, u4b8 g128 fp16 (the kernel's time stays below the host's)
HOST_MOE = ("mixtral", 8, 4096, 14336, 2)  # fused_moe cell: experts, hidden, intermediate, top-k; M = 1
HOST_CALLS = 200  # calls per batch, queued back to back (the launch queue never fills)


def host_batch(fn, calls: int = HOST_CALLS) -> float:
    """µs of host time per call: ``calls`` calls without a synchronisation, wall clock / calls (synchronised
    before, so the queue starts empty)."""
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter_ns()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter_ns()
    torch.cuda.synchronize()
    return (t1 - t0) / calls / 1e3


def ab_host(args, torch, old, trees) -> list[dict]:
    """Host µs per planned call of the GEMM and MoE entry points, each variant on the same arrays: CuPy and torch
    inputs (c and scratch given), marlin_gemm, one MoE phase (gemm_phase_fused) and fused_moe (align, two fused
    GEMMs, SiLU, top-k sum). Each cell's output compared with old's."""
    import cupy as cp

    import bench_moe as bm
    from workbench import gemm, moe
    from workbench.formats.moe_align import moe_align_block_size as align_ref
    from workbench.policy import DEFAULT_GEMM_POLICY
    from workbench.scalar_types import ScalarType
    from workbench.weight import MarlinWeight

    variants = variants_of(gemm, importlib_module(old, "gemm"), DEFAULT_GEMM_POLICY, args.variant,
                           {name: importlib_module(pkg, "gemm") for name, pkg in trees.items()})
    dev = timing.device()
    rng = np.random.default_rng(0)

    def words(shape):
        return cp.random.randint(-2**31, 2**31 - 1, size=shape, dtype=np.int64).astype(np.int32)

    def scales(shape):
        return (cp.random.random(shape, dtype=np.float32) * 0.01 + 0.001).astype(np.float16)

    k, n = HOST_K, HOST_N
    w = MarlinWeight(words((k // 16, n * 2)), scales((k // 128, n)), None, None, None, k, n, 128, ScalarType.U4B8,
                     np.dtype(np.float16))
    a = cp.asarray(rng.standard_normal((1, k), dtype=np.float32).astype(np.float16))
    ws = cp.zeros(gemm.workspace_numel(dev.sms), dtype=np.int32)
    ct = cp.empty(gemm.c_tmp_numel(dev.sms), dtype=np.float32)
    t = {name: torch.from_dlpack(x) for name, x in (("a", a), ("q", w.qweight), ("s", w.scales), ("ws", ws),
                                                     ("ct", ct))}
    _, e, hid, inter, top_k = HOST_MOE
    w13 = MarlinWeight(words((e, hid // 16, 2 * inter * 2)), scales((e, hid // 128, 2 * inter)), None, None, None,
                       hid, 2 * inter, 128, ScalarType.U4B8, np.dtype(np.float16), num_experts=e)
    w2 = MarlinWeight(words((e, inter // 16, hid * 2)), scales((e, inter // 128, hid)), None, None, None, inter, hid,
                      128, ScalarType.U4B8, np.dtype(np.float16), num_experts=e)
    hidden = cp.asarray(rng.standard_normal((1, hid), dtype=np.float32).astype(np.float16))
    ids = rng.choice(e, size=(1, top_k), replace=False).astype(np.int32)
    topk_ids, topk_w = cp.asarray(ids), cp.asarray(np.array([[0.6, 0.4]], np.float32))
    block = moe.choose_block_size(1, top_k, e)
    aligned = tuple(cp.asarray(x) for x in align_ref(ids, block, e))

    def cells(mod, pol):
        """name -> fn() -> output (a fresh array per variant for the outputs it writes)."""
        pkg = package_of(mod)
        mmod = importlib_module(pkg, "moe")
        wv = w if mod is gemm else old_weight(pkg, w)
        s13, s2 = (mmod.MarlinExpertStack(x if mod is gemm else old_weight(pkg, x)) for x in (w13, w2))
        kw = {} if pol is None else {"policy": pol}
        c = cp.empty((1, n), dtype=np.float16)
        tc = torch.empty(1, n, dtype=torch.float16, device="cuda")
        y = cp.empty((top_k, 2 * inter), dtype=np.float16)
        return {
            "gptq_marlin_gemm cupy": lambda: mod.gptq_marlin_gemm(a, w.qweight, w.scales, None, None, None, ws,
                                                                  "u4b8", 1, n, k, c=c, c_tmp=ct, **kw),
            "gptq_marlin_gemm torch": lambda: mod.gptq_marlin_gemm(t["a"], t["q"], t["s"], None, None, None,
                                                                   t["ws"], "u4b8", 1, n, k, c=tc, c_tmp=t["ct"],
                                                                   **kw),
            "marlin_gemm cupy": lambda: mod.marlin_gemm(a, wv, c=c, workspace=ws, c_tmp=ct, **kw),
            "gemm_phase_fused mixtral": lambda: s13.gemm_phase_fused(hidden, *aligned, y, 1, block, top_k),
            "fused_moe mixtral": lambda: mmod.fused_moe(hidden, s13, s2, topk_w, topk_ids),
        }

    per_variant = {name: cells(mod, pol) for name, (mod, pol) in variants.items()}
    rows = []
    for cell in per_variant["new"]:
        timers, outs = {}, {}
        for name, fns in per_variant.items():
            fn = fns[cell]
            try:
                out = fn()
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 (a tree without this entry point: the cell goes without it)
                print(f"{cell:26s} {name:10s} failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                continue
            outs[name] = torch.from_dlpack(out).clone()
            host_batch(fn, 20)  # plans and allocator warm
            timers[name] = (lambda f=fn: host_batch(f))
        stats = timing.interleaved(timers, args.rounds)
        for name, st in stats.items():
            ref = "old" if "old" in stats else name
            ck, cn = (hid, 2 * inter) if "mixtral" in cell else (k, n)
            row = dict(op=cell, k=ck, n=cn, m=1, wtype="u4b8", group=128, act="fp16", launch="plain", method=name, us=round(st["us"], 2),
                       q1=round(st["q1"], 2), q3=round(st["q3"], 2), ratio_old=round(stats[ref]["us"] / st["us"], 4),
                       calls=HOST_CALLS, **compare(torch, outs[name], outs[ref]))
            rows.append(row)
            print(f"{cell:26s} {name:10s} host {st['us']:8.2f} us/call [{st['q1']:.2f}-{st['q3']:.2f}] "
                  f"x{row['ratio_old']:.3f} vs old  bits_equal={row['bits_equal_old']}", flush=True)
    return rows


def importlib_module(package, name: str):
    import importlib

    return importlib.import_module(f"{package.__name__}.{name}")


def old_weight(old, w):
    """The same arrays as OLD's MarlinWeight (its own class)."""
    cls = importlib_module(old, "weight").MarlinWeight
    return cls(**{f.name: getattr(w, f.name) for f in dataclasses.fields(cls) if hasattr(w, f.name)})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("family", choices=("gemm", "moe", "host"))
    p.add_argument("--old-dir", required=True, type=pathlib.Path)
    p.add_argument("--out", default=".", type=pathlib.Path)
    p.add_argument("--m", default=None, help="default: 1,16,64 (gemm), 1,8,64 (moe)")
    p.add_argument("--layers", default="", help="gemm: KxN,... (default: bench_gemm's six)")
    p.add_argument("--wtypes", default="u4b8,fe4m3fn", help="gemm")
    p.add_argument("--models", default="mixtral,dsv3", help="moe")
    p.add_argument("--variant", action="append", default=[], help="NAME:field=value,... (repeatable)")
    p.add_argument("--tree", action="append", default=[], help="NAME=DIR: another whole checkout (repeatable)")
    p.add_argument("--launch", default="graph", help="graph,isolated")
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args(argv)
    for spec in args.variant:  # bad variants, trees and launch kinds fail here, before any GPU work
        parse_variant(spec)
    tree_dirs = dict(parse_tree(spec) for spec in args.tree)
    args.launch = args.launch.split(",")
    if not args.launch or set(args.launch) - {"graph", "isolated"}:
        p.error(f"--launch {','.join(args.launch)}: each of graph, isolated")
    args.m = args.m or ("1,16,64" if args.family == "gemm" else "1,8,64")
    t0 = time.time()
    import torch

    old = load_old(args.old_dir)
    trees = {name: load_old(folder, f"workbench_{name}") for name, folder in tree_dirs.items()}
    dev = timing.device()
    rows = {"gemm": ab_gemm, "moe": ab_moe, "host": ab_host}[args.family](args, torch, old, trees)
    meta = timing.meta(ROOT, dev, timing.ceilings(dev), {"old_dir": str(args.old_dir), "variants": args.variant,
                                                        "trees": {n: str(d) for n, d in tree_dirs.items()},
                                                        "launch": args.launch, "rounds": args.rounds,
                                                        "wall_s": round(time.time() - t0, 1)}, {})
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"ab_{args.family}.json"
    path.write_text(json.dumps({"schema": timing.SCHEMA, "family": f"ab_{args.family}", "meta": meta, "rows": rows},
                               indent=1) + "\n")
    print(f"wrote {path} ({len(rows)} rows)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
