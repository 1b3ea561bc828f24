"""Which (kernel configuration, grid) is fastest for the Marlin GEMM where it is furthest from its bars: times every
feasible configuration and a few grid sizes per cell, beside today's automatic choice (issue #4).

    python bench/sweep_gemm.py --out DIR [--budget-s 140] [--workers 16] [--cells all|quick|INDEX,...]
                               [--kernel-dir DIR]     # e.g. a copy of HEAD's kernels_cuda/ sources
    python bench/sweep_gemm.py --list [--cells ...]       # the cells and candidates, no GPU needed
    python bench/sweep_gemm.py --selfcheck [--workers 8]   # forced configs / grids vs the NumPy reference (GPU)

Candidates per cell (K x N layer, M, weight type; fp32 reduction, the default mode):
* every thread shape of ``gemm._THREAD_SHAPES`` that divides K, N and the group size (or is divided by it),
  x one block per SM with stages 8 / 6 / 4 / 3, or two blocks per SM (16-row tiles only) with stages 4 / 3, where the
  shared memory fits (the kernel's static_asserts: two blocks only with M_BLOCKS = 1), x operand swap on / off
  (M <= 8; M = 9..16: the swap's 16-row form, printed s2);
* x grids: today's policy (``grid_blocks``), the striped grid at sms x blocks per SM and (two blocks) at 1 x sms,
  the slice-aligned grid even where the policy rejects it, and two smaller ones (the aligned grid with half the
  splits per slice, the striped grid at 3/4); every block is resident (``prepare_launch`` refuses otherwise).
Forced through ``gemm.prepare_launch(record, config=, grid=)`` (internal hook; the public API is unchanged).

Method as bench/bench_gemm.py: a CUDA graph of 20 launches over weight copies rotated through > 3 x L2, device
events; here the median of 5 graph replays (each replay timed alone). Correctness first: each candidate runs once into
a NaN-poisoned C and must be finite and within tests/gpu's fp32 bound |C - ref| <= (u + K 2^-22) |a| @ |W| of the
fp32 reference a @ W (W = the dequantized weight, read back exactly through identity activations — checked against
the NumPy reference by bench/device_runs/gpu_r6_sweep.sh's test phase); a candidate that fails is never ranked.
Today's default is timed first and last in each cell (the spread of the two is the cell's noise).

Compilation runs in a thread pool (``--workers``) in cell order while earlier cells are being timed; the run stops
cleanly at ``--budget-s`` with every finished cell written: DIR/sweep_<gpu>.json and DIR/sweep_<gpu>.md after each
cell.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import pathlib
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from bench_gemm import L2_MULTIPLE, LAUNCHES_PER_GRAPH, REPLAYS, weight_bytes  # noqa: E402  (the bench's method)
from workbench import gemm  # noqa: E402
from workbench.scalar_types import ScalarType as S  # noqa: E402

ONE_BLOCK_STAGES = (8, 6, 4, 3)  # the stage lists choose_config picks from (m_blocks <= 2 / two blocks per SM)
TWO_BLOCK_STAGES = (4, 3)
LARGE_M_STAGES = (4, 3)


@dataclasses.dataclass(frozen=True)
class Cell:
    weight: S
    group_size: int
    act: str  # "float16" / "bfloat16"
    k: int
    n: int
    m: int

    @property
    def label(self) -> str:
        g = "chan" if self.group_size == -1 else f"g{self.group_size}"
        return f"{self.weight} {g} {'fp16' if self.act == 'float16' else 'bf16'} {self.k}x{self.n} M={self.m}"


def _cells() -> list[Cell]:
    """In order of importance (the run may stop at its budget): 4096^2 and 8192^2 u4b8 M = 1, FP8, the rest."""
    u4 = lambda k, n, m: Cell(S.U4B8, 128, "float16", k, n, m)  # noqa: E731
    fp8 = lambda k, n, m: Cell(S.FE4M3FN, -1, "float16", k, n, m)  # noqa: E731
    u8 = lambda k, n, m: Cell(S.U8B128, 128, "float16", k, n, m)  # noqa: E731
    cells = [u4(4096, 4096, 1), u4(8192, 8192, 1)]
    cells += [fp8(8192, 8192, 1), fp8(8192, 28672, 1), fp8(8192, 8192, 16), fp8(8192, 28672, 16)]
    cells += [u4(4096, 14336, 1), u4(14336, 4096, 1)]
    cells += [u4(k, n, m) for m in (2, 8, 16) for k, n in ((4096, 4096), (8192, 8192), (4096, 14336), (14336, 4096))]
    cells += [u8(8192, 8192, 1), u8(8192, 28672, 1), u8(8192, 8192, 16), u8(8192, 28672, 16)]
    # the two large u4b8 layers (two blocks per SM at M <= 16 today), last: HEAD's run had not swept them
    cells += [u4(k, n, m) for m in (1, 16) for k, n in ((8192, 28672), (28672, 8192))]
    # FP8 on the 4096-wide layers (its x1.6 bar is open there), appended so that earlier indices keep their cells
    cells += [fp8(k, n, 1) for k, n in ((4096, 4096), (4096, 14336), (14336, 4096))]
    # FP8 4096x14336 at M = 16: the one cell where FP8 still misses x1.6 with programmatic launches (round 12)
    cells += [fp8(4096, 14336, 16)]
    # M = 32 / 64 (two and four m16 blocks; round 18: only the policy's tiles had run there), appended last
    cells += [u4(k, n, m) for m in (32, 64) for k, n in ((4096, 4096), (14336, 4096), (8192, 8192), (4096, 14336))]
    return cells


CELLS = _cells()
QUICK_CELLS = CELLS[:3]


@dataclasses.dataclass(frozen=True)
class Candidate:
    cfg: gemm.KernelConfig
    grid: int
    grid_kinds: tuple[str, ...]  # how the grid was derived (policy, striped, aligned, ...)
    variant: str  # "shape" (the factorial set), "swap-flip"
    is_default: bool = False

    @property
    def config_text(self) -> str:
        return config_text(self.cfg)


def swap_text(cfg) -> str:
    """The swap suffix of a configuration's text: "" (row layout), "s" (8 rows), "s2" (16 rows)."""
    swap = int(getattr(cfg, "swap", 0))
    return "s" * (swap > 0) + ("2" if swap == 2 else "")


