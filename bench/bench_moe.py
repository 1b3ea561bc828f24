"""MoE GEMM-phase speed: the fused Marlin MoE kernel (``MarlinExpertStack.gemm_phase_fused``) on one gate_up-like
phase (K -> N per expert) of u4b8 g128 fp16 experts (or the microscaled formats: ``--formats``), in one run.

    python bench/bench_moe.py [--out bench/results] [--m 1,8,64,256] [--models mixtral,dsv3]
                              [--formats u4b8,nvfp4,mxfp4,mxfp8]

Models: Mixtral-like (8 experts, K=4096, N=14336, top-2), DeepSeek-V3-like (256 experts, K=7168, N=2048,
top-8) and gpt-oss-120b-like (``gptoss``: 128 experts, K=2880, N=5760, top-4), uniform random top-k routing (fixed
seed). Formats: u4b8 g128 fp16 (the default), and bf16 NVFP4 (group 16, S0E5M3 bytes, one fp32 global scale per
expert), MXFP4 and MXFP8 (group 32, E8M0 codes): random codes, the same kernel path as a real stack. Method: bench/timing.py; a graph's LAUNCHES calls each take
their own routing (``rotated_routings``: at decode sizes each avoids the experts of the call before, so no call
finds its weights in L2). Bytes = weights + scales of the experts a call touches (the mean over the routings)
+ A + C; ``gbs`` = bytes / time. ``pdl``: programmatic dependent launches (MoePolicy) on or off. The alignment
(``moe_align_block_size``) is not in the time. ``--peers humming``: humming's indexed MoE GEMM (its own random
int4 g128 stack, its heuristic's block size, the same routings aligned to that block) beside ours, once its
kernels are compiled (``--humming-ready``: ``peers.py jit-humming --moe``). Writes OUT/moe.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import timing  # noqa: E402

MODELS = {"mixtral": (8, 4096, 14336, 2), "dsv3": (256, 7168, 2048, 8),
          "gptoss": (128, 2880, 5760, 4)}  # experts, K, N, top-k
M_VALUES = (1, 8, 64, 256)
GROUP = 128
# format -> (weight bits, group, scale bytes, activation): u4b8's 16-bit scales, the microscaled formats' bytes
FORMATS = {"u4b8": (4, GROUP, 2, "fp16"), "nvfp4": (4, 16, 1, "bf16"), "mxfp4": (4, 32, 1, "bf16"),
           "mxfp8": (8, 32, 1, "bf16")}


def touched_bytes(experts: int, k: int, n: int, fmt: str = "u4b8") -> int:
    bits, group, scale_bytes, _ = FORMATS[fmt]
    return experts * (k * n * bits // 8 + -(-k // group) * n * scale_bytes)  # (a partial last group: K = 2880)


def make_stack(fmt: str, e: int, k: int, n: int):
    """A random expert stack of one format on the GPU (codes and scales drawn at random, in range: timing only)."""
    import cupy as cp
    import ml_dtypes

    from workbench import moe
    from workbench.scalar_types import ScalarType
    from workbench.weight import MarlinWeight

    bits, group, _, act = FORMATS[fmt]
    words = cp.random.randint(-2**31, 2**31 - 1, size=(e, k // 16, n * bits // 2), dtype=np.int64).astype(np.int32)
    if fmt == "u4b8":
        groups = -(-k // GROUP)  # ceil: gpt-oss's K = 2880 ends in a partial group of 64 rows
        scales = (cp.random.random((e, groups, n), dtype=np.float32) * 0.01 + 0.001).astype(np.float16)
        return moe.MarlinExpertStack(MarlinWeight(words, scales, None, None, None, k, n, GROUP, ScalarType.U4B8,
                                                  np.dtype(np.float16), num_experts=e)), np.float16
    # NVFP4: S0E5M3 bytes of scales near 1; MX: E8M0 codes near 2^-6
    lo, hi = (0x30, 0x40) if fmt == "nvfp4" else (118, 124)
    scales = cp.random.randint(lo, hi, size=(e, k // group, n), dtype=np.int32).astype(np.uint8)
    wt = ScalarType.FE4M3FN if fmt == "mxfp8" else ScalarType.FE2M1F
    dtype = np.dtype(ml_dtypes.bfloat16)
    gs = cp.full(e, 2.0 ** 100, dtype=np.float32) if fmt == "nvfp4" else None  # (bf16: ~2^119 / scale factor)
    return moe.MarlinExpertStack(MarlinWeight(words, scales, None, None, None, k, n, group, wt, dtype,
                                              num_experts=e), global_scale=gs), dtype


def draw_routing(rng, m: int, pool, top_k: int) -> np.ndarray:
    """(m, top_k) distinct experts per token, drawn uniformly from ``pool``."""
    return np.stack([rng.choice(pool, top_k, replace=False) for _ in range(m)]).astype(np.int32)


def rotated_routings(rng, m: int, e: int, top_k: int, count: int) -> list[np.ndarray]:
    """``count`` routings of m tokens. Where the previous routing touched at most a quarter of the experts (decode
    sizes), the next is drawn from the others, so it finds none of its weights in L2; else from all (a pool cut to
    the few experts left would touch fewer and change the work)."""
    out, previous = [], set()
    for _ in range(count):
        pool = np.array([x for x in range(e) if x not in previous]) if 4 * len(previous) <= e else np.arange(e)
        ids = draw_routing(rng, m, pool, top_k)
        previous = set(ids.reshape(-1).tolist())
        out.append(ids)
    return out


def precompile(models, formats, ms) -> None:
    """Every fused kernel the run launches (fused_grid's choice), compiled up front in parallel threads (NVRTC runs
    outside the GIL; one at a time, the first launch of each would take seconds)."""
    from concurrent.futures import ThreadPoolExecutor

    import cupy as cp

    from workbench import gemm, moe
    from workbench.formats.moe_align import aligned_capacity
    from workbench.scalar_types import ScalarType

    device = cp.cuda.Device().id
    _, sms, smem, sm_smem = gemm.device_properties(device)
    names = set()
    for model in models:
        e, k, n, top_k = MODELS[model]
        for fmt in formats:
            _, group, _, act = FORMATS[fmt]
            wt = {"u4b8": ScalarType.U4B8, "mxfp8": ScalarType.FE4M3FN}.get(fmt, ScalarType.FE2M1F)
            a = ScalarType.F16 if act == "fp16" else ScalarType.BF16
            for m in ms:
                block = moe.choose_block_size(m, top_k, e)
                numel = m * top_k
                items = min(aligned_capacity(numel, block, e) // block, numel)
                cfg = moe.choose_moe_config(a, wt, block, n, k, group, items, sms, smem, sm_smem,
                                            e8m0_scales=fmt in ("mxfp4", "mxfp8"))
                names.add((cfg.name_expression, cfg.smem_bytes))
    with ThreadPoolExecutor(max_workers=16) as pool:
        for job in [pool.submit(moe.get_moe_kernel, name, device, smem_bytes) for name, smem_bytes in names]:
            job.result()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "bench" / "results"), type=pathlib.Path)
    p.add_argument("--m", default=",".join(map(str, M_VALUES)))
    p.add_argument("--models", default="mixtral,dsv3")
    p.add_argument("--formats", default="u4b8", help="u4b8,nvfp4,mxfp4,mxfp8")
    p.add_argument("--launch", default="graph,plain")
    p.add_argument("--peers", default="", help="humming")
    p.add_argument("--peers-src", default=str(ROOT / "_dev" / "peers_src"), type=pathlib.Path)
    p.add_argument("--humming-ready", help="PREFIX: time humming on a model only once PREFIX.moe.MODEL exists")
    args = p.parse_args(argv)
    t_start = time.time()
    import cupy as cp
    import torch

    from workbench import gemm, moe
    from workbench.formats.moe_align import moe_align_block_size as align_ref
    from workbench.policy import DEFAULT_MOE_POLICY
    from workbench.scalar_types import ScalarType
    from workbench.weight import MarlinWeight

    dev = timing.device()
    ceil = timing.ceilings(dev)
    launches = args.launch.split(",")
    programmatic = gemm.programmatic_launches(torch.cuda.current_device())
    policies = {programmatic: DEFAULT_MOE_POLICY}
    if programmatic:
        policies[False] = dataclasses.replace(DEFAULT_MOE_POLICY, programmatic_launch=False,
                                              gemm=dataclasses.replace(DEFAULT_MOE_POLICY.gemm,
                                                                       programmatic_launch=False))
    rng = np.random.default_rng(0)
    rows, notes, versions = [], {}, {}
    use_humming = "humming" in args.peers.split(",")
    if use_humming:
        import peers as peer_mod

        versions["humming"] = peer_mod.peer_versions(args.peers_src).get("humming", "unknown")
    precompile(args.models.split(","), args.formats.split(","), [int(v) for v in args.m.split(",")])
    for model, fmt in ((mo, f) for mo in args.models.split(",") for f in args.formats.split(",")):
        e, k, n, top_k = MODELS[model]
        stack, act_dtype = make_stack(fmt, e, k, n)
        hum = None
        if fmt != "u4b8":
            use_humming_here = False  # (humming's MoE GEMM is int4 only)
        else:
            use_humming_here = use_humming
        if use_humming_here and args.humming_ready and \
                not pathlib.Path(f"{args.humming_ready}.moe.{model}").exists():
            notes[f"humming_{model}"] = "skipped: its kernels were not compiled in time"
        elif use_humming_here:
            try:
                hum = peer_mod.HummingMoE(args.peers_src, e, k, n, top_k, GROUP)
            except Exception as exc:
                notes[f"humming_{model}"] = f"{type(exc).__name__}: {str(exc)[-300:]}"
                print(notes[f"humming_{model}"], flush=True)
        for m in (int(v) for v in args.m.split(",")):
            block = moe.choose_block_size(m, top_k, e)
            routings = rotated_routings(rng, m, e, top_k, timing.LAUNCHES)
            aligned = [tuple(cp.asarray(x) for x in align_ref(ids, block, e)) for ids in routings]
            touched = float(np.mean([len(np.unique(ids)) for ids in routings]))
            nbytes = touched_bytes(1, k, n, fmt) * touched + m * k * 2 + m * top_k * n * 2
            a = cp.asarray(rng.standard_normal((m, k), dtype=np.float32).astype(act_dtype))
            out = cp.empty((m * top_k, n), dtype=act_dtype)

            def launch_list(policy):
                return [(lambda r=r: stack.gemm_phase_fused(a, *r, out, m, block, top_k, policy=policy,
                                                            stream=torch.cuda.current_stream().cuda_stream))
                        for r in aligned]

            timers, blocks = {}, {}
            if hum is not None:
                try:
                    hb = hum.block(m)
                    h_aligned = [tuple(torch.from_dlpack(cp.asarray(x)) for x in align_ref(ids, hb, e))
                                 for ids in routings]
                    h_aligned = [(s_, e_, p_.reshape(())) for s_, e_, p_ in h_aligned]
                    a_t = torch.from_dlpack(a)
                    h_out = torch.empty(m * top_k, n, dtype=torch.float16, device="cuda")
                    h_list = [(lambda r=r: hum.call(a_t, *r, h_out, m)) for r in h_aligned]
                    for launch in launches:
                        timers[("humming", launch)] = (timing.GraphTimer if launch == "graph"
                                                       else timing.PlainTimer)(h_list)
                    blocks["humming"] = hb
                except Exception as exc:
                    notes[f"humming_{model}_m{m}"] = f"{type(exc).__name__}: {str(exc)[-300:]}"
                    print(notes[f"humming_{model}_m{m}"], flush=True)
            for pdl, pol in policies.items():
                for launch in launches:
                    if launch == "plain" and pdl is False and programmatic:
                        continue
                    timers[(pdl, launch)] = (timing.GraphTimer if launch == "graph" else timing.PlainTimer)(
                        launch_list(pol))
            stats = timing.interleaved(timers)
            for (pdl, launch), st in stats.items():
                method = "humming" if pdl == "humming" else "ours"
                row = dict(model=model, experts=e, topk=top_k, n=n, k=k, m=m, wtype=fmt, group=FORMATS[fmt][1],
                           act=FORMATS[fmt][3],
                           launch=launch, method=method, path="fused" if method == "ours" else "indexed",
                           us=round(st["us"], 3), q1=round(st["q1"], 3), q3=round(st["q3"], 3),
                           moe_block_size=blocks.get(method, block),
                           experts_touched=round(touched, 1), gbs=round(timing.gbs(nbytes, st["us"]), 1),
                           pct_copy=round(100 * timing.gbs(nbytes, st["us"]) / ceil["copy_gbs"], 1))
                if method == "ours":
                    row["pdl"] = bool(pdl)
                rows.append(row)
                print(f"{model:8s} {fmt:6s} M={m:4d} touched={touched:6.1f} {method:8s} {launch:5s} pdl={pdl!s:7s} "
                      f"{st['us']:9.2f} us "
                      f"{row['gbs']:7.0f} GB/s {row['pct_copy']:5.1f}% copy", flush=True)
        del stack, hum
        cp.get_default_memory_pool().free_all_blocks()
    meta = timing.meta(ROOT, dev, ceil, {"launch": launches, "programmatic_launch": programmatic,
                                         "routing": "uniform top-k, rotated per call (bench_moe.rotated_routings)",
                                         "wall_s": round(time.time() - t_start, 1), "notes": notes}, versions)
    timing.write_results(args.out, "moe", meta, rows)
    print(f"wrote {args.out / 'moe.json'} ({len(rows)} rows)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
