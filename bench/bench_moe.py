"""MoE GEMM-phase speed on the lent GPU: the fused Marlin MoE kernel vs the batched path (one dense Marlin GEMM per
expert over streams) vs a loop of dense calls on one stream vs dequantize-and-matmul in PyTorch, in one run.

    python bench/bench_moe.py --out DIR [--quick] [--m 1,8] [--paths fused,batched]
    python bench/bench_moe.py --out DIR --ab-old OLD [--m 1,8,64]   (A/B of the fused kernel against an older one)

Method
* One GEMM phase (gate_up-like: K -> N per expert) of u4b8 g128 fp16 experts: Mixtral-like (8 experts, K=4096,
  N=14336, top-2), DeepSeek-V2-Lite-like (64, K=2048, N=1408, top-6), DeepSeek-V3-like (256, K=7168, N=2048, top-8),
  at M = 1, 8, 64, 256 tokens with uniform random top-k routing (fixed seed).
* Weights are random words (speed does not depend on values; correctness is tests/gpu's job).
* L2 is flushed (a 512 MiB memset) before every timed call; each call is timed alone with device events around it
  (host launch gaps inside a path are part of that path's cost); the median of REPS calls is reported.
* Bytes touched = weights + scales of the experts that receive at least one token. Effective GB/s = those bytes /
  time; "% copy" compares it with a device-to-device copy (read + written bytes) measured in the same run.
* The fused path is also timed as bench_gemm times the dense GEMM ("fused graph"): a CUDA graph of
  LAUNCHES_PER_GRAPH calls, each on its own routing (drawn as above; at decode sizes each avoids the experts of the
  one before, so no call finds its weights in L2: rotated_routings), per call, without flushes; its bytes are the
  mean touched bytes of those routings. On sm_90 the phases launch programmatically (MoePolicy
  .programmatic_launch): each may start while the one before finishes; "fused graph plain" is the same graph of plain
  launches. "copy graph" is the copy ceiling at that size: device copies moving the same bytes (half read, half
  written), timed the same way (bench_gemm.time_copy_graph). The single-call times include what the memset leaves
  behind: L2 full of dirty lines that the call's own reads must write back first (bench/probe_moe_decode.py
  measures the difference).
* The fused time covers the GEMM launch only; moe_align_block_size is timed separately, three ways: "align CUDA µs"
  is the CUDA C++ kernel that fused_moe launches (``workbench.moe.moe_align_block_size``, ``mwb::moe_align``), device
  time only (the GPU spins SPIN_US ahead of the start event while the host queues the call, as in the A/B mode);
  "align CUDA call µs" is the same wrapper timed as a direct caller sees it (events around the call on an idle GPU:
  its host-side checks and output allocation included; a planned fused_moe call skips both); "align Numba call µs"
  is the Numba ``kernels_numba.moe_align.moe_align_block_size`` timed the same way (host-dispatch bound; kept for
  comparison, fused_moe does not use it).
Writes DIR/moe_<gpu>.json and DIR/moe_<gpu>.md.

A/B mode (--ab-old OLD): OLD holds a previous commit's workbench/moe.py and kernels_cuda/{marlin_moe.cu, *.cuh}
(``git show REV:path > OLD/name``), loaded as a second module with its own kernels. The fused GEMM phase is timed as
above (L2 flush, events, median) for the variants, interleaved call by call on the same inputs: "old" (OLD), "new"
(as checked out, automatic CTAs-per-SM choice), and each of --variants whose kernel differs from new's in that cell
("new-b1" / "new-b2": forced one / two CTAs per SM; "new-noswap": moe_block_size 8 without the operand swap;
"new-s3" / "new-s4": one-CTA kernels with 3 / 4 stages first). Every
variant is warmed first; the call order rotates from round to round; before each timed call the GPU spins (SPIN_US)
so that the events bracket device work only, not the call's host side (round 3 showed host time leaking into some
calls: one config timed 25 and 44 us). Reports the median with the interquartile range. Records whether each
variant's output is bitwise equal to old's and max |variant - old| / max |old|. Each variant is also timed as the
table's "fused graph" (graph_us: --graph-rounds interleaved rounds on the same rotated routings, median), the bar's
method. Writes DIR/ab_moe.json and prints a table.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # bench_gemm, when imported from elsewhere

from bench_gemm import PLAIN_MOE_POLICY, l2_bytes, time_copy_graph, time_cupy_graph  # noqa: E402
from workbench.policy import DEFAULT_MOE_POLICY  # noqa: E402
from workbench import gemm, moe  # noqa: E402
from workbench.formats.moe_align import moe_align_block_size as align_ref  # noqa: E402
from workbench.scalar_types import ScalarType as S  # noqa: E402
from workbench.weight import MarlinWeight  # noqa: E402

CONFIGS = (  # (name, experts, K, N, top_k)
    ("mixtral", 8, 4096, 14336, 2),
    ("dsv2-lite", 64, 2048, 1408, 6),
    ("dsv3", 256, 7168, 2048, 8),
)
M_VALUES = (1, 8, 64, 256)
GROUP = 128
REPS = 7
LAUNCHES_PER_GRAPH = 20  # calls per graph in the "fused graph" timing (bench_gemm's)
FLUSH_BYTES = 512 << 20


def copy_bandwidth(cp) -> float:
    """GB/s of a 1 GiB device-to-device copy, counting bytes read + written."""
    n = 1 << 30
    src, dst = cp.empty(n, dtype=np.uint8), cp.empty(n, dtype=np.uint8)
    src.fill(1)
    cp.cuda.runtime.memcpy(dst.data.ptr, src.data.ptr, n, cp.cuda.runtime.memcpyDeviceToDevice)
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    for _ in range(10):
        cp.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, n, cp.cuda.runtime.memcpyDeviceToDevice, 0)
    stop.record()
    stop.synchronize()
    return 2 * n / (cp.cuda.get_elapsed_time(start, stop) / 1e3 / 10) / 1e9


def random_stack(cp, e, k, n, act=np.float16) -> MarlinWeight:
    """A u4b8 g128 stack of random words on the GPU (timing only)."""
    words = cp.random.randint(-(2 ** 31), 2 ** 31 - 1, size=(e, k // 16, n * 2), dtype=np.int64).astype(np.int32)
    scales = (cp.random.random((e, k // GROUP, n), dtype=np.float32) * 0.01 + 0.001).astype(act)
    return MarlinWeight(words, scales, None, None, None, k, n, GROUP, S.U4B8, np.dtype(act), num_experts=e)


def touched_bytes(experts: int, k: int, n: int) -> int:
    return experts * (k * n // 2 + (k // GROUP) * n * 2)


def rotated_routings(cp, rng, m: int, e: int, top_k: int, count: int):
    """``count`` routings of m tokens (distinct experts per token): [(sorted_ids, expert_ids, num_post) device
    arrays], [experts touched]. Where the previous routing touched at most a quarter of the experts (decode sizes),
    the next is drawn from the others, so that it finds none of its weights in L2; else from all (the same
    distribution as the single calls: a pool cut to the few experts left would touch fewer and change the work)."""
    out, touched, previous = [], [], set()
    for _ in range(count):
        pool = np.array([x for x in range(e) if x not in previous]) if 4 * len(previous) <= e else np.arange(e)
        ids = np.stack([rng.choice(pool, top_k, replace=False) for _ in range(m)]).astype(np.int32)
        previous = set(ids.reshape(-1).tolist())
        block = moe.choose_block_size(m, top_k, e)
        out.append(tuple(cp.asarray(x) for x in align_ref(ids, block, e)))
        touched.append(len(previous))
    return out, touched


def timed(cp, fn, flush, before_start=None, read_flush: bool = False, reps: int = REPS) -> float:
    """Median µs of fn() over ``reps`` calls, each after an L2 flush, each alone between two events. ``before_start``
    (a launch, e.g. a spin kernel) is queued after the flush and before the start event: while the GPU runs it the
    host queues the events and fn, so the events bracket fn's device work rather than its host side. The flush
    writes the buffer (the table's method: L2 left full of dirty lines), or reads it (``read_flush``: clean lines)."""
    fn()  # warm-up (compilation, allocator)
    cp.cuda.Device().synchronize()
    times = []
    for _ in range(reps):
        if read_flush:
            flush.sum(dtype=np.uint64)  # (reads every byte; the 0-d result is dropped)
        else:
            flush.fill(0)
        if before_start is not None:
            before_start()
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop) * 1e3)
    return float(np.median(times))


