"""How the MoE table's single-call timing compares with bench_gemm's graph timing (round 11, after r11e): the fused
MoE phase, and the dense GEMM on the same bytes (the top_k experts' columns side by side: K x top_k N), each timed

* single, write flush: bench_moe's table method (a 512 MiB memset, then events around one call; median). The memset
  leaves L2 full of dirty lines that the timed call's reads must write back first;
* single, read flush: the same with the flush buffer read instead (L2 left holding clean lines);
* graph: a CUDA graph of 20 calls (bench_gemm's method), per call, on rotated inputs — the MoE phase on 20 routings,
  each disjoint from the one before it; the dense GEMM on enough weight copies to leave L2 (bench_gemm.copies_for).

    usage: python bench/probe_moe_decode.py --out DIR   (GPU; Mixtral-, DeepSeek-V2-Lite- and V3-like, M = 1 and 8)
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_gemm import LAUNCHES_PER_GRAPH, copies_for, l2_bytes, random_weight, time_cupy_graph  # noqa: E402
from bench_moe import (CONFIGS, FLUSH_BYTES, GROUP, SPIN_SOURCE, SPIN_US, copy_bandwidth, random_stack,  # noqa: E402
                       rotated_routings, timed, touched_bytes)
from workbench import gemm, moe  # noqa: E402
from workbench.scalar_types import ScalarType as S  # noqa: E402

REPS = 15


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=pathlib.Path)
    parser.add_argument("--m", default="1,8")
    args = parser.parse_args(argv)
    import cupy as cp

    args.out.mkdir(parents=True, exist_ok=True)
    copy_gbs = copy_bandwidth(cp)
    spin = cp.RawKernel(SPIN_SOURCE, "spin")
    flush = cp.empty(FLUSH_BYTES, dtype=np.uint8)
    rng = np.random.default_rng(0)

    def single(fn, read_flush: bool) -> float:
        return timed(cp, fn, flush, lambda: spin((1,), (1,), (np.int64(SPIN_US * 2100),)), read_flush, REPS)

    rows = []
    for name, e, k, n, top_k in CONFIGS:
        stack = moe.MarlinExpertStack(random_stack(cp, e, k, n))
        for m in (int(x) for x in args.m.split(",")):
            routings, touched = rotated_routings(cp, rng, m, e, top_k, LAUNCHES_PER_GRAPH)
            a = cp.asarray(rng.standard_normal((m, k), dtype=np.float32).astype(np.float16))
            out = cp.empty((m * top_k, n), dtype=np.float16)
            block = moe.choose_block_size(m, top_k, e)

            def phase(i=0, stream=None):
                stack.gemm_phase_fused(a, *routings[i], out, m, block, top_k, stream=stream)

            nbytes = touched_bytes(touched[0], k, n)  # (the first routing's, for the single calls)
            graph_bytes = float(np.mean([touched_bytes(t, k, n) for t in touched]))
            dense_n = touched[0] * n
            copies = copies_for(touched_bytes(touched[0], k, n), l2_bytes(cp))
            dense_ws = [random_weight(cp, k, dense_n, S.U4B8, GROUP, np.float16, rng) for _ in range(copies)]
            c = cp.empty((m, dense_n), dtype=np.float16)
            graph = range(LAUNCHES_PER_GRAPH)
            timings = dict(
                fused_single_write=(single(phase, False), nbytes),
                fused_single_read=(single(phase, True), nbytes),
                fused_graph=(time_cupy_graph(cp, [lambda s, i=i: phase(i, s) for i in graph]), graph_bytes),
                dense_single_write=(single(lambda: gemm.marlin_gemm(a, dense_ws[0], c=c), False), nbytes),
                dense_single_read=(single(lambda: gemm.marlin_gemm(a, dense_ws[0], c=c), True), nbytes),
                dense_graph=(time_cupy_graph(cp, [lambda s, i=i: gemm.marlin_gemm(a, dense_ws[i % copies], c=c,
                                                                                  stream=s) for i in graph]), nbytes))
            for method, (t, b) in timings.items():
                pct = 100 * b / (t * 1e-6) / 1e9 / copy_gbs
                rows.append(dict(config=name, m=m, method=method, us=round(t, 2), pct_copy=round(pct, 1)))
                print(f"{name:10s} M={m:3d} {method:20s} {t:8.2f} us {pct:5.1f}% copy", flush=True)
            del dense_ws
        del stack
        cp.get_default_memory_pool().free_all_blocks()
    (args.out / "probe_moe_decode.json").write_text(json.dumps(dict(copy_gbs=round(copy_gbs, 1), rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
