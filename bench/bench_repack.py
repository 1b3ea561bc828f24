"""Repack speed: the public ops ``gptq_marlin_repack`` / ``awq_marlin_repack`` (backend numba) beside vLLM's
ops of the same names, same inputs, outputs compared bit for bit, in one run.

    python bench/bench_repack.py [--out bench/results] [--peers-src _dev/peers_src] [--no-vllm]

Method: bench/timing.py's isolated call (the ops allocate their outputs): an L2 flush, a spin kernel ahead of the
start event, one call, the median of interleaved rounds (launch "isolated": device time); launch "plain": the same
without the spin (the host's time to issue the call shows where it exceeds the device's). Bytes = the packed weight read + the Marlin tiles
written; ``pct_copy`` compares that with the device copy measured in the same run. Inputs are random words (a
repack moves bits; their values do not change its cost). Writes OUT/repack.json.
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import timing  # noqa: E402

LAYERS = ((4096, 14336), (14336, 4096), (8192, 8192), (8192, 28672), (28672, 8192))  # (K, N)
OPS = (("gptq_marlin_repack", 4, "u4b8"), ("gptq_marlin_repack", 8, "u8b128"), ("awq_marlin_repack", 4, "u4"),
       ("gptq_marlin_repack act-order", 4, "u4b8"))  # act-order: a random device perm (ours checks it: a sync)
ROUNDS = 11


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "bench" / "results"), type=pathlib.Path)
    p.add_argument("--peers-src", default=str(ROOT / "_dev" / "peers_src"), type=pathlib.Path)
    p.add_argument("--no-vllm", action="store_true")
    p.add_argument("--layers", default="", help="KxN,... (default: five layers 4096x14336 .. 28672x8192)")
    args = p.parse_args(argv)
    t_start = time.time()
    import cupy as cp
    import torch

    from workbench import ops

    dev = timing.device()
    ceil = timing.ceilings(dev)
    layers = [tuple(int(v) for v in s.split("x")) for s in args.layers.split(",")] if args.layers else list(LAYERS)
    notes, versions, vllm = {}, {}, None
    if not args.no_vllm:
        import peers as peer_mod

        try:
            vllm, secs = peer_mod.build_vllm_repack(args.peers_src)  # the repack ops alone: three files
            versions["vllm_marlin"] = peer_mod.peer_versions(args.peers_src).get("vllm_marlin", "unknown")
            notes["vllm_marlin_build_s"] = round(secs, 1)
        except Exception as exc:
            notes["vllm_marlin"] = f"not built: {type(exc).__name__}: {str(exc)[-400:]}"
            print(notes["vllm_marlin"], flush=True)
    rows = []
    for k, n in layers:
        for op, bits, wtype in OPS:
            pf = 32 // bits
            gptq = op.startswith("gptq_marlin_repack")
            shape = (k // pf, n) if gptq else (k, n // pf)
            src = cp.asarray(cp.random.randint(-2**31, 2**31 - 1, size=shape, dtype=cp.int64).astype(cp.int32))
            src_t = torch.from_dlpack(src)  # the same memory
            if op.endswith("act-order"):
                ours_perm = cp.random.permutation(k).astype(cp.int32)
                perm = torch.from_dlpack(ours_perm)
            else:
                ours_perm, perm = None, torch.empty(0, dtype=torch.int32, device="cuda")

            def stream():
                return torch.cuda.current_stream().cuda_stream

            if gptq:
                def ours():
                    return ops.gptq_marlin_repack(src, ours_perm, k, n, bits, backend="numba", stream=stream())

                def peer():
                    return vllm.gptq_marlin_repack(src_t, perm, k, n, bits)
            else:
                def ours():
                    return ops.awq_marlin_repack(src, k, n, bits, backend="numba", stream=stream())

                def peer():
                    return vllm.awq_marlin_repack(src_t, k, n, bits)

            timers = {("ours", "isolated"): timing.IsolatedTimer(ours, dev.l2_bytes),
                      ("ours", "plain"): timing.IsolatedTimer(ours, dev.l2_bytes, spin=False)}
            equal = None
            if vllm is not None:
                timers[("vllm_marlin", "isolated")] = timing.IsolatedTimer(peer, dev.l2_bytes)
                timers[("vllm_marlin", "plain")] = timing.IsolatedTimer(peer, dev.l2_bytes, spin=False)
                a, b = torch.from_dlpack(ours()), peer()
                torch.cuda.synchronize()
                equal = bool(a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32)))
            stats = timing.interleaved(timers, ROUNDS)
            nbytes = 2 * k * n * bits // 8 + (4 * k if ours_perm is not None else 0)
            for (method, launch), st in stats.items():
                g = timing.gbs(nbytes, st["us"])
                row = dict(op=op, n=n, k=k, wtype=wtype, method=method, launch=launch, us=round(st["us"], 2),
                           q1=round(st["q1"], 2), q3=round(st["q3"], 2), gbs=round(g, 1),
                           pct_copy=round(100 * g / ceil["copy_gbs"], 1))
                if equal is not None:
                    row["bitwise_equal_vllm"] = equal
                rows.append(row)
                print(f"{op:20s} {wtype:7s} {k:6d}x{n:<6d} {method:12s} {launch:8s} {st['us']:9.1f} us {g:7.0f} GB/s "
                      f"{row['pct_copy']:5.1f}% copy equal={equal}", flush=True)
            del timers, src, src_t, ours_perm, perm
            cp.get_default_memory_pool().free_all_blocks()
    meta = timing.meta(ROOT, dev, ceil, {"launch": ["isolated", "plain"], "rounds": ROUNDS, "spin_ns": timing.SPIN_NS, "flush_bytes":
                                         timing.FLUSH_MULTIPLE * dev.l2_bytes, "notes": notes,
                                         "wall_s": round(time.time() - t_start, 1)}, versions)
    timing.write_results(args.out, "repack", meta, rows)
    print(f"wrote {args.out / 'repack.json'} ({len(rows)} rows)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
