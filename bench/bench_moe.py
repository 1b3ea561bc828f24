"""MoE GEMM-phase speed: the fused Marlin MoE kernel (``MarlinExpertStack.gemm_phase_fused``) on one gate_up-like
phase (K -> N per expert) of u4b8 g128 fp16 experts, in one run.

    python bench/bench_moe.py [--out bench/results] [--m 1,8,64,256] [--models mixtral,dsv3]

Models: Mixtral-like (8 experts, K=4096, N=14336, top-2) and DeepSeek-V3-like (256 experts, K=7168, N=2048,
top-8), uniform random top-k routing (fixed seed). Method: bench/timing.py; a graph's LAUNCHES calls each take
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

MODELS = {"mixtral": (8, 4096, 14336, 2), "dsv3": (256, 7168, 2048, 8)}  # experts, K, N, top-k
M_VALUES = (1, 8, 64, 256)
GROUP = 128


def touched_bytes(experts: int, k: int, n: int) -> int:
    return experts * (k * n // 2 + (k // GROUP) * n * 2)


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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "bench" / "results"), type=pathlib.Path)
    p.add_argument("--m", default=",".join(map(str, M_VALUES)))
    p.add_argument("--models", default=",".join(MODELS))
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
    for model in args.models.split(","):
        e, k, n, top_k = MODELS[model]
        words = cp.random.randint(-2**31, 2**31 - 1, size=(e, k // 16, n * 2), dtype=np.int64).astype(np.int32)
        scales = (cp.random.random((e, k // GROUP, n), dtype=np.float32) * 0.01 + 0.001).astype(np.float16)
        stack = moe.MarlinExpertStack(MarlinWeight(words, scales, None, None, None, k, n, GROUP, ScalarType.U4B8,
                                                   np.dtype(np.float16), num_experts=e))
        hum = None
        if use_humming and args.humming_ready and not pathlib.Path(f"{args.humming_ready}.moe.{model}").exists():
            notes[f"humming_{model}"] = "skipped: its kernels were not compiled in time"
        elif use_humming:
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
            nbytes = touched_bytes(1, k, n) * touched + m * k * 2 + m * top_k * n * 2
            a = cp.asarray(rng.standard_normal((m, k), dtype=np.float32).astype(np.float16))
            out = cp.empty((m * top_k, n), dtype=np.float16)

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
                row = dict(model=model, experts=e, topk=top_k, n=n, k=k, m=m, wtype="u4b8", group=GROUP, act="fp16",
                           launch=launch, method=method, path="fused" if method == "ours" else "indexed",
                           us=round(st["us"], 3), q1=round(st["q1"], 3), q3=round(st["q3"], 3),
                           moe_block_size=blocks.get(method, block),
                           experts_touched=round(touched, 1), gbs=round(timing.gbs(nbytes, st["us"]), 1),
                           pct_copy=round(100 * timing.gbs(nbytes, st["us"]) / ceil["copy_gbs"], 1))
                if method == "ours":
                    row["pdl"] = bool(pdl)
                rows.append(row)
                print(f"{model:8s} M={m:4d} touched={touched:6.1f} {method:8s} {launch:5s} pdl={pdl!s:7s} {st['us']:9.2f} us "
                      f"{row['gbs']:7.0f} GB/s {row['pct_copy']:5.1f}% copy", flush=True)
        del stack, words, scales, hum
        cp.get_default_memory_pool().free_all_blocks()
    meta = timing.meta(ROOT, dev, ceil, {"launch": launches, "programmatic_launch": programmatic,
                                         "routing": "uniform top-k, rotated per call (bench_moe.rotated_routings)",
                                         "wall_s": round(time.time() - t_start, 1), "notes": notes}, versions)
    timing.write_results(args.out, "moe", meta, rows)
    print(f"wrote {args.out / 'moe.json'} ({len(rows)} rows)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
