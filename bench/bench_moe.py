"""MoE GEMM-phase speed on the lent GPU: the fused Marlin MoE kernel vs the batched path (one dense Marlin GEMM per
expert over streams) vs a loop of dense calls on one stream vs dequantize-and-matmul in PyTorch, in one run.

    python bench/bench_moe.py --out DIR [--quick]

Method
* One GEMM phase (gate_up-like: K -> N per expert) of u4b8 g128 fp16 experts: Mixtral-like (8 experts, K=4096,
  N=14336, top-2), DeepSeek-V2-Lite-like (64, K=2048, N=1408, top-6), DeepSeek-V3-like (256, K=7168, N=2048, top-8),
  at M = 1, 8, 64, 256 tokens with uniform random top-k routing (fixed seed).
* Weights are random words (speed does not depend on values; correctness is tests/gpu's job).
* L2 is flushed (a 512 MiB memset) before every timed call; each call is timed alone with device events around it
  (host launch gaps inside a path are part of that path's cost); the median of REPS calls is reported.
* Bytes touched = weights + scales of the experts that receive at least one token. Effective GB/s = those bytes /
  time; "% copy" compares it with a device-to-device copy (read + written bytes) measured in the same run.
* The fused time covers the GEMM launch only; moe_align_block_size (Numba) is timed separately.
Writes DIR/moe_<gpu>.json and DIR/moe_<gpu>.md.
"""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

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


def timed(cp, fn, flush) -> float:
    """Median µs of fn() over REPS calls, each after an L2 flush, each alone between two events."""
    fn()  # warm-up (compilation, allocator)
    cp.cuda.Device().synchronize()
    times = []
    for _ in range(REPS):
        flush.fill(0)
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop) * 1e3)
    return float(np.median(times))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=pathlib.Path)
    parser.add_argument("--quick", action="store_true", help="first config, M = 1 and 64 only")
    parser.add_argument("--no-torch", action="store_true")
    args = parser.parse_args(argv)
    import cupy as cp

    from kernels_numba.moe_align import moe_align_block_size

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
    rng = np.random.default_rng(0)
    rows = []
    configs = CONFIGS[:1] if args.quick else CONFIGS
    m_values = (1, 64) if args.quick else M_VALUES
    for name, e, k, n, top_k in configs:
        w = random_stack(cp, e, k, n)
        stack = moe.MarlinExpertStack(w)
        t_scales = None
        if torch is not None:
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
            experts = [w.expert(int(x)) for x in range(e)]
            d_ids = cp.asarray(ids)

            def fused():
                stack.gemm_phase_fused(a, sorted_ids, expert_ids, post, out_fused, m, block, top_k)

            def batched():
                stack.gemm_phase_batched(a_sorted, dispatches, out_rows)

            def dense_loop():
                for x, r0, _, c in dispatches:
                    gemm.marlin_gemm(a_sorted[r0:r0 + c], experts[x], c=out_rows[r0:r0 + c])

            def align():
                moe_align_block_size(d_ids, block, e)

            paths = {"fused": fused, "batched": batched, "dense loop": dense_loop}
            if torch is not None:
                t_a = torch.from_dlpack(a_sorted)

                def torch_dequant_matmul():
                    for x, r0, _, c in dispatches:
                        q = t_words[x].view(k // 8, n)
                        codes = ((q.unsqueeze(1) >> shifts) & 0xF).view(k, n)  # (K, N) 4-bit codes
                        wx = (codes.to(torch.float16) - 8) * t_scales[x].repeat_interleave(GROUP, dim=0)
                        torch.matmul(t_a[r0:r0 + c], wx)

                paths["torch dequant+matmul"] = torch_dequant_matmul
            align_us = timed(cp, align, flush)
            for method, fn in paths.items():
                us = timed(cp, fn, flush)
                gbs = nbytes / (us * 1e-6) / 1e9
                row = dict(gpu=gpu, config=name, experts=e, k=k, n=n, top_k=top_k, m=m, experts_touched=int(len(used)),
                           moe_block_size=block, method=method, us=round(us, 2), gbs=round(gbs, 1),
                           pct_copy=round(100 * gbs / copy_gbs, 1), align_us=round(align_us, 2))
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
             "| config | M | experts touched | block | fused µs | batched µs | dense loop µs | torch µs | fused GB/s "
             "| fused % copy | align µs |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    by = {}
    for r in rows:
        by.setdefault((r["config"], r["m"]), {})[r["method"]] = r
    for (cfg, m), d in by.items():
        f = d["fused"]
        t = d.get("torch dequant+matmul")
        lines.append(f"| {cfg} (E={f['experts']}, K={f['k']}, N={f['n']}, top-{f['top_k']}) | {m} | "
                     f"{f['experts_touched']} | {f['moe_block_size']} | {f['us']} | {d['batched']['us']} | "
                     f"{d['dense loop']['us']} | {t['us'] if t else '—'} | {f['gbs']} | {f['pct_copy']} | "
                     f"{f['align_us']} |")
    (args.out / f"moe_{tag}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