def config_text(cfg: gemm.KernelConfig) -> str:
    """(n_tiles, k_warp, stages, blocks per SM), s = swap (s2: its 16-row form) and cN = clusters of N blocks, as
    bench/ab_gemm.py writes it."""
    return (f"{cfg.n_tiles},{cfg.k_warp},{cfg.stages},b{cfg.blocks_per_sm}" + swap_text(cfg)
            + (f"c{cfg.cluster}" if cfg.cluster > 1 else ""))


def act_type(act: str) -> S:
    return S.F16 if act == "float16" else S.BF16


def group_mode(cell: Cell) -> int:
    return gemm.GROUP_CHANNELWISE if cell.group_size == -1 else gemm.GROUP_GROUPED


def default_config(cell: Cell, sms: int, smem_limit: int, sm_smem: int, compute_capability: int = 90
                   ) -> gemm.KernelConfig:
    """What the library launches for the cell (default fp32 reduction) on a GPU of these limits."""
    pairs = gemm.pairs_possible(compute_capability, True)
    return gemm.choose_config(act_type(cell.act), cell.weight, cell.m, cell.n, cell.k, cell.group_size, False,
                              smem_limit, sm_smem=sm_smem, sms=sms, pairs=pairs)


def shape_configs(cell: Cell, smem_limit: int, sm_smem: int, swap: bool) -> list[gemm.KernelConfig]:
    """Every thread shape x (blocks per SM, stages) that builds for this problem and fits shared memory."""
    m_blocks = min(4, max(1, math.ceil(cell.m / 16)))
    out = []
    for (n_tiles, k_warp), (tk, tn) in gemm.thread_shapes().items():
        if cell.k % tk or cell.n % tn:
            continue
        if cell.group_size > 0 and cell.group_size % tk and tk % cell.group_size:
            continue
        for bps in (1, 2):
            if bps == 2 and m_blocks != 1:  # static_assert in marlin_gemm: two blocks only with 16-row tiles
                continue
            if bps == 2:
                stages, limit = TWO_BLOCK_STAGES, gemm.two_block_smem(smem_limit, sm_smem)
            else:
                stages, limit = (ONE_BLOCK_STAGES if m_blocks <= 2 else LARGE_M_STAGES), smem_limit
            for st in stages:
                cfg = gemm.KernelConfig(act_type(cell.act), cell.weight, m_blocks, n_tiles, k_warp, st,
                                        group_mode(cell), blocks_per_sm=bps, swap=swap)
                if cfg.smem_bytes <= limit:
                    out.append(cfg)
    return out


