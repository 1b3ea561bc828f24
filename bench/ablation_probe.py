"""Where the dense GEMM's time goes: the same kernel with one part of its main loop taken out, timed side by side.

    python bench/ablation_probe.py --out DIR [--cells 8192x28672:u4b8:1,...] [--variants base,nobar,...]

Each variant is the kernel source of this tree with a text edit (VARIANTS below; every edit must match exactly
once, or the probe stops). The edited kernels compute wrong results on purpose: they exist only to be timed, never
to be used, so they live in a temporary directory and are loaded as separate copies of workbench.gemm (as
bench/ab_gemm.py loads an old version). Same configuration, grid and inputs as the library's own choice for each
cell; bench_gemm.py's method (CUDA graph of 20 launches over inputs rotated through > 3x L2, device events).

Reading the result: T(nowait_nobar) is what the loop costs if no load latency were ever exposed (issue-bound time);
T(nocompute) what the fetch pipeline and slice finishing cost alone; T(noB) the compute with no weight traffic.
--write-moe-variant NAME DIR writes the fused MoE kernel with a part taken out, for bench_moe.py --ab-old DIR.
--grids policy,striped,aligned times each variant on the library's grid, on the striped split only (align_slices
off) and on the slice-aligned grid wherever the slices fit (aligned_extra_steps huge), as GemmPolicy values.
Writes DIR/ablation_<gpu>.json after every cell.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import sys
import tempfile

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_gemm import (OURS, LAUNCHES_PER_GRAPH, copies_for, device_summary, random_weight,  # noqa: E402
                        time_cupy_graph, weight_bytes)
from ab_gemm import load_old, variant  # noqa: E402
from workbench import gemm  # noqa: E402

_BARRIER = "    stage_barrier();  // the compute slot is visible to its readers; the slot fetched below was released by them\n"
_WAIT = "    cp_async_wait<STAGES - 2>();\n"
_COMPUTE = "    compute_stage(cursor.slot, slice_, kit_);\n"
_ZFILL = '  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\\n" ::"r"(smem), "l"(gmem), "r"(src_bytes));\n'
_NO_ZFILL = '  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\\n" ::"r"(smem), "l"(gmem));\n  (void)src_bytes;\n'
# (the block-wide A copy: kernels with the per-warp pipeline, marlin_gemm.cu kWarpFetch, copy A in fetch_a's other
# branch, which nocompute_noA leaves in place)
_A_COPY = ("          cp_async16_at(slot + ((kARowsPerPass % 8 != 0 && n % 2) ? a_dst_odd : a_dst) + "
           "16 * n * kThreads,\n                        a_src[n] + kit * (BK / 8), (a_valid >> n) & 1u);\n")
# end_slice's finishing: the SWAP kernels' fold in the loop layout, the row layout, the finish call
_SWAP_FOLD = "    if constexpr (SWAP) fold_warps<Loop::kAccM, N_TILES>(loop.acc, ring.red);\n"
_ROWS = "    loop.rows_layout(partial);\n"


def _span(fname: str, first: str, stop: str) -> str:
    """The text of kernels_cuda/<fname> from `first` (included) up to `stop` (excluded); each must occur once."""
    text = (ROOT / "kernels_cuda" / fname).read_text()
    for marker in (first, stop):
        if text.count(marker) != 1:
            raise RuntimeError(f"ablation_probe: {fname} holds {marker!r} {text.count(marker)} times, not once")
    begin = text.index(first)
    return text[begin:text.index(stop, begin)]


# (the finish call: the cluster kernels' finish, or the ring fold of a last slice, the warp fold and the finish; read
# from the source, as long as it is)
_CALL = _span("marlin_gemm.cu", "    if constexpr (CLUSTER > 1) {  // (row-layout warps are folded there)\n",
              "    zero_acc();\n  };\n")
_FINISH = _SWAP_FOLD + _ROWS + _CALL
_NO_FINISH = "    (void)partial;\n"
# the finish replaced by a sink that keeps every accumulator alive (no fold, no cross-block sum, no C)
_SINK = (_ROWS + "    float sink = 0.f;\n"
         "    for (int mb = 0; mb < M_BLOCKS; ++mb) for (int nb = 0; nb < 8; ++nb) for (int r = 0; r < 4; ++r)\n"
         "      sink += partial[mb][nb][r];\n    if (sink == 1234.5f) C[0] = C[1];\n")
_FOLD = "  if constexpr (FOLD) fold_warps<M_BLOCKS, N_TILES>(acc, sRed);\n"
# (end_slice's warp folds before an inlined finish and on a last slice in the ring)
_END_FOLD = "        if (!folded) fold_warps<M_BLOCKS, N_TILES>(partial, ring.red);\n"
_END_RING_FOLD = "          fold_warps_in_ring<M_BLOCKS, N_TILES>(partial, ring.base);\n"
# the cluster kernels' warp fold (both layouts: fold_warps, or the fold in the ring, fold_warps_in_ring, which the
# last slice of an out-of-line finish uses too) left out; their cross-block sum done on the block's own partial with
# block barriers (what the fold and the distributed-shared-memory sum cost in the cluster finish)
_CLUSTER_FOLD = "  if constexpr (kGroups > 1) {\n    __syncthreads();\n"
_CLUSTER_BAR1 = "  }\n  cluster_sync();\n  const int chunk"
_CLUSTER_BAR2 = "  }\n  cluster_sync();\n#pragma unroll\n  for (int it = 0; it < kIters"
_CLUSTER_LOAD = "theirs[q] = ld_cluster_f4(cluster_map(ring_base + 16 * e, q));"
# the scale multiply of every dequantized pair left out (what applying scales after the mma could save at most)
_SCALE_MUL = ("    for (int r = 0; r < 2; ++r) b[h][r] = SCALED ? as_u32(__hmul2(v[r], scale[h][r])) : "
              "as_u32(v[r]);\n")
_NO_SCALE_MUL = "    for (int r = 0; r < 2; ++r) b[h][r] = as_u32(v[r]);\n    (void)scale;\n"
_B_COPY = "      cp_async16_at(slot + b_dst + 16 * b_copy_delta(n), b + b_copy_delta(n));\n"
# every block writes its own partial to C as if it held its slice alone: no slots, no count, no cross-block sum (what
# the global fp32 sum costs beside the fold and the C stores)
_ONE_CONTRIBUTOR = "  if (count == 1) {\n"

# The fused MoE kernel's item finishing replaced by a sink over every accumulator (for bench_moe.py --ab-old: see
# write_variant_dir)
_MOE_FINISH = "    finish_item(c_item);\n"
_MOE_SINK = ("    {\n      float sink = 0.f;\n"
             "      for (int mb = 0; mb < M_BLOCKS; ++mb) for (int nb = 0; nb < Loop::kAccN; ++nb)\n"
             "        for (int r = 0; r < 4; ++r) sink += loop.acc[mb][nb][r];\n"
             "      if (sink == 1234.5f) C[0] = C[1];\n    }\n")
MOE_VARIANTS = {"moe_sinkfinish": [("marlin_moe.cu", _MOE_FINISH, _MOE_SINK)]}

# name -> [(file, old text, new text)]
VARIANTS = {
    "base": [],
    "nobar": [("marlin_gemm.cu", _BARRIER, "")],
    "nowait_nobar": [("marlin_gemm.cu", _BARRIER, ""), ("marlin_gemm.cu", _WAIT, "")],
    "nocompute": [("marlin_gemm.cu", _COMPUTE, "")],
    "nozfill": [("mma.cuh", _ZFILL, _NO_ZFILL)],
    "nocompute_nozfill": [("marlin_gemm.cu", _COMPUTE, ""), ("mma.cuh", _ZFILL, _NO_ZFILL)],
    "nocompute_noA": [("marlin_gemm.cu", _COMPUTE, ""), ("marlin_gemm.cu", _A_COPY, "          ;\n")],
    "nocompute_nofinish": [("marlin_gemm.cu", _COMPUTE, ""), ("marlin_gemm.cu", _FINISH, _NO_FINISH)],
    "nofinish": [("marlin_gemm.cu", _FINISH, _NO_FINISH)],
    "sinkfinish": [("marlin_gemm.cu", _FINISH, _SINK)],
    "finish_return": [("marlin_gemm.cu", _SWAP_FOLD, ""), ("marlin_gemm.cu", _END_FOLD, ""),
                      ("marlin_gemm.cu", _END_RING_FOLD, ""), ("marlin_gemm.cu", _FOLD, "  if (prob_m > 0) return;\n")],
    "nofold": [("marlin_gemm.cu", _SWAP_FOLD, ""), ("marlin_gemm.cu", _END_FOLD, ""),
               ("marlin_gemm.cu", _END_RING_FOLD, ""), ("marlin_gemm.cu", _FOLD, "")],
    "noscale": [("dequant.cuh", _SCALE_MUL, _NO_SCALE_MUL)],
    "nosum": [("marlin_gemm.cu", _ONE_CONTRIBUTOR, "  if (count >= 1) {\n")],
    "noB": [("marlin_mainloop.cuh", _B_COPY, "      (void)b;\n")],
    "nofold_cluster": [("marlin_gemm.cu", _SWAP_FOLD, ""),
                       ("marlin_gemm.cu", _CLUSTER_FOLD, "  if (false) {\n    __syncthreads();\n")],
    "localsum": [("marlin_gemm.cu", _CLUSTER_BAR1, _CLUSTER_BAR1.replace("cluster_sync", "__syncthreads")),
                 ("marlin_gemm.cu", _CLUSTER_BAR2, _CLUSTER_BAR2.replace("cluster_sync", "__syncthreads")),
                 ("marlin_gemm.cu", _CLUSTER_LOAD, "theirs[q] = ld_cluster_f4(ring_base + 16 * e);")],
}
DEFAULT_CELLS = ("8192x28672:u4b8 g128 fp16:1", "8192x28672:u4b8 g128 fp16:16", "4096x14336:u4b8 g128 fp16:1",
                 "4096x4096:u4b8 g128 fp16:1", "8192x8192:u4b8 g128 fp16:1", "8192x28672:fe4m3fn chan fp16:1")


def write_variant_dir(name: str, edits, kdir: pathlib.Path) -> pathlib.Path:
    """kdir: this tree's kernels_cuda/ files with `edits` applied, beside copies of workbench/gemm.py and moe.py (the
    layout bench_moe.py --ab-old and bench/ab_gemm.py --old-dir load). For the fused MoE kernel, whose timing path is
    bench_moe.py's: `python bench/ablation_probe.py --write-moe-variant moe_sinkfinish DIR`, then
    `python bench/bench_moe.py --out OUT --ab-old DIR --m 1,8,64 --variants new` ("old" is the variant there)."""
    kdir.mkdir(parents=True)
    for f in gemm.KERNEL_DIR.iterdir():
        if f.is_file():
            (kdir / f.name).write_text(f.read_text())
    for f in ("gemm.py", "moe.py"):
        (kdir / f).write_text((ROOT / "workbench" / f).read_text())
    for fname, old, new in edits:
        text = (kdir / fname).read_text()
        if text.count(old) != 1:
            raise SystemExit(f"variant {name}: the edit of {fname} matches {text.count(old)} times, not once: {old!r}")
        (kdir / fname).write_text(text.replace(old, new))
    return kdir


def variant_module(name: str, edits, tmp: pathlib.Path):
    """A copy of workbench.gemm whose kernels are this tree's with `edits` applied."""
    return load_old(write_variant_dir(name, edits, tmp / name), f"gemm_{name}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=pathlib.Path)
    parser.add_argument("--cells", default=",".join(DEFAULT_CELLS), help="KxN:label:M,... (label as in bench_gemm)")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--grids", default="policy", help="policy,striped,aligned")
    parser.add_argument("--write-moe-variant", nargs=2, metavar=("NAME", "DIR"),
                        help=f"only write a MoE variant's kernel directory (one of {sorted(MOE_VARIANTS)}) and exit")
    args = parser.parse_args(argv)
    if args.write_moe_variant:
        name, directory = args.write_moe_variant
        if name not in MOE_VARIANTS:
            parser.error(f"--write-moe-variant: one of {sorted(MOE_VARIANTS)}")
        print(write_variant_dir(name, MOE_VARIANTS[name], pathlib.Path(directory)))
        return 0
    import cupy as cp
    import ml_dtypes

    names = [v for v in args.variants.split(",") if v]
    bad = sorted(set(names) - set(VARIANTS))
    if bad:
        parser.error(f"unknown variants {bad}; known: {sorted(VARIANTS)}")
    labels = {row[0].removeprefix("marlin "): row for row in OURS}
    cells = []
    for c in args.cells.split(","):
        shape, label, m = c.split(":")
        if label not in labels:
            parser.error(f"unknown label {label!r}; known: {sorted(labels)}")
        k, n = (int(x) for x in shape.split("x"))
        cells.append((k, n, labels[label], int(m)))
    dtypes = {"float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
    gpu, sms, l2, copy_gbs = device_summary(cp)
    args.out.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="ablation_"))
    mods = {name: variant_module(name, VARIANTS[name], tmp) for name in names}
    grid_settings = {"policy": variant(), "striped": variant(align_slices=False),
                     "aligned": variant(aligned_extra_steps=10**9)}
    grids = [g for g in args.grids.split(",") if g]
    if set(grids) - set(grid_settings):
        parser.error(f"--grids: one of {sorted(grid_settings)}")

    for name, mod in mods.items():
        cfgs = [mod.config_for(gemm.act_scalar_type(dtypes[dt]), wt, m, n, k, gs, False)
                for k, n, (_, wt, gs, dt), m in cells]
        mod.precompile(cfgs, workers=16)
    print("compiled", flush=True)
    rng = np.random.default_rng(0)
    rows = []
    tag = "".join(ch if ch.isalnum() else "_" for ch in gpu.lower()).strip("_")
    meta = dict(gpu=gpu, sms=sms, copy_gbs=round(copy_gbs, 1), date=datetime.date.today().isoformat(),
                commit=os.environ.get("BENCH_COMMIT", "working tree"), variants={k: VARIANTS[k] for k in names})

    def write():
        tmp_json = args.out / f"ablation_{tag}.json.part"
        tmp_json.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
        tmp_json.replace(args.out / f"ablation_{tag}.json")

    for k, n, (label, wt, gs, dt), m in cells:
        ws = [random_weight(cp, k, n, wt, gs, dtypes[dt], rng) for _ in range(copies_for(weight_bytes(k, n, wt, gs), l2))]
        a = [cp.asarray(rng.standard_normal((m, k), dtype=np.float32).astype(dtypes[dt])) for _ in range(2)]
        base_us = None
        for name, mod in mods.items():
            for gkind in grids:
                policy = grid_settings[gkind]
                c = cp.empty((m, n), dtype=dtypes[dt])
                work = cp.zeros(mod.workspace_numel(sms), dtype=np.int32)
                c_tmp = cp.empty(mod.c_tmp_numel(sms), dtype=np.float32)
                cfg = mod.config_for(gemm.act_scalar_type(dtypes[dt]), wt, m, n, k, gs, False, policy=policy)
                launches = [(lambda s, i=i, mod=mod, c=c, work=work, c_tmp=c_tmp: mod.marlin_gemm(
                    a[i % 2], ws[i % len(ws)], c=c, workspace=work, c_tmp=c_tmp, stream=s, policy=policy))
                    for i in range(LAUNCHES_PER_GRAPH)]
                us = time_cupy_graph(cp, launches)
                grid = mod.grid_blocks(cfg, m, n, k, sms, policy=policy)
                base_us = us if base_us is None else base_us
                gbs = (weight_bytes(k, n, wt, gs) + m * k * 2 + m * n * 2) / (us * 1e-6) / 1e9
                row = dict(k=k, n=n, m=m, label=label, variant=name, grid_kind=gkind, us=round(us, 3),
                           pct_copy=round(100 * gbs / copy_gbs, 1), vs_first=round(us / base_us, 3),
                           config=f"{cfg.n_tiles},{cfg.k_warp},{cfg.stages},b{cfg.blocks_per_sm}"
                           + ("s" if cfg.swap else ""), grid=grid)
                rows.append(row)
                print(f"K={k:6d} N={n:6d} M={m:3d} {label:24s} {name:14s} {gkind:8s} {us:8.2f} us  "
                      f"x{us / base_us:5.3f}  {row['pct_copy']:5.1f}% copy  {row['config']} grid {grid}", flush=True)
        del ws
        cp.get_default_memory_pool().free_all_blocks()
        write()  # after every cell: a run stopped by its time limit keeps what it measured
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
