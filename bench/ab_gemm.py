"""A/B timing of the Marlin GEMM against a previous version of itself, in one run, with the baselines beside it.

    python bench/ab_gemm.py --out DIR --old-dir OLD [--m 1,4,16,64] [--shapes 4096x4096,...] [--labels u4b8,...]
                            [--variants new,old,new-striped] [--repeats 5]

OLD holds a previous commit's ``workbench/gemm.py`` and ``kernels_cuda/{marlin_gemm.cu,*.cuh}``
(e.g. ``git show REV:path > OLD/name``); it is loaded as a second module with its own kernels, so both versions
are timed on the same weights, in the same process, interleaved cell by cell (--repeats N: N timings per variant
and cell, interleaved variant by variant; the median is reported, with the range). Variants:
  new         workbench.gemm as checked out
  old         OLD
  new-striped workbench.gemm with the striped grid of every block count <= #SMs (align_slices off: blocks may
              straddle two slices), to tell the kernel change from the slice-aligned grid
  new-legacy  workbench.gemm with the fbd47ed blocks-per-SM rule (two blocks for every M <= 16 kernel)
  new-noswap  workbench.gemm without the operand swap for M <= 8 (swap_max_m = 0)
  new-swap16  workbench.gemm with the operand swap's 16-row form for M = 9..16 too (swap_max_m = 16; the swap
              policies of M <= 8 then apply to M <= 16)
  new-nocluster workbench.gemm with the slice sums in global memory everywhere (cluster_sums = False: no
              thread-block clusters on sm_90; the same tiles and grids, the pair policy's included)
  new-plain   workbench.gemm with plain launches (programmatic_launch = False: no programmatic dependent launch on
              sm_90; the same kernels, which then never wait); new-programmatic: with them (programmatic_launch = True);
              new-programmatic-nocluster: with them and the slice sums in global memory (no cluster launches);
              new-programmatic-unpinned: with them, the launch's shared memory as planned (programmatic_pin_occupancy
              off: as many blocks per SM as fit)
  new-no8bitpairs workbench.gemm without the 8-bit two-block pairs at M = 9..16 (pair_two_block_eight_bit_rows off)
  new-noswapaligned workbench.gemm with swapped two-block kernels kept off longer slice-aligned grids
              (aligned_swap_two_blocks off: the striped grid, as before round 14)
  new-8bit2   workbench.gemm with two blocks per SM for 8-bit weights too (two_blocks_weight_bits = (4, 8)): a
              different configuration, so its bits may differ from old's (another K split)
  new-oldpolicy workbench.gemm's kernels with the policy before round 6 (OLD_POLICY: 8 stages first for M <= 16,
              the (2, 4) tile first for 8-bit, aligned grids only when no longer than the striped one)
  new-r16pairs workbench.gemm with round 16's pair rules (long one-block pairs for fp16 without zero points only,
              two-block pairs for fp16 only: pair_long_acts, pair_long_zero_points, two_block_pair_acts); r17b timed
              round 17's rules as variants of round 16's (new-longpairs, new-bf16two)
  new-norowswide workbench.gemm without round 18's 512 x 128 tile for 4-bit rows-layout kernels at M = 9..16
              (rows_wide_first off)
  new-stages4 workbench.gemm with 4 stages first for one-block 4-bit kernels outside pairs (one_m_block_stages[4];
              A/B r17b: not taken)
Each variant is a GemmPolicy (workbench.policy) passed to the calls: dataclasses.replace of the default.
Method as bench/bench_gemm.py (CUDA graphs over rotated inputs > 3 x L2). Also records max |new - old| / max |old|
per cell (same inputs) and whether the outputs are bitwise equal (bits_equal_old: what a change that keeps the
summation order must give); correctness itself is tests/gpu's job.
Writes DIR/ab_<gpu>.json after every layer.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import json
import os
import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from bench_gemm import (OURS, SHAPES, LAUNCHES_PER_GRAPH, copies_for, device_summary,  # noqa: E402
                        random_weight, time_cupy_graph, time_torch_graph, weight_bytes)
from sweep_gemm import swap_text  # noqa: E402
from workbench import gemm  # noqa: E402
from workbench.policy import DEFAULT_GEMM_POLICY, GemmPolicy  # noqa: E402
from workbench.scalar_types import ScalarType as S  # noqa: E402

LEGACY_LABELS = ("marlin u4b8 g128 fp16", "marlin fe4m3fn chan fp16")
DEFAULT = DEFAULT_GEMM_POLICY
# workbench.gemm's policy before round 6's sweep (variant new-oldpolicy; tests/cpu pins what it chooses): 8 stages
# first for M <= 16, the (2, 4) tile first for 8-bit, aligned grids only when no longer than the striped one
OLD_POLICY = dataclasses.replace(
    DEFAULT, one_m_block_stages=((4, (8, 6, 4)), (8, (8, 6, 4))),
    eight_bit_one_m_block_shapes=DEFAULT.small_m_shapes, aligned_max_longer=1.0, aligned_max_longer_swap=1.0,
    two_blocks_min_steps_swap=DEFAULT.two_blocks_min_steps, rows_wide_first=False)
# the previous blocks-per-SM rule (two blocks per SM for every one-m16-block kernel)
LEGACY_POLICY = dataclasses.replace(DEFAULT, two_blocks_weight_bits=(4, 8), two_blocks_min_steps=0,
                                    two_blocks_min_steps_swap=0)


def load_old(old_dir: pathlib.Path, module_name: str = "gemm_old"):
    """OLD/gemm.py as module `module_name`, compiling OLD's kernels (bench/ablation_probe.py loads its variants so)."""
    spec = importlib.util.spec_from_file_location(module_name, old_dir / "gemm.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    mod.KERNEL_DIR = old_dir
    mod.kernel_source.cache_clear()
    return mod


def variant(**fields) -> GemmPolicy:
    """The default policy with some fields replaced (e.g. swap_max_m=0)."""
    return dataclasses.replace(DEFAULT, **fields)


def policy_kw(mod, policy) -> dict:
    """The keyword a call of ``mod`` takes for ``policy``: none for OLD modules of a tree before policies (their
    variants are their own defaults)."""
    return {} if policy is None else {"policy": policy}


def launched_plan(mod, cfg, m: int, n: int, k: int, policy=None) -> dict:
    """What the last plan of this shape and types launched: its kernel (cluster size included), the blocks per SM
    that fit its shared memory as planned, and the shared memory it launches with (pinned for programmatic launches:
    GemmPolicy.programmatic_pin_occupancy)."""
    cache = mod.launch._prepared if hasattr(getattr(mod, "launch", None), "_prepared") else mod._prepared
    plans = [p for p in cache.values() if (p.m, p.n, p.k, p.cfg.act, p.cfg.weight) == (m, n, k, cfg.act,
                                                                                             cfg.weight)
             and getattr(p, "policy", None) in (None, policy)]
    if not plans:
        return {}
    p = plans[-1]
    return dict(cluster=p.cfg.cluster, resident=mod.resident_blocks(p.cfg.name_expression, 0), smem=p.smem,
                launch_smem=getattr(p, "launch_smem", p.smem),
                programmatic=bool(getattr(p, "programmatic", getattr(p, "_programmatic", None) is not None)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=pathlib.Path)
    parser.add_argument("--old-dir", required=True, type=pathlib.Path)
    parser.add_argument("--m", default="1,4,16,64")
    parser.add_argument("--shapes", default="", help="KxN,... (default: every bench_gemm shape)")
    parser.add_argument("--labels", default="", help="substrings of bench_gemm OURS labels (default: all)")
    parser.add_argument("--variants", default="new,old,new-legacy")
    parser.add_argument("--no-tinygemm", action="store_true", help="skip tinygemm (cuBLAS fp16 is always timed)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="timings per variant and cell, interleaved variant by variant (the median is reported)")
    args = parser.parse_args(argv)
    import cupy as cp
    import ml_dtypes
    import torch

    old = load_old(args.old_dir)
    args.out.mkdir(parents=True, exist_ok=True)
    gpu, sms, l2, copy_gbs = device_summary(cp)
    dtypes = {"float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
    m_values = tuple(int(x) for x in args.m.split(","))
    all_variants = {"new": (gemm, DEFAULT), "old": (old, None),
                    "new-striped": (gemm, variant(align_slices=False)), "new-legacy": (gemm, LEGACY_POLICY),
                    "new-noswap": (gemm, variant(swap_max_m=0)),
                    "new-swap16": (gemm, variant(swap_max_m=16)),
                    "new-nocluster": (gemm, variant(cluster_sums=False)),
                    "new-plain": (gemm, variant(programmatic_launch=False)),
                    "new-programmatic": (gemm, variant(programmatic_launch=True)),
                    "new-programmatic-nocluster": (gemm, variant(programmatic_launch=True, cluster_sums=False)),
                    "new-programmatic-unpinned": (gemm, variant(programmatic_launch=True,
                                                                programmatic_pin_occupancy=False)),
                    "new-8bit2": (gemm, variant(two_blocks_weight_bits=(4, 8))),
                    "new-no8bitpairs": (gemm, variant(pair_two_block_eight_bit_rows=False)),
                    "new-noswapaligned": (gemm, variant(aligned_swap_two_blocks=False)),
                    "new-oldpolicy": (gemm, OLD_POLICY),
                    "new-r16pairs": (gemm, variant(pair_long_acts=(S.F16,), pair_long_zero_points=False,
                                                   two_block_pair_acts=(S.F16,), rows_wide_first=False)),
                    "new-norowswide": (gemm, variant(rows_wide_first=False)),
                    "new-stages4": (gemm, variant(one_m_block_stages=((4, (4, 6, 8)),
                                                                      (8, DEFAULT.one_block_stages(8)))))}
    names = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(names) - set(all_variants))
    if unknown or "old" not in names:
        parser.error(f"--variants must name 'old' and only {sorted(all_variants)}; got {names}")
    variants = {name: all_variants[name] for name in names}
    shapes = SHAPES if not args.shapes else tuple(tuple(int(x) for x in s.split("x")) for s in args.shapes.split(","))
    ours_rows = [row for row in OURS if not args.labels or any(w in row[0] for w in args.labels.split(","))]

    def wanted(variant, label):
        return variant != "new-legacy" or label in LEGACY_LABELS

    # compile everything first, in threads
    todo = {name: [] for name in variants}
    for k, n in shapes:
        for m in m_values:
            for label, wt, gs, dt in ours_rows:
                for name, (mod, policy) in variants.items():
                    if wanted(name, label):
                        todo[name].append(mod.config_for(gemm.act_scalar_type(dtypes[dt]), wt, m, n, k, gs, False,
                                                         **policy_kw(mod, policy)))
    for mod in {id(m): m for m, _ in variants.values()}.values():  # the "new-*" / "old-*" variants share kernels
        mod_todo = [cfg for name, (m, _) in variants.items() if m is mod for cfg in todo[name]]
        mod.precompile(mod_todo, workers=16)
    print("compiled", {k: len(set(v)) for k, v in todo.items()}, flush=True)

    rng = np.random.default_rng(0)
    rows = []
    meta = dict(gpu=gpu, sms=sms, copy_gbs=round(copy_gbs, 1), date=datetime.date.today().isoformat(),
                commit=os.environ.get("BENCH_COMMIT", "working tree"), torch=torch.__version__, cupy=cp.__version__)
    tag = "".join(ch if ch.isalnum() else "_" for ch in gpu.lower()).strip("_")
    for k, n in shapes:
        n_fp16 = copies_for(k * n * 2, l2)
        w16 = [torch.randn(k, n, device="cuda", dtype=torch.float16) * 0.01 for _ in range(n_fp16)]
        n_tiny = copies_for(k * n // 2, l2)
        packed = [torch._convert_weight_to_int4pack(torch.randint(0, 256, (n, k // 2), dtype=torch.uint8,
                                                                  device="cuda"), 8)
                  for _ in range(0 if args.no_tinygemm else n_tiny)]
        sz = torch.rand(k // 128, n, 2, device="cuda", dtype=torch.bfloat16) * 0.01
        ours = {label: [random_weight(cp, k, n, wt, gs, dtypes[dt], rng)
                        for _ in range(copies_for(weight_bytes(k, n, wt, gs), l2))] for label, wt, gs, dt in ours_rows}
        for m in m_values:
            a16 = [torch.randn(m, k, device="cuda", dtype=torch.float16) for _ in range(2)]
            abf = [x.to(torch.bfloat16) for x in a16]
            out16 = torch.empty(m, n, device="cuda", dtype=torch.float16)
            base = m * k * 2 + m * n * 2

            def record(method, us, nbytes, fp16_us, **extra):
                gbs = nbytes / (us * 1e-6) / 1e9
                row = dict(k=k, n=n, m=m, method=method, us=round(us, 3), pct_copy=round(100 * gbs / copy_gbs, 1),
                           speedup_vs_fp16=round(fp16_us / us, 3), **extra)
                rows.append(row)
                print(f"K={k:6d} N={n:6d} M={m:3d} {method:38s} {us:8.2f} us x{fp16_us / us:5.2f} "
                      + " ".join(f"{a}={b}" for a, b in extra.items()), flush=True)

            fp16_us = time_torch_graph(torch, [(lambda i=i: torch.matmul(a16[i % 2], w16[i % n_fp16], out=out16))
                                               for i in range(LAUNCHES_PER_GRAPH)])
            record("cuBLAS fp16", fp16_us, k * n * 2 + base, fp16_us)
            if not args.no_tinygemm:
                tiny = [(lambda i=i: torch._weight_int4pack_mm(abf[i % 2], packed[i % n_tiny], 128, sz))
                        for i in range(LAUNCHES_PER_GRAPH)]
                us = time_torch_graph(torch, tiny)
                record("tinygemm bf16", us, k * n // 2 + k // 128 * n * 4 + base, fp16_us)
            torch.cuda.synchronize()
            for label, wt, gs, dt in ours_rows:
                ws_list = ours[label]
                a = [cp.asarray(rng.standard_normal((m, k), dtype=np.float32).astype(dtypes[dt])) for _ in range(2)]
                outs, timed = {}, {}
                for name, (mod, policy) in variants.items():
                    if not wanted(name, label):
                        continue
                    c = cp.empty((m, n), dtype=dtypes[dt])
                    work = cp.zeros(mod.workspace_numel(sms), dtype=np.int32)
                    c_tmp = cp.empty(mod.c_tmp_numel(sms), dtype=np.float32)
                    kw = policy_kw(mod, policy)
                    cfg = mod.config_for(gemm.act_scalar_type(dtypes[dt]), wt, m, n, k, gs, False, **kw)
                    launches = [(lambda s, i=i, mod=mod, c=c, work=work, c_tmp=c_tmp, kw=kw: mod.marlin_gemm(
                        a[i % 2], ws_list[i % len(ws_list)], c=c, workspace=work, c_tmp=c_tmp, stream=s, **kw))
                        for i in range(LAUNCHES_PER_GRAPH)]
                    us = [time_cupy_graph(cp, launches)]
                    grid = mod.grid_blocks(cfg, m, n, k, sms, **kw)  # (as planned; fewer if fewer are resident)
                    plan = launched_plan(mod, cfg, m, n, k, policy)
                    timed[name] = (us, launches, mod, cfg, grid, plan, c, lambda c=c, work=work, c_tmp=c_tmp, mod=mod,
                                   kw=kw: mod.marlin_gemm(a[0], ws_list[0], c=c, workspace=work, c_tmp=c_tmp, **kw))
                for _ in range(args.repeats - 1):  # further rounds, interleaved variant by variant
                    for name, (us, launches, *_) in timed.items():
                        us.append(time_cupy_graph(cp, launches))
                for name, (us, launches, mod, cfg, grid, plan, c, once) in timed.items():
                    spread = (round(min(us), 3), round(max(us), 3))
                    us = float(np.median(us))
                    once()  # the output compared below: one call on the first inputs
                    outs[name] = cp.asnumpy(c)
                    record(f"{label} [{name}]", us, weight_bytes(k, n, wt, gs) + base, fp16_us,
                           config=f"{cfg.n_tiles},{cfg.k_warp},{cfg.stages},b{cfg.blocks_per_sm}"
                           + swap_text(cfg), grid=grid, us_range=spread,
                           **plan)
                ref = outs["old"].astype(np.float32)
                scale = float(np.max(np.abs(ref))) or 1.0
                for name, raw in outs.items():
                    if name != "old":
                        o = raw.astype(np.float32)
                        diff = float(np.max(np.abs(o - ref))) / scale if np.all(np.isfinite(o)) else float("inf")
                        # same inputs, same partition: a pure refactor of the kernel must give the same bits
                        same = bool(np.array_equal(raw.view(np.uint16), outs["old"].view(np.uint16)))
                        row = rows[-len(outs) + list(outs).index(name)]
                        row["rel_diff_vs_old"], row["bits_equal_old"] = diff, same
                        print(f"    {name} vs old: max |diff| / max |old| = {diff:.2e}, bitwise equal: {same}",
                              flush=True)
        del w16, packed, ours
        torch.cuda.empty_cache()
        cp.get_default_memory_pool().free_all_blocks()
        (args.out / f"ab_{tag}.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