def geometry(cfg: gemm.KernelConfig, m: int, n: int, k: int) -> tuple[int, int, int]:
    """(slices, KI, iterations) of the kernel's linear (slice, k step) range."""
    slices = math.ceil(m / cfg.block_m) * (n // cfg.block_n)
    ki = k // cfg.block_k
    return slices, ki, slices * ki


def grid_options(cfg: gemm.KernelConfig, m: int, n: int, k: int, sms: int, policy_grid: int | None = None
                 ) -> list[tuple[int, tuple[str, ...]]]:
    """(grid, kinds) per distinct block count, today's policy first. All <= sms x blocks per SM (resident).
    ``policy_grid``: the library's grid where it is not grid_blocks(cfg) (a pair choice: choose_config set cluster)."""
    slices, ki, iterations = geometry(cfg, m, n, k)
    most = min(iterations, sms * cfg.blocks_per_sm)
    options: dict[int, list[str]] = {}

    def add(grid, kind):
        if 1 <= grid <= most:
            options.setdefault(int(grid), []).append(kind)

    add(gemm.grid_blocks(cfg, m, n, k, sms) if policy_grid is None else policy_grid, "policy")
    add(most, "striped")
    if cfg.blocks_per_sm == 2:
        add(min(sms, iterations), "striped-1x")
    if slices <= most:
        splits = min(ki, most // slices)
        add(slices * splits, "aligned")
        if splits >= 2:
            add(slices * (splits // 2), "aligned-half")
    add((3 * most) // 4, "striped-3/4")
    return [(g, tuple(kinds)) for g, kinds in options.items()]


def candidates(cell: Cell, sms: int, smem_limit: int, sm_smem: int, compute_capability: int = 90,
               near_default: bool = False, thread_shapes: frozenset | None = None) -> list[Candidate]:
    """The sweep set of one cell, today's (configuration, grid) first and marked is_default. A grid that
    takes thread-block clusters on ``compute_capability`` (any size the kernel has, gemm.KERNEL_CLUSTER_SIZES) is timed
    with and without them. ``near_default``: only the default's thread shape, blocks per SM and swap (stages and
    grids vary). ``thread_shapes``: only these (n_tiles, k_warp) besides the default."""
    m, n, k = cell.m, cell.n, cell.k
    default = default_config(cell, sms, smem_limit, sm_smem, compute_capability)
    default_grid = gemm.grid_blocks(default, m, n, k, sms)
    default = dataclasses.replace(default, cluster=gemm.cluster_blocks(default, m, n, k, default_grid,
                                                                       compute_capability, True))
    out: list[Candidate] = []
    seen: set[tuple[str, int]] = set()

    plain_default = dataclasses.replace(default, cluster=1)

    def add(cfg, variant):
        cfg = dataclasses.replace(cfg, cluster=1)
        for grid, kinds in grid_options(cfg, m, n, k, sms, default_grid if cfg == plain_default else None):
            cluster = gemm.cluster_blocks(cfg, m, n, k, grid, compute_capability, True, enabled=True,
                                          sizes=gemm.KERNEL_CLUSTER_SIZES)
            for c in ((dataclasses.replace(cfg, cluster=cluster), cfg) if cluster > 1 else (cfg,)):
                key = (c.name_expression, grid)
                if key not in seen:
                    seen.add(key)
                    out.append(Candidate(c, grid, kinds, variant, is_default=(c == default and grid == default_grid)))

    add(default, "shape")
    # the other loop layout where both run this M: rows <-> swapped (16-row form for M = 9..16)
    swaps = (default.swap, 0 if default.swap else 1) if default.m_blocks == 1 and m <= 8 else (default.swap,)
    for swap in swaps:
        for cfg in shape_configs(cell, smem_limit, sm_smem, swap):
            if near_default and (cfg.n_tiles, cfg.k_warp, cfg.blocks_per_sm, cfg.swap) != (
                    default.n_tiles, default.k_warp, default.blocks_per_sm, default.swap):
                continue
            if thread_shapes is not None and (cfg.n_tiles, cfg.k_warp) not in thread_shapes:
                continue
            add(cfg, "swap-flip" if swap != default.swap else "shape")
    out.sort(key=lambda c: not c.is_default)  # (stable) the default first
    assert out[0].is_default, "today's choice must be in the sweep set"
    return out


def cells_from_arg(text: str) -> list[Cell]:
    if text == "all":
        return list(CELLS)
    if text == "quick":
        return list(QUICK_CELLS)
    return [CELLS[int(i)] for i in text.split(",")]


# ---------------------------------------------------------------------------------------------------------------
# Results: JSON and the ranked table
# ---------------------------------------------------------------------------------------------------------------
def rank_rows(rows: list[dict]) -> list[dict]:
    """Timed, correct candidates, fastest first (failed or untimed ones are not ranked)."""
    good = [r for r in rows if r.get("ok") and r.get("us") is not None]
    return sorted(good, key=lambda r: r["us"])


def cell_table(cell_result: dict, top: int = 12) -> str:
    """Markdown: the fastest `top` candidates and today's default, µs, ratio to the default, % of copy."""
    rows = cell_result["candidates"]
    ranked = rank_rows(rows)
    default_us = cell_result.get("default_us")
    lines = [f"### {cell_result['label']}", "",
             f"default {cell_result['default_config']} grid {cell_result['default_grid']}: "
             + (f"{default_us:.2f} µs (first / last timing {cell_result['default_us_first']:.2f} / "
                f"{cell_result['default_us_last']:.2f})" if default_us else "not timed")
             + f"; {len(ranked)} of {len(rows)} candidates timed and correct"
             + (f", {sum(1 for r in rows if r.get('ok') is False)} WRONG" if any(r.get('ok') is False for r in rows)
                else "")
             + ("" if cell_result.get("complete", True) else " (INCOMPLETE: budget reached)"), "",
             "| rank | config | thread k×n | grid (kind) | µs | ÷ default | % copy | variant |",
             "|---|---|---|---|---|---|---|---|"]
    shown = ranked[:top] + [r for r in ranked[top:] if r.get("is_default")]
    for r in shown:
        rank = ranked.index(r) + 1
        ratio = f"{r['us'] / default_us:.3f}" if default_us else "—"
        lines.append(f"| {rank}{' (default)' if r.get('is_default') else ''} | {r['config']} | "
                     f"{r['thread_k']}×{r['thread_n']} | {r['grid']} ({'/'.join(r['grid_kinds'])}) | {r['us']:.2f} | "
                     f"{ratio} | {r['pct_copy']:.0f} | {r['variant']} |")
    return "\n".join(lines) + "\n"


def summary_table(results: list[dict]) -> str:
    """One line per cell: default vs the fastest correct candidate."""
    lines = ["| cell | default (config, grid) | µs | best (config, grid) | µs | best ÷ default | % copy best |",
             "|---|---|---|---|---|---|---|"]
    for res in results:
        ranked = rank_rows(res["candidates"])
        d = res.get("default_us")
        if not ranked or not d:
            lines.append(f"| {res['label']} | {res['default_config']} {res['default_grid']} | — | — | — | — | — |")
            continue
        b = ranked[0]
        lines.append(f"| {res['label']}{'' if res.get('complete', True) else ' (incomplete)'} | "
                     f"{res['default_config']} {res['default_grid']} | {d:.2f} | {b['config']} {b['grid']} "
                     f"({'/'.join(b['grid_kinds'])}) | {b['us']:.2f} | {b['us'] / d:.3f} | {b['pct_copy']:.0f} |")
    return "\n".join(lines) + "\n"


def write_results(out: pathlib.Path, tag: str, meta: dict, results: list[dict]) -> None:
    """JSON + markdown, each written to a temporary name and renamed (never a half-written file)."""
    out.mkdir(parents=True, exist_ok=True)
    for name, text in ((f"sweep_{tag}.json", json.dumps(dict(meta=meta, cells=results), indent=1)),
                       (f"sweep_{tag}.md", f"{meta_line(meta)}\n\n{summary_table(results)}\n"
                        + "\n".join(cell_table(r) for r in results))):
        tmp = out / (name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, out / name)


def meta_line(meta: dict) -> str:
    return (f"GPU {meta.get('gpu')} ({meta.get('sms')} SMs), {meta.get('date')}, {meta.get('commit')}, copy "
            f"{meta.get('copy_gbs', 0):.0f} GB/s; median of {REPLAYS} replays of a {LAUNCHES_PER_GRAPH}-launch graph; "
            f"stopped: {meta.get('stopped')}")


def candidate_row(cand: Candidate, cell: Cell) -> dict:
    c = cand.cfg
    return dict(config=cand.config_text, name=c.name_expression, n_tiles=c.n_tiles, k_warp=c.k_warp,
                stages=c.stages, blocks_per_sm=c.blocks_per_sm, swap=c.swap,
                thread_k=c.block_k, thread_n=c.block_n, smem=c.smem_bytes, grid=cand.grid,
                grid_kinds=list(cand.grid_kinds), variant=cand.variant, is_default=cand.is_default,
                steps_per_block=math.ceil(geometry(c, cell.m, cell.n, cell.k)[2] / cand.grid))


# ---------------------------------------------------------------------------------------------------------------
# Device part
# ---------------------------------------------------------------------------------------------------------------
class Compiler:
    """Compiles the instantiations of all cells in a thread pool, in cell order, so that timing can start on the
    first cell while later cells still compile. ``wait(cfgs, deadline)`` -> {name: error or None}."""

    def __init__(self, configs, workers: int):
        from concurrent.futures import ThreadPoolExecutor

        self.pool = ThreadPoolExecutor(max_workers=workers)
        self.futures = {}
        for cfg in configs:
            if cfg.name_expression not in self.futures:
                self.futures[cfg.name_expression] = self.pool.submit(gemm.get_kernel, cfg.name_expression, 0,
                                                                     cfg.smem_bytes)

    def wait(self, configs, deadline: float) -> dict[str, str | None]:
        from concurrent.futures import TimeoutError as FutureTimeout

        errors = {}
        for cfg in configs:
            fut = self.futures[cfg.name_expression]
            try:
                fut.result(timeout=max(0.0, deadline - time.monotonic()))
                errors[cfg.name_expression] = None
            except FutureTimeout:
                errors[cfg.name_expression] = "not compiled within the budget"
            except Exception as exc:  # noqa: BLE001 - a configuration that does not build is a result
                errors[cfg.name_expression] = f"compile: {type(exc).__name__}: {str(exc)[-300:]}"
        return errors

    def pending(self) -> bool:
        return not all(f.done() for f in self.futures.values())

    def shutdown(self):
        self.pool.shutdown(wait=False, cancel_futures=True)


def make_record(gemm_abi, cell: Cell, a, w, c, c_tmp, workspace, stream_ptr: int, sms: int):
    """The seed-ABI record of one launch (what gptq_marlin_gemm builds after its checks)."""
    return gemm_abi.MarlinMmRequest(
        weight_type=cell.weight, act_type=act_type(cell.act),
        buffers=gemm_abi.MarlinMmBuffers(a=a.data.ptr, b=w.qweight.data.ptr, c=c.data.ptr, c_tmp=c_tmp.data.ptr,
                                         b_scales=w.scales.data.ptr, workspace=workspace.data.ptr,
                                         zero_points=0 if w.zeros is None else w.zeros.data.ptr),
        problem=gemm_abi.MarlinMmProblem(m=cell.m, n=cell.n, k=cell.k, lda=cell.k, num_groups=w.scales.shape[0],
                                         group_size=cell.group_size),
        execution=gemm_abi.MarlinMmExecution(stream=stream_ptr, sms=sms)).into_launch()


_spin_kernel = None
SPIN_US = 3000  # while compile threads run: covers a host stall (GIL, scheduler) between the enqueues below


def spin(cp, stream, us: int) -> None:
    """Keep the stream busy for `us` µs (one thread polling %globaltimer), so that the graph replays and events
    enqueued behind it are all queued before the GPU reaches them: a host stall cannot open a gap between two
    timing events."""
    global _spin_kernel
    if _spin_kernel is None:
        _spin_kernel = cp.RawKernel(r"""
extern "C" __global__ void sweep_spin(unsigned long long ns) {
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}""", "sweep_spin")
    _spin_kernel((1,), (1,), (np.uint64(us * 1000),), stream=stream)


def time_graph(cp, launch_fns, stream, spin_us: int = 0) -> list[float]:
    """µs per launch of each of REPLAYS replays of one captured graph of `launch_fns` (callables, no argument)."""
    with stream:
        for f in launch_fns[:2]:
            f()
        stream.begin_capture()
        for f in launch_fns:
            f()
        graph = stream.end_capture()
        if spin_us:
            spin(cp, stream, spin_us)
        graph.launch(stream)
        events = [cp.cuda.Event() for _ in range(REPLAYS + 1)]
        events[0].record(stream)
        for i in range(REPLAYS):
            graph.launch(stream)
            events[i + 1].record(stream)
        events[-1].synchronize()
    return [cp.cuda.get_elapsed_time(events[i], events[i + 1]) * 1e3 / len(launch_fns) for i in range(REPLAYS)]


def run(args) -> int:
    import cupy as cp
    import ml_dtypes

    from bench_gemm import copies_for, copy_bandwidth, l2_bytes, random_weight
    from workbench import gemm_abi

    t0 = time.monotonic()
    deadline = t0 + args.budget_s
    cells = cells_from_arg(args.cells)
    dev = cp.cuda.Device()
    props = cp.cuda.runtime.getDeviceProperties(dev.id)
    gpu = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    tag = "".join(ch if ch.isalnum() else "_" for ch in gpu.lower()).strip("_")
    cc, sms, smem_limit, sm_smem = gemm.device_properties(dev.id)
    l2 = l2_bytes(cp)
    per_cell = [candidates(cell, sms, smem_limit, sm_smem, cc, args.near_default, args.thread_shapes)
                for cell in cells]
    identity = {}  # (weight, gs, act, k, n) -> the configuration of the M = K identity product
    for cell in cells:
        key = (cell.weight, cell.group_size, cell.act, cell.k, cell.n)
        if key not in identity:
            identity[key] = gemm.config_for(act_type(cell.act), cell.weight, cell.k, cell.n, cell.k, cell.group_size,
                                            False)
    order = []
    for cell, cands in zip(cells, per_cell):  # compile in the order cells need them
        order.append(identity[(cell.weight, cell.group_size, cell.act, cell.k, cell.n)])
        order += [c.cfg for c in cands]
    compiler = Compiler(order, args.workers)
    copy_gbs = copy_bandwidth(cp)
    meta = dict(gpu=gpu, sms=sms, l2_bytes=l2, copy_gbs=round(copy_gbs, 1), date=datetime.date.today().isoformat(),
                commit=os.environ.get("BENCH_COMMIT", "working tree"), cupy=cp.__version__,
                kernel_dir=str(gemm.KERNEL_DIR),
                launches_per_graph=LAUNCHES_PER_GRAPH, replays=REPLAYS, l2_multiple=L2_MULTIPLE,
                budget_s=args.budget_s, instantiations=len(compiler.futures),
                candidates=sum(len(c) for c in per_cell), stopped="running")
    print(f"{gpu}: {sms} SMs, copy {copy_gbs:.0f} GB/s; {len(cells)} cells, {meta['candidates']} candidates, "
          f"{meta['instantiations']} instantiations compiling in {args.workers} threads", flush=True)
    dtypes = {"float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
    rng = np.random.default_rng()
    stream = cp.cuda.Stream(non_blocking=True)
    # everything on the candidates' stream from here on (weights, reference, bound, zeroed locks): work on CuPy's
    # legacy default stream is not ordered with a non-blocking stream, and HEAD's run checked candidates against
    # a reference still being computed there (WRONG defaults, whole cells WRONG)
    stream.use()
    workspace = cp.zeros(gemm.workspace_numel(sms), dtype=np.int32)
    c_tmp = cp.empty(gemm.c_tmp_numel(sms), dtype=np.float32)
    layers = {}  # (weight, gs, act, k, n) -> (rotated weight copies, W (K, N) fp32 of copy 0, |W|)
    results: list[dict] = []
    stopped = "done"
    try:
        for cell, cands in zip(cells, per_cell):
            if time.monotonic() > deadline:
                stopped = f"budget {args.budget_s}s reached before {cell.label}"
                break
            act = dtypes[cell.act]
            key = (cell.weight, cell.group_size, cell.act, cell.k, cell.n)
            errors = compiler.wait([identity[key]] + [c.cfg for c in cands], deadline)
            if errors[identity[key].name_expression] or errors[cands[0].cfg.name_expression]:
                stopped = (f"{cell.label}: default or identity kernel unavailable: "
                           f"{errors[identity[key].name_expression] or errors[cands[0].cfg.name_expression]}")
                break
            if key not in layers:
                count = copies_for(weight_bytes(cell.k, cell.n, cell.weight, cell.group_size), l2)
                copies = [random_weight(cp, cell.k, cell.n, cell.weight, cell.group_size, act, rng)
                          for _ in range(count)]
                if cell.weight is S.FE4M3FN:  # no NaN codes (S.1111.111) in the weights the sweep checks with
                    for w in copies:
                        b = w.qweight.view(cp.uint8)
                        b ^= ((b & 0x7F) == 0x7F).astype(cp.uint8)
                # W exactly: identity activations make C = the dequantized weight (tests/gpu checks this bitwise)
                eye = cp.eye(cell.k, dtype=act)
                w_exact = gemm.marlin_gemm(eye, copies[0]).astype(cp.float32)
                del eye
                layers[key] = (copies, w_exact, cp.abs(w_exact))
            copies, w_exact, w_abs = layers[key]
            result = time_cell(cp, gemm_abi, cell, cands, copies, w_exact, w_abs, act, stream, workspace, c_tmp, sms,
                               copy_gbs, errors, deadline, rng, compiling=compiler.pending)
            results.append(result)
            write_results(args.out, tag, dict(meta, stopped="running"), results)
            print(cell_table(result, top=6), flush=True)
            if not result["complete"]:
                stopped = f"budget {args.budget_s}s reached inside {cell.label}"
                break
    finally:
        compiler.shutdown()
        meta.update(stopped=stopped, wall_s=round(time.monotonic() - t0, 1))
        write_results(args.out, tag, meta, results)
    print(summary_table(results), flush=True)
    print(f"stopped: {stopped}; {time.monotonic() - t0:.0f}s", flush=True)
    return 0


def time_cell(cp, gemm_abi, cell, cands, copies, w_exact, w_abs, act, stream, workspace, c_tmp, sms, copy_gbs,
              errors, deadline, rng, compiling=lambda: False) -> dict:
    """Check and time every candidate of one cell (the default first and again last). ``compiling()``: whether
    compile threads still run (then each timing starts behind a spin kernel)."""
    m, n, k = cell.m, cell.n, cell.k
    a_host = [rng.standard_normal((m, k), dtype=np.float32).astype(act) for _ in range(2)]
    a = [cp.asarray(x) for x in a_host]
    a32 = a[0].astype(cp.float32)
    ref = a32 @ w_exact  # (M, N) fp32 reference of launch 0 (copy 0, a[0])
    # tests/gpu/test_gemm.py error_bound, fp32 reduction
    bound = gemm.error_bound_factor(act, k) * (cp.abs(a32) @ w_abs) + 1e-30
    c = cp.empty((m, n), dtype=act)
    # and the whole device idle before the first check: nothing issued elsewhere (another stream, the compile
    # threads' module loads) can still be writing what the check reads
    cp.cuda.Device().synchronize()
    nbytes = weight_bytes(k, n, cell.weight, cell.group_size) + m * k * 2 + m * n * 2
    default = cands[0]
    rows = []
    out_default = None

    def prepared_for(cand):
        rec = make_record(gemm_abi, cell, a[0], copies[0], c, c_tmp, workspace, stream.ptr, sms)
        return gemm.prepare_launch(rec, config=cand.cfg, grid=cand.grid)

    def ptrs(w):
        return (w.qweight.data.ptr, w.scales.data.ptr, 0 if w.zeros is None else w.zeros.data.ptr)

    def timed(prep):
        fns = []
        for i in range(LAUNCHES_PER_GRAPH):
            b, s, z = ptrs(copies[i % len(copies)])
            fns.append(lambda i=i, b=b, s=s, z=z: prep.launch(a[i % 2].data.ptr, b, c.data.ptr, c_tmp.data.ptr, s, z,
                                                               0, 0, 0, workspace.data.ptr, stream.ptr))
        return time_graph(cp, fns, stream, spin_us=SPIN_US if compiling() else 0)

    def check_and_time(cand, row) -> None:
        """Poisoned C, one launch, the bound check (row["ok"]); then, if correct, the timing (row["us"])."""
        nonlocal out_default, max_default
        err = errors.get(cand.cfg.name_expression)
        if err:
            row["error"] = err
            return
        try:
            prep = prepared_for(cand)
        except ValueError as exc:  # e.g. fewer blocks resident than the grid needs
            row["error"] = f"refused: {exc}"
            return
        with stream:
            c.fill(cp.nan)  # poison: an element the candidate does not write fails
            b, s, z = ptrs(copies[0])
            prep.launch(a[0].data.ptr, b, c.data.ptr, c_tmp.data.ptr, s, z, 0, 0, 0, workspace.data.ptr, stream.ptr)
            out = c.astype(cp.float32)
            # one device -> host transfer for all the verdicts (a non-finite element makes the excess infinite)
            finite = cp.isfinite(out)
            gap = cp.where(finite, cp.abs(out - ref) - bound, cp.float32(np.inf))  # (M, N)
            stats = [cp.max(gap), cp.any(workspace).astype(cp.float32)]
            if out_default is not None:
                stats += [cp.max(cp.abs(out - out_default)) / max_default, cp.all(c == c_default).astype(cp.float32)]
            values = [float(x) for x in cp.stack(stats).get()]
            excess, locks_zero = values[0], values[1] == 0
            if not locks_zero:
                workspace.fill(0)
            row.update(ok=bool(excess <= 0 and locks_zero), excess_over_bound=excess, locks_left_zero=locks_zero)
            if not row["ok"]:  # where and what, so that a kernel error can be told from a bad reference
                i, j = divmod(int(cp.argmax(gap).get()), n)
                row["worst"] = dict(row=i, col=j, out=float(out[i, j].get()), ref=float(ref[i, j].get()),
                                    bound=float(bound[i, j].get()))
            if out_default is not None:
                row["rel_diff_vs_default"] = values[2] if math.isfinite(excess) else None
                row["values_equal_default"] = values[3] == 1  # (fp16 == compares values: +0 == -0)
            elif row["ok"] and cand.is_default:
                out_default = out
                c_default[...] = c
                max_default = cp.maximum(cp.max(cp.abs(out_default)), cp.float32(1e-30))
        if not row["ok"]:
            print(f"  WRONG {cell.label} {row['config']} grid {cand.grid}: excess over bound {excess:.3g}, locks left "
                  f"zero {locks_zero}, worst {row.get('worst')}", flush=True)
            return
        us_all = timed(prep)
        us = float(np.median(us_all))
        gbs = nbytes / (us * 1e-6) / 1e9
        row.update(us=round(us, 3), us_replays=[round(x, 3) for x in us_all], pct_copy=round(100 * gbs / copy_gbs, 1),
                   gbs=round(gbs, 1))

    c_default = cp.empty_like(c)
    max_default = None
    complete = True
    for cand in cands:
        row = candidate_row(cand, cell)
        rows.append(row)
        if time.monotonic() > deadline:
            complete = False
            row["error"] = "budget reached"
            continue
        check_and_time(cand, row)
    again = candidate_row(default, cell)  # the default once more at the end: its two timings bracket the cell (drift / noise)
    if complete and rows[0].get("us") is not None:
        check_and_time(default, again)
    first, last_us = rows[0].get("us"), again.get("us")
    default_us = None if first is None else (first if last_us is None else (first + last_us) / 2)
    return dict(label=cell.label, weight=str(cell.weight), group_size=cell.group_size, act=cell.act, k=k, n=n, m=m,
                default_config=rows[0]["config"], default_grid=rows[0]["grid"], default_us=default_us,
                default_us_first=first, default_us_last=last_us if last_us is not None else first,
                bytes=nbytes, complete=complete, candidates=rows)


SELFCHECK_SHAPE = (4096, 2048)  # (K, N): every grid of the sweep still has blocks that cross slice ends


def selfcheck(args) -> int:
    """The device script's test phase: on a small layer with NumPy-reference weights (workbench.quantize), (1) the
    sweep's reference — identity activations — gives the dequantized weight bit for bit, (2) every candidate of a
    few cells (all of u4b8 M = 1 / 5, a sample for FP8 and u8b128) computes the product within tests/gpu's fp32
    bound, writes every element of a NaN-poisoned C, leaves the locks zero and repeats bitwise."""
    import cupy as cp

    from workbench import gemm_abi
    from workbench.weight import random_marlin_weight

    t0 = time.monotonic()
    cc, sms, smem_limit, sm_smem = gemm.device_properties(0)
    k, n = SELFCHECK_SHAPE
    cells = [Cell(S.U4B8, 128, "float16", k, n, 1), Cell(S.U4B8, 128, "float16", k, n, 5),
             Cell(S.FE4M3FN, -1, "float16", k, n, 1), Cell(S.U8B128, 128, "float16", k, n, 16)]
    per_cell = [candidates(cell, sms, smem_limit, sm_smem, cc) for cell in cells]
    per_cell = per_cell[:2] + [c[:1] + c[1::20] for c in per_cell[2:]]  # the 8-bit cells: default + a sample
    identity = [gemm.config_for(S.F16, cell.weight, k, n, k, cell.group_size, False) for cell in cells]
    everything = identity + [c.cfg for cands in per_cell for c in cands]
    compiler = Compiler(everything, args.workers)
    errors = compiler.wait(everything, time.monotonic() + 3600)
    compiler.shutdown()
    unbuilt = sorted({name for name, err in errors.items() if err})
    for name in unbuilt:
        print(f"NOT BUILT {name}: {errors[name]}", flush=True)
    print(f"compiled in {time.monotonic() - t0:.0f}s ({len(unbuilt)} of {len(errors)} instantiations did not build)",
          flush=True)
    rng = np.random.default_rng()
    stream = cp.cuda.Stream(non_blocking=True)
    stream.use()  # one stream for everything (see run)
    workspace = cp.zeros(gemm.workspace_numel(sms), dtype=np.int32)
    c_tmp = cp.empty(gemm.c_tmp_numel(sms), dtype=np.float32)
    failures = checked = 0
    for cell, cands in zip(cells, per_cell):
        mw, q = random_marlin_weight(k, n, cell.weight, cell.group_size, act_dtype=np.float16,
                                     seed=int(rng.integers(1 << 30)))
        w = gemm.upload_weight(mw)
        eye = cp.eye(k, dtype=np.float16)
        w_exact = gemm.marlin_gemm(eye, w).astype(cp.float32)
        identity_exact = bool(np.array_equal(cp.asnumpy(w_exact), q.w_ref))
        if not identity_exact:
            failures += 1
            print(f"FAIL {cell.label}: identity product != dequantized weight", flush=True)
        a = rng.standard_normal((cell.m, k), dtype=np.float32).astype(np.float16)
        ref = a.astype(np.float32) @ q.w_ref
        bound = gemm.error_bound_factor(np.float16, k) * (np.abs(a.astype(np.float32)) @ np.abs(q.w_ref)) + 1e-30
        a_dev = cp.asarray(a)
        c = cp.empty((cell.m, n), dtype=np.float16)
        for cand in cands:
            if errors[cand.cfg.name_expression]:
                continue
            rec = make_record(gemm_abi, cell, a_dev, w, c, c_tmp, workspace, stream.ptr, sms)
            try:
                prep = gemm.prepare_launch(rec, config=cand.cfg, grid=cand.grid)
            except ValueError as exc:
                print(f"refused {cell.label} {cand.config_text} grid {cand.grid}: {exc}", flush=True)
                continue
            outs = []
            for _ in range(2):
                with stream:
                    c.fill(cp.nan)
                    prep.launch(a_dev.data.ptr, w.qweight.data.ptr, c.data.ptr, c_tmp.data.ptr, w.scales.data.ptr,
                                0 if w.zeros is None else w.zeros.data.ptr, 0, 0, 0, workspace.data.ptr, stream.ptr)
                    outs.append(cp.asnumpy(c))
            locks_zero = not bool(cp.any(workspace))
            out = outs[0].astype(np.float32)
            excess = float((np.abs(out - ref) - bound).max()) if np.all(np.isfinite(out)) else float("inf")
            repeat = np.array_equal(outs[0].view(np.uint16), outs[1].view(np.uint16))
            checked += 1
            if not (excess <= 0 and locks_zero and repeat):
                failures += 1
                workspace.fill(0)
                print(f"FAIL {cell.label} {cand.config_text} grid {cand.grid} ({'/'.join(cand.grid_kinds)}): excess "
                      f"over bound {excess:.3g}, locks zero {locks_zero}, repeatable {repeat}", flush=True)
        print(f"checked {cell.label}: {len(cands)} candidates, identity exact {identity_exact} "
              f"({time.monotonic() - t0:.0f}s)", flush=True)
    failures += len(unbuilt)
    print(f"selfcheck: {checked} forced launches, {len(unbuilt)} instantiations not built, "
          f"{'PASS' if failures == 0 else f'{failures} FAILURES'}", flush=True)
    return 1 if failures else 0


def list_cells(args) -> int:
    """The sweep set without a GPU (H200 properties unless --sms etc. are given)."""
    cells = cells_from_arg(args.cells)
    names = set()
    total = 0
    for i, cell in enumerate(cells):
        cands = candidates(cell, args.sms, args.smem_limit, args.sm_smem, near_default=args.near_default,
                           thread_shapes=args.thread_shapes)
        names |= {c.cfg.name_expression for c in cands}
        total += len(cands)
        d = cands[0]
        print(f"[{i}] {cell.label}: {len(cands)} candidates, {len({c.cfg for c in cands})} configs; default "
              f"{d.config_text} grid {d.grid}")
        if args.verbose:
            for c in cands:
                print(f"      {c.config_text:14s} {c.cfg.block_k}x{c.cfg.block_n} grid {c.grid:4d} "
                      f"{'/'.join(c.grid_kinds)} {c.variant}")
    print(f"{len(cells)} cells, {total} candidates, {len(names)} distinct instantiations")
    return 0


def _thread_shapes(text: str) -> frozenset:
    """'1x2,2x4' -> {(1, 2), (2, 4)} (argparse type of --thread-shapes)."""
    try:
        shapes = frozenset(tuple(int(v) for v in part.split("x")) for part in text.split(","))
    except ValueError:
        shapes = frozenset()
    if not shapes or any(len(s) != 2 for s in shapes) or not shapes <= set(gemm._THREAD_SHAPES):
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected n_tiles x k_warp pairs from {sorted(gemm._THREAD_SHAPES)}")
    return shapes


def main(argv=None) -> int:
    global ONE_BLOCK_STAGES
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path)
    parser.add_argument("--budget-s", type=float, default=140.0, help="stop cleanly after this many seconds")
    parser.add_argument("--workers", type=int, default=16, help="compile threads")
    parser.add_argument("--cells", default="all", help="all, quick, or indices into CELLS (comma-separated)")
    parser.add_argument("--kernel-dir", type=pathlib.Path, default=None,
                        help="compile kernels_cuda sources from this folder instead (e.g. a copy of HEAD's)")
    parser.add_argument("--list", action="store_true", help="print the cells and candidates; no GPU needed")
    parser.add_argument("--selfcheck", action="store_true",
                        help="forced configurations / grids against the NumPy reference on a small layer (GPU)")
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--near-default", action="store_true",
                        help="only the default's thread shape, blocks per SM and swap; stages and grids vary")
    parser.add_argument("--thread-shapes", default=None, type=_thread_shapes,
                        help="only these thread shapes besides the default, as n_tiles x k_warp (e.g. 1x2,2x4)")
    parser.add_argument("--stages", default=None,
                        help="one-block stage counts to try, comma-separated (default: %s)"
                        % ",".join(map(str, ONE_BLOCK_STAGES)))
    parser.add_argument("--sms", type=int, default=132, help="(--list) SMs; the H200's by default")
    parser.add_argument("--smem-limit", type=int, default=227 * 1024, help="(--list) opt-in shared memory per block")
    parser.add_argument("--sm-smem", type=int, default=228 * 1024, help="(--list) shared memory per SM")
    args = parser.parse_args(argv)
    if args.stages:
        ONE_BLOCK_STAGES = tuple(int(x) for x in args.stages.split(","))
    if args.kernel_dir is not None:
        gemm.KERNEL_DIR = args.kernel_dir.resolve()
        gemm.kernel_source.cache_clear()
    if args.list:
        return list_cells(args)
    if args.selfcheck:
        return selfcheck(args)
    if args.out is None:
        parser.error("--out is required (or --list)")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