def table_lines(rows) -> list[str]:
    """The markdown table of the table mode's rows, one line per (config, M); a path not timed shows '—'.
    "align CUDA µs" is the CUDA C++ align fused_moe uses (device time); the two "call" columns include host time."""
    lines = ["| config | M | experts touched | block | fused µs | batched µs | dense loop µs | torch µs | fused GB/s "
             "| fused % copy | fused graph µs | fused graph % copy | fused graph plain µs | copy graph µs "
             "| copy graph % copy | align CUDA µs | align CUDA call µs | align Numba call µs |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    by = {}
    for r in rows:
        by.setdefault((r["config"], r["m"]), {})[r["method"]] = r
    for (cfg, m), d in by.items():
        any_row = next(iter(d.values()))
        f, g, c = d.get("fused", {}), d.get("fused graph", {}), d.get("copy graph", {})

        def us(method):
            return d[method]["us"] if method in d else "—"

        lines.append(f"| {cfg} (E={any_row['experts']}, K={any_row['k']}, N={any_row['n']}, top-{any_row['top_k']}) "
                     f"| {m} | {any_row['experts_touched']} | {any_row['moe_block_size']} | {us('fused')} | "
                     f"{us('batched')} | {us('dense loop')} | {us('torch dequant+matmul')} | {f.get('gbs', '—')} | "
                     f"{f.get('pct_copy', '—')} | {g.get('us', '—')} | {g.get('pct_copy', '—')} | "
                     f"{us('fused graph plain')} | {c.get('us', '—')} | {c.get('pct_copy', '—')} | "
                     f"{any_row['align_cuda_us']} | {any_row['align_cuda_call_us']} | "
                     f"{any_row['align_numba_call_us']} |")
    return lines


def load_old(old_dir: pathlib.Path):
    """OLD/moe.py as module ``moe_old``, compiling OLD/marlin_moe.cu with OLD's headers."""
    import importlib.util
    import re

    spec = importlib.util.spec_from_file_location("moe_old", old_dir / "moe.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["moe_old"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    if (old_dir / "gemm.py").exists():  # OLD's moe on OLD's gemm (it reaches into gemm's internals of its day)
        from ab_gemm import load_old as load_old_gemm

        mod.gemm = load_old_gemm(old_dir, "gemm_old_for_moe")
    include = re.compile(r'^#include "([^"]+)"', re.M)

    def old_source() -> str:
        seen: set[str] = set()

        def expand(name: str) -> str:
            if name in seen:
                return ""
            seen.add(name)
            return include.sub(lambda m: expand(m.group(1)), (old_dir / name).read_text())

        return expand(mod.MOE_KERNEL_SOURCE).replace("#pragma once", "")

    mod.moe_kernel_source = old_source
    return mod


# A/B timing: each variant warmed WARM_CALLS times; before each timed call the GPU spins SPIN_US (one thread) while
# the host queues the flush, the events and the call
WARM_CALLS = 3
GRAPH_ROUNDS = 3  # A/B mode: graph timings per variant and cell, interleaved
SPIN_US = 1000
SPIN_SOURCE = r"""
extern "C" __global__ void spin(long long cycles) {
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
}
"""

# A/B variants of the checked-out module, as MoePolicy values (workbench.policy): forced CTAs per SM, the operand
# swap off, another one-CTA stage order
_NEW = DEFAULT_MOE_POLICY
AB_VARIANTS = {"new": _NEW, "new-b1": dataclasses.replace(_NEW, blocks_per_sm=1),
               "new-b2": dataclasses.replace(_NEW, blocks_per_sm=2),
               "new-noswap": dataclasses.replace(_NEW, swap_max_block=0),
               "new-s3": dataclasses.replace(_NEW, one_block_stages=(3, 4, 6, 8)),
               "new-s4": dataclasses.replace(_NEW, one_block_stages=(4, 3, 6, 8))}


def _policy_kw(v: str) -> dict:
    """The policy keyword of a variant's calls (none for OLD, a tree that may predate policies)."""
    return {} if v == "old" else {"policy": AB_VARIANTS[v]}


def ab_main(args) -> int:
    import concurrent.futures
    import time

    import cupy as cp

    from workbench.formats.moe_align import aligned_capacity

    unknown = sorted(set(args.variants.split(",")) - set(AB_VARIANTS) - {"old", ""})
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; known: {sorted(AB_VARIANTS)}")
    old = load_old(args.ab_old)
    assert old.moe_kernel_source() != moe.moe_kernel_source() or \
        (pathlib.Path(args.ab_old) / "moe.py").read_text() != pathlib.Path(moe.__file__).read_text(), \
        "OLD is the checked-out kernel and module"
    spin = cp.RawKernel(SPIN_SOURCE, "spin")
    spin_cycles = SPIN_US * 2100  # cycles at 2.1 GHz (above an H100/H200's SM clock): at least SPIN_US
    args.out.mkdir(parents=True, exist_ok=True)
    device = cp.cuda.Device().id
    gpu_props = cp.cuda.runtime.getDeviceProperties(device)
    gpu = gpu_props["name"].decode() if isinstance(gpu_props["name"], bytes) else str(gpu_props["name"])
    copy_gbs = copy_bandwidth(cp)
    print(f"{gpu}: {gpu_props['multiProcessorCount']} SMs, copy {copy_gbs:.0f} GB/s", flush=True)
    flush = cp.empty(FLUSH_BYTES, dtype=np.uint8)
    rng = np.random.default_rng(0)
    graph_rng = np.random.default_rng(1)  # (its own stream: the single calls' routings stay those of earlier runs)
    m_values = tuple(int(x) for x in args.m.split(","))
    _, sms, smem, sm_smem = gemm.device_properties(device)

    def cfg_of(variant, block, n, k, items):
        if variant == "old":
            return old.choose_moe_config(S.F16, S.U4B8, block, n, k, GROUP, items, sms, smem)
        return moe.choose_moe_config(S.F16, S.U4B8, block, n, k, GROUP, items, sms, smem, sm_smem,
                                     policy=AB_VARIANTS[variant])

    def variants_of(block, n, k, items):
        """old, new, and each other requested variant whose kernel differs from new's in this cell."""
        out = ["old", "new"]
        for v in filter(None, args.variants.split(",")):  # (--variants "": old and new only)
            if v not in out and cfg_of(v, block, n, k, items) != cfg_of("new", block, n, k, items):
                out.append(v)
        return out

    # compile every instantiation of both versions first, in threads
    t0 = time.time()
    todo = set()
    for name, e, k, n, top_k in CONFIGS:
        for m in m_values:
            block = moe.choose_block_size(m, top_k, e)
            items = min(aligned_capacity(m * top_k, block, e) // block, m * top_k)
            for v in variants_of(block, n, k, items):
                c = cfg_of(v, block, n, k, items)
                todo.add((old if v == "old" else moe, c.name_expression, c.smem_bytes))
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        for job in [pool.submit(mod.get_moe_kernel, nm, device, sm) for mod, nm, sm in todo]:
            job.result()
    print(f"compiled {len(todo)} instantiations in {time.time() - t0:.0f} s", flush=True)

    rows = []
    for name, e, k, n, top_k in CONFIGS:
        w = random_stack(cp, e, k, n)
        stacks = {"old": old.MarlinExpertStack(w), "new": moe.MarlinExpertStack(w)}
        for m in m_values:
            ids = np.stack([rng.choice(e, top_k, replace=False) for _ in range(m)]).astype(np.int32)
            weights = cp.asarray(rng.uniform(0.05, 1.0, (m, top_k)).astype(np.float32))
            nbytes = touched_bytes(len(np.unique(ids)), k, n)
            a = cp.asarray(rng.standard_normal((m, k), dtype=np.float32).astype(np.float16))
            block = moe.choose_block_size(m, top_k, e)
            sorted_ids, expert_ids, post = (cp.asarray(x) for x in align_ref(ids, block, e))
            items = min(int(expert_ids.size), m * top_k)
            variants = variants_of(block, n, k, items)
            outs = {v: cp.full((m * top_k, n), np.nan, dtype=np.float16) for v in variants}

            def call(v):
                stack = stacks["old" if v == "old" else "new"]
                stack.gemm_phase_fused(a, sorted_ids, expert_ids, post, outs[v], m, block, top_k,
                                       topk_weights=weights, **_policy_kw(v))

            times = {v: [] for v in variants}
            host_us = []
            for _ in range(WARM_CALLS):  # every variant warm (compiled, plans cached, clocks up) before any timing
                for v in variants:
                    call(v)
            cp.cuda.Device().synchronize()
            for rep in range(args.reps):
                # interleaved call by call, in an order that rotates (and reverses every other round), so that no
                # variant always follows the same one
                order = variants[rep % len(variants):] + variants[:rep % len(variants)]
                for v in (order if rep % 2 == 0 else order[::-1]):
                    # The GPU spins first, so everything after it (flush, start event, the call's host work, stop
                    # event) is queued before the start event runs: the events then bracket device work only. Without
                    # it, a call whose host side outlasts the flush had that host time counted (round 3's outliers).
                    t0 = time.perf_counter()
                    spin((1,), (1,), (np.int64(spin_cycles),))
                    flush.fill(0)
                    start, stop = cp.cuda.Event(), cp.cuda.Event()
                    start.record()
                    call(v)
                    stop.record()
                    host_us.append((time.perf_counter() - t0) * 1e6)
                    stop.synchronize()
                    times[v].append(cp.cuda.get_elapsed_time(start, stop) * 1e3)
            covered = max(host_us) < SPIN_US
            if not covered:
                print(f"WARNING {name} M={m}: host enqueue took up to {max(host_us):.0f} us, longer than the "
                      f"{SPIN_US} us spin: host time may be in these numbers", flush=True)
            # The bar's timing too: each variant in a CUDA graph of LAUNCHES_PER_GRAPH phases on the same rotated
            # routings (as the table's "fused graph"), --graph-rounds rounds interleaved, the median per variant.
            routings, touched = rotated_routings(cp, graph_rng, m, e, top_k, LAUNCHES_PER_GRAPH)
            graph_bytes = float(np.mean([touched_bytes(t, k, n) for t in touched]))
            graph_out = cp.empty((m * top_k, n), dtype=np.float16)
            graph_times = {v: [] for v in variants}
            for rnd in range(args.graph_rounds):
                for v in (variants if rnd % 2 == 0 else variants[::-1]):
                    stack = stacks["old" if v == "old" else "new"]
                    phases = [lambda st, r=r, stack=stack, kw=_policy_kw(v): stack.gemm_phase_fused(
                        a, *r, graph_out, m, block, top_k, topk_weights=weights, stream=st, **kw) for r in routings]
                    graph_times[v].append(time_cupy_graph(cp, phases))
            ref_raw = cp.asnumpy(outs["old"])
            ref = ref_raw.astype(np.float32)
            scale = float(np.nanmax(np.abs(ref))) or 1.0
            for v in variants:
                us = float(np.median(times[v]))
                q25, q75 = (float(x) for x in np.percentile(times[v], (25, 75)))
                raw = cp.asnumpy(outs[v])
                got = raw.astype(np.float32)
                same = bool(np.array_equal(raw.view(np.uint16), ref_raw.view(np.uint16)))
                diff = float(np.nanmax(np.abs(got - ref))) / scale if np.array_equal(np.isnan(got), np.isnan(ref)) \
                    else float("inf")
                gbs = nbytes / (us * 1e-6) / 1e9
                graph_us = float(np.median(graph_times[v]))
                # what the call launched
                fused_grid = old._fused_grid if v == "old" else moe.fused.fused_grid
                old_policy = [old._default()] if hasattr(old, "_default") else []  # (a tree with policies)
                c, grid, _ = fused_grid(
                    stacks["old" if v == "old" else "new"], device, S.F16, block, m * top_k, int(sorted_ids.size),
                    GROUP, *(old_policy if v == "old" else [AB_VARIANTS[v]]))
                row = dict(gpu=gpu, config=name, experts=e, k=k, n=n, top_k=top_k, m=m, moe_block_size=block,
                           variant=v, us=round(us, 2), us_min=round(float(np.min(times[v])), 2),
                           us_q25=round(q25, 2), us_q75=round(q75, 2), us_max=round(float(np.max(times[v])), 2),
                           host_covered=covered, gbs=round(gbs, 1),
                           pct_copy=round(100 * gbs / copy_gbs, 1), rel_diff_vs_old=diff, bits_equal_old=same,
                           graph_us=round(graph_us, 2),
                           graph_pct_copy=round(100 * graph_bytes / (graph_us * 1e-6) / 1e9 / copy_gbs, 1),
                           shape=f"bn{c.block_n},bk{c.block_k},st{c.stages},b{c.blocks_per_sm}"
                                 + ("s" if c.swap else "") + f",g{grid}")
                rows.append(row)
                print(f"{name:10s} M={m:4d} {v:10s} {us:9.2f} us [IQR {q25:.2f}-{q75:.2f}] {row['pct_copy']:5.1f}% "
                      f"copy {row['shape']:22s} bitwise equal to old: {same} (rel diff {diff:.1e}); graph "
                      f"{graph_us:.2f} us {row['graph_pct_copy']:.1f}%", flush=True)
            (args.out / "ab_moe.json").write_text(json.dumps(dict(gpu=gpu, copy_gbs=round(copy_gbs, 1),
                                                                  reps=args.reps, rows=rows), indent=1))
        del w, stacks
        cp.get_default_memory_pool().free_all_blocks()
    others = [v for v in args.variants.split(",") if v not in ("old", "new", "")]
    print("\n| config | M | block | old µs | new µs | old/new | old graph µs | new graph µs | graph old/new | "
          + "".join(f"{v} µs | " for v in others) + "new shape | bits = old |")
    print("|---|---|---|---|---|---|---|---|---|" + "---|" * len(others) + "---|---|")
    by = {}
    for r in rows:
        by.setdefault((r["config"], r["m"]), {})[r["variant"]] = r
    for (cfg, m), d in by.items():
        equal = ", ".join(v for v, r in d.items() if v != "old" and not r["bits_equal_old"]) or "all"
        print(f"| {cfg} | {m} | {d['old']['moe_block_size']} | {d['old']['us']} | {d['new']['us']} | "
              f"{d['old']['us'] / d['new']['us']:.3f} | {d['old']['graph_us']} | {d['new']['graph_us']} | "
              f"{d['old']['graph_us'] / d['new']['graph_us']:.3f} | "
              + "".join(f"{d.get(v, {}).get('us', '—')} | " for v in others)
              + f"{d['new']['shape']} | {'all' if equal == 'all' else 'not: ' + equal} |")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=pathlib.Path)
    parser.add_argument("--quick", action="store_true", help="first config, M = 1 and 64 only")
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--ab-old", type=pathlib.Path, help="A/B mode: directory of the old moe.py + kernels")
    parser.add_argument("--m", default=None, help="token counts, comma list (default: 1,8,64,256; A/B mode 1,8,64)")
    parser.add_argument("--paths", default=None,
                        help="table mode: the GEMM paths to time, comma list of fused, batched, dense loop, torch "
                             "(default all; the align columns are always timed; 'align' alone: only them)")
    parser.add_argument("--reps", type=int, default=11, help="A/B mode: timed calls per variant and cell")
    parser.add_argument("--graph-rounds", type=int, default=GRAPH_ROUNDS,
                        help="A/B mode: graph timings per variant and cell, interleaved (the median is reported)")
    parser.add_argument("--variants", default="new-b1,new-b2",
                        help=f"A/B mode: variants besides old and new, of {sorted(AB_VARIANTS)}")
    args = parser.parse_args(argv)
    if args.ab_old is not None:
        if args.m is None:
            args.m = "1,8,64"
        return ab_main(args)
    import cupy as cp

    from kernels_numba.moe_align import moe_align_block_size as numba_align

    torch = None
    if not args.no_torch:
        try:
            import torch
        except ImportError:
            print("torch unavailable: no PyTorch baseline", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    gpu = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    copy_gbs = copy_bandwidth(cp)
    print(f"{gpu}: {props['multiProcessorCount']} SMs, copy {copy_gbs:.0f} GB/s", flush=True)
    flush = cp.empty(FLUSH_BYTES, dtype=np.uint8)
    l2 = l2_bytes(cp)
    rng = np.random.default_rng(0)
    rows = []
    configs = CONFIGS[:1] if args.quick else CONFIGS
    m_values = (1, 64) if args.quick else M_VALUES
    if args.m is not None:
        m_values = tuple(int(v) for v in args.m.split(","))
    wanted = None if args.paths is None else {p.strip() for p in args.paths.split(",")}
    spin = cp.RawKernel(SPIN_SOURCE, "spin")
    spin_cycles = np.int64(SPIN_US * 2100)  # at least SPIN_US at any SM clock up to 2.1 GHz
    # the weights only where a GEMM path is timed (--paths align: the align columns need none)
    need_weights = wanted is None or bool(wanted & {"fused", "batched", "dense", "dense loop", "torch"})
    for name, e, k, n, top_k in configs:
        w = random_stack(cp, e, k, n) if need_weights else None
        stack = moe.MarlinExpertStack(w) if need_weights else None
        t_scales = None
        if torch is not None and need_weights:
            t_words = torch.from_dlpack(w.qweight)  # (E, K/16, 2N) int32, read as GPTQ (E, K/8, N) words
            t_scales = torch.from_dlpack(w.scales)
            shifts = torch.arange(0, 32, 4, device="cuda", dtype=torch.int32).view(1, 8, 1)
        for m in m_values:
            ids = np.stack([rng.choice(e, top_k, replace=False) for _ in range(m)]).astype(np.int32)
            used = np.unique(ids)
            nbytes = touched_bytes(len(used), k, n)
            a = cp.asarray(rng.standard_normal((m, k), dtype=np.float32).astype(np.float16))
            block = moe.choose_block_size(m, top_k, e)
            sorted_ids, expert_ids, post = (cp.asarray(x) for x in align_ref(ids, block, e))
            out_fused = cp.empty((m * top_k, n), dtype=np.float16)
            order = np.argsort(ids.reshape(-1), kind="stable")
            a_sorted = cp.ascontiguousarray(a[cp.asarray(order // top_k)])
            dispatches, start = [], 0
            for x in used:
                c = int(np.sum(ids == x))
                dispatches.append((int(x), start, start, c))
                start += c
            out_rows = cp.empty((m * top_k, n), dtype=np.float16)
            experts = [w.expert(int(x)) for x in range(e)] if need_weights else []
            d_ids = cp.asarray(ids)

            def fused():
                stack.gemm_phase_fused(a, sorted_ids, expert_ids, post, out_fused, m, block, top_k)

            def batched():
                stack.gemm_phase_batched(a_sorted, dispatches, out_rows)

            def dense_loop():
                for x, r0, _, c in dispatches:
                    gemm.marlin_gemm(a_sorted[r0:r0 + c], experts[x], c=out_rows[r0:r0 + c])

            def align_cuda():
                moe.moe_align_block_size(d_ids, block, e)  # the kernel fused_moe launches (its plan: same kernel)

            def align_numba():
                numba_align(d_ids, block, e)

            paths = {"fused": fused, "batched": batched, "dense loop": dense_loop}
            if torch is not None and need_weights:
                t_a = torch.from_dlpack(a_sorted)

                def torch_dequant_matmul():
                    for x, r0, _, c in dispatches:
                        q = t_words[x].view(k // 8, n)
                        codes = ((q.unsqueeze(1) >> shifts) & 0xF).view(k, n)  # (K, N) 4-bit codes
                        wx = (codes.to(torch.float16) - 8) * t_scales[x].repeat_interleave(GROUP, dim=0)
                        torch.matmul(t_a[r0:r0 + c], wx)

                paths["torch dequant+matmul"] = torch_dequant_matmul
            if wanted is not None:
                paths = {k_: v for k_, v in paths.items() if k_ in wanted or k_.split()[0] in wanted}
            align = dict(align_cuda_us=timed(cp, align_cuda, flush, lambda: spin((1,), (1,), (spin_cycles,))),
                         align_cuda_call_us=timed(cp, align_cuda, flush),
                         align_numba_call_us=timed(cp, align_numba, flush))
            if not paths:  # --paths align: the align columns alone, one row per cell
                rows.append(dict(gpu=gpu, config=name, experts=e, k=k, n=n, top_k=top_k, m=m,
                                 experts_touched=int(len(used)), moe_block_size=block, method="align only",
                                 **{k_: round(v, 2) for k_, v in align.items()}))
                print(f"{name:10s} M={m:4d} align CUDA {align['align_cuda_us']:.1f} us (device), call "
                      f"{align['align_cuda_call_us']:.1f} us; Numba call {align['align_numba_call_us']:.1f} us",
                      flush=True)
            timings = {method: (timed(cp, fn, flush), nbytes) for method, fn in paths.items()}
            if "fused" in paths:
                routings, touched = rotated_routings(cp, rng, m, e, top_k, LAUNCHES_PER_GRAPH)
                def phases(policy=DEFAULT_MOE_POLICY):
                    return [lambda s, r=r: stack.gemm_phase_fused(a, *r, out_fused, m, block, top_k, stream=s,
                                                                  policy=policy) for r in routings]
                graph_bytes = float(np.mean([touched_bytes(t, k, n) for t in touched]))
                timings["fused graph"] = (time_cupy_graph(cp, phases()), graph_bytes)
                if gemm.programmatic_launches(cp.cuda.Device().id):  # (the gain needs the kernel before to trigger)
                    timings["fused graph plain"] = (time_cupy_graph(cp, phases(PLAIN_MOE_POLICY)), graph_bytes)
                timings["copy graph"] = (time_copy_graph(cp, int(graph_bytes), l2), graph_bytes)
            for method, (us, nbytes) in timings.items():
                gbs = nbytes / (us * 1e-6) / 1e9
                row = dict(gpu=gpu, config=name, experts=e, k=k, n=n, top_k=top_k, m=m, experts_touched=int(len(used)),
                           moe_block_size=block, method=method, us=round(us, 2), gbs=round(gbs, 1),
                           pct_copy=round(100 * gbs / copy_gbs, 1), **{k_: round(v, 2) for k_, v in align.items()})
                rows.append(row)
                print(f"{name:10s} M={m:4d} touched={len(used):3d} {method:22s} {us:10.1f} us {gbs:7.0f} GB/s "
                      f"{row['pct_copy']:5.1f}% copy", flush=True)
        del w, stack
        cp.get_default_memory_pool().free_all_blocks()

    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    tag = gpu.replace(" ", "_")
    (args.out / f"moe_{tag}.json").write_text(json.dumps(dict(gpu=gpu, copy_gbs=round(copy_gbs, 1), date=stamp,
                                                              reps=REPS, rows=rows), indent=1))
    lines = [f"GPU: {gpu}; device copy {copy_gbs:.0f} GB/s (read + write); u4b8 g128 fp16 experts; median of {REPS} "
             f"calls after an L2 flush; {stamp}", "",
             ] + table_lines(rows)
    (args.out / f"moe_{tag}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
