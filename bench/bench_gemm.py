"""Marlin GEMM speed on the lent GPU, side by side with cuBLAS fp16 (torch.matmul) and tinygemm
(torch._weight_int4pack_mm, bf16 W4 g128), in one run.

    python bench/bench_gemm.py --out DIR [--quick]

Method
* Each measurement is a CUDA graph of R launches that cycle through enough copies of the inputs (weights,
  activations, scales) to exceed 3x the L2 cache, so every launch reads its weights from HBM; the graph removes
  Python launch overhead. Time = device events around graph replays / R.
* On sm_90 ours launch as programmatic dependent launches (GemmPolicy.programmatic_launch): each launch in a
  graph may start while the one before finishes. PLAIN_TOO's types are timed again with plain launches.
* Weights for timing are random words (speed does not depend on their values); correctness is tests/gpu's job.
* Bytes the kernel must move = weights + scales (+ zero points) + A + C. Effective GB/s = those bytes / time;
  "% copy" compares it with a device-to-device copy (read + write) measured in the same run.
Writes DIR/gemm_<gpu>.json, DIR/gemm_<gpu>.csv and DIR/gemm_<gpu>.md (the table for BENCHMARKS.md).
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import json
import math
import os
import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from workbench import gemm  # noqa: E402
from workbench.policy import DEFAULT_GEMM_POLICY, DEFAULT_MOE_POLICY  # noqa: E402
from workbench.scalar_types import ScalarType as S  # noqa: E402

M_VALUES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
SHAPES = ((4096, 4096), (4096, 14336), (14336, 4096), (8192, 8192), (8192, 28672), (28672, 8192))
# (label, weight type, group size, activation dtype name)
OURS = (
    ("marlin u4b8 g128 fp16", S.U4B8, 128, "float16"),
    ("marlin u4 g128+zp fp16", S.U4, 128, "float16"),
    ("marlin u8b128 g128 fp16", S.U8B128, 128, "float16"),
    ("marlin fe4m3fn chan fp16", S.FE4M3FN, -1, "float16"),
    ("marlin u4b8 g128 bf16", S.U4B8, 128, "bfloat16"),
)
# Timed a second time with plain launches where ours launch programmatically (sm_90): a GEMM's programmatic launch
# gains only after a kernel that lets it start early, as the GEMM before it in these graphs does; in a model the
# kernel before is often one that does not (GemmPolicy.programmatic_launch), so both are reported.
PLAIN_TOO = ("marlin u4b8 g128 fp16", "marlin fe4m3fn chan fp16")
L2_MULTIPLE = 3
LAUNCHES_PER_GRAPH = 20
REPLAYS = 5


def l2_bytes(cp) -> int:
    return int(cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["l2CacheSize"])


# ours with plain launches (no programmatic dependent launch), beside the default's on sm_90
PLAIN_POLICY = dataclasses.replace(DEFAULT_GEMM_POLICY, programmatic_launch=False)
PLAIN_MOE_POLICY = dataclasses.replace(DEFAULT_MOE_POLICY, programmatic_launch=False, gemm=PLAIN_POLICY)


def device_summary(cp):
    """(name, SMs, L2 bytes, copy GB/s) of the current device, printed as the A/B and probe scripts start."""
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    gpu = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    sms = props["multiProcessorCount"]
    copy_gbs = copy_bandwidth(cp)
    print(f"{gpu}: {sms} SMs, copy {copy_gbs:.0f} GB/s", flush=True)
    return gpu, sms, l2_bytes(cp), copy_gbs


def copies_for(nbytes: int, l2: int) -> int:
    return max(2, math.ceil(L2_MULTIPLE * l2 / max(nbytes, 1)))


def time_cupy_graph(cp, launches) -> float:
    """Mean µs per launch of `launches` (callables taking a stream), captured once as one graph."""
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        for f in launches[:2]:  # warm-up outside capture (first-use compilation, allocator)
            f(stream)
        stream.begin_capture()
        for f in launches:
            f(stream)
        graph = stream.end_capture()
        graph.launch(stream)
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record(stream)
        for _ in range(REPLAYS):
            graph.launch(stream)
        stop.record(stream)
        stop.synchronize()
    return cp.cuda.get_elapsed_time(start, stop) * 1e3 / (REPLAYS * len(launches))


# The copy kernel of time_copy_graph: four 16-byte words per thread, each warp's loads coalesced.
COPY_SOURCE = r"""
extern "C" __global__ void copy_words(const int4* __restrict__ src, int4* __restrict__ dst, long long n) {
  long long i = (long long)blockIdx.x * blockDim.x * 4 + threadIdx.x;
  int4 v[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) if (i + j * blockDim.x < n) v[j] = src[i + j * blockDim.x];
#pragma unroll
  for (int j = 0; j < 4; ++j) if (i + j * blockDim.x < n) dst[i + j * blockDim.x] = v[j];
}
"""


def time_copy_graph(cp, nbytes: int, l2: int) -> float:
    """Mean µs of a device copy that moves ``nbytes`` (nbytes / 2 read, nbytes / 2 written), timed as the kernels
    are: LAUNCHES_PER_GRAPH copies back to back in a graph, their buffers rotated past L2; the faster of a copy
    kernel (COPY_SOURCE) and cudaMemcpyAsync (which a graph may hand to a copy engine). The copy ceiling at that
    size: a launch's fixed costs weigh on a small copy as on a small GEMM."""
    half = max(nbytes // 2 // 16 * 16, 16)
    words = half // 16
    pairs = [(cp.empty(half, dtype=np.uint8), cp.empty(half, dtype=np.uint8))
             for _ in range(min(LAUNCHES_PER_GRAPH, copies_for(half, l2)))]
    for src, _ in pairs:
        src.fill(1)
    kernel = cp.RawKernel(COPY_SOURCE, "copy_words")
    blocks = -(-words // (256 * 4))
    d2d = cp.cuda.runtime.memcpyDeviceToDevice

    def pair(i):
        return pairs[i % len(pairs)]

    by_kernel = [(lambda s, i=i: kernel((blocks,), (256,), (pair(i)[0], pair(i)[1], np.int64(words)), stream=s))
                 for i in range(LAUNCHES_PER_GRAPH)]
    by_memcpy = [(lambda s, i=i: cp.cuda.runtime.memcpyAsync(pair(i)[1].data.ptr, pair(i)[0].data.ptr, half, d2d,
                                                             s.ptr))
                 for i in range(LAUNCHES_PER_GRAPH)]
    return min(time_cupy_graph(cp, by_kernel), time_cupy_graph(cp, by_memcpy)) * (nbytes / (2 * half))


def time_torch_graph(torch, launches) -> float:
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for f in launches[:2]:
            f()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for f in launches:
            f()
    graph.replay()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) * 1e3 / (REPLAYS * len(launches))


def copy_bandwidth(cp) -> float:
    """GB/s of a 1 GiB device-to-device copy, counting bytes read + written."""
    n = 1 << 30
    src = cp.empty(n, dtype=np.uint8)
    dst = cp.empty(n, dtype=np.uint8)
    src.fill(1)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        dst[...] = src
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record(stream)
        for _ in range(10):
            cp.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, n, cp.cuda.runtime.memcpyDeviceToDevice,
                                        stream.ptr)
        stop.record(stream)
        stop.synchronize()
    seconds = cp.cuda.get_elapsed_time(start, stop) / 1e3 / 10
    return 2 * n / seconds / 1e9


def random_weight(cp, k, n, wt, gs, act_dtype, rng):
    """A MarlinWeight-shaped set of device arrays with random contents (timing only)."""
    from workbench.weight import MarlinWeight

    pf = wt.pack_factor
    ng = 1 if gs == -1 else k // gs
    qweight = cp.asarray(rng.integers(0, 2**32, size=(k // 16, n * 16 // pf), dtype=np.uint32).view(np.int32))
    scales = cp.asarray((rng.random((ng, n), dtype=np.float32) * 0.01 + 0.001).astype(act_dtype))
    zeros = None
    if wt.has_zero_points:
        zeros = cp.asarray(rng.integers(0, 2**32, size=(ng, n // pf), dtype=np.uint32).view(np.int32))
    return MarlinWeight(qweight, scales, zeros, None, None, k, n, gs, wt, np.dtype(act_dtype))


def weight_bytes(k, n, wt, gs) -> int:
    ng = 1 if gs == -1 else k // gs
    b = k * n * wt.bits // 8 + ng * n * 2
    if wt.has_zero_points:
        b += ng * n * wt.bits // 8
    return b


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=pathlib.Path)
    parser.add_argument("--quick", action="store_true", help="two shapes, four M values (smoke run)")
    args = parser.parse_args(argv)
    import cupy as cp
    import ml_dtypes
    import torch

    args.out.mkdir(parents=True, exist_ok=True)
    dev = cp.cuda.Device()
    props = cp.cuda.runtime.getDeviceProperties(dev.id)
    gpu = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    l2 = l2_bytes(cp)
    copy_gbs = copy_bandwidth(cp)
    print(f"{gpu}: {props['multiProcessorCount']} SMs, L2 {l2 / 2**20:.0f} MiB, copy {copy_gbs:.0f} GB/s", flush=True)
    dtypes = {"float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
    shapes = SHAPES[:1] + SHAPES[3:4] if args.quick else SHAPES
    m_values = (1, 16, 64, 256) if args.quick else M_VALUES
    rng = np.random.default_rng(0)
    rows = []
    sms = props["multiProcessorCount"]
    programmatic = gemm.programmatic_launches(dev.id)

    for k, n in shapes:
        # ---- inputs, rotated through enough copies to defeat L2 -------------------------------------------------
        mmax = max(m_values)
        fp16_w_bytes = k * n * 2
        n_fp16 = copies_for(fp16_w_bytes, l2)
        w16 = [torch.randn(k, n, device="cuda", dtype=torch.float16) * 0.01 for _ in range(n_fp16)]
        tiny = None
        try:
            n_tiny = copies_for(k * n // 2, l2)
            packed = []
            for _ in range(n_tiny):
                q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda")
                packed.append(torch._convert_weight_to_int4pack(q, 8))
            sz = torch.rand(k // 128, n, 2, device="cuda", dtype=torch.bfloat16) * 0.01
            tiny = (packed, sz)
        except Exception as exc:  # tinygemm availability differs between torch builds
            print(f"tinygemm unavailable: {exc!r}", flush=True)
        ours = {}
        for label, wt, gs, dt in OURS:
            count = copies_for(weight_bytes(k, n, wt, gs), l2)
            ours[label] = [random_weight(cp, k, n, wt, gs, dtypes[dt], rng) for _ in range(count)]

        for m in m_values:
            a16 = [torch.randn(m, k, device="cuda", dtype=torch.float16) for _ in range(2)]
            abf = [x.to(torch.bfloat16) for x in a16]
            out16 = torch.empty(m, n, device="cuda", dtype=torch.float16)
            base_bytes = m * k * 2 + m * n * 2

            def record(method, us, nbytes, fp16_us=None):
                gbs = nbytes / (us * 1e-6) / 1e9
                row = dict(gpu=gpu, k=k, n=n, m=m, method=method, us=round(us, 3), gbs=round(gbs, 1),
                           pct_copy=round(100 * gbs / copy_gbs, 1),
                           speedup_vs_fp16=None if fp16_us is None else round(fp16_us / us, 3))
                rows.append(row)
                print(f"K={k:6d} N={n:6d} M={m:4d} {method:26s} {us:9.2f} us {gbs:7.0f} GB/s "
                      f"{row['pct_copy']:5.1f}% copy  x{row['speedup_vs_fp16'] or 1:.2f}", flush=True)

            launches = [(lambda i=i: torch.matmul(a16[i % 2], w16[i % n_fp16], out=out16))
                        for i in range(LAUNCHES_PER_GRAPH)]
            fp16_us = time_torch_graph(torch, launches)
            record("cuBLAS fp16 (torch.matmul)", fp16_us, fp16_w_bytes + base_bytes, fp16_us)
            if tiny is not None:
                packed, sz = tiny
                try:
                    launches = [(lambda i=i: torch._weight_int4pack_mm(abf[i % 2], packed[i % len(packed)], 128, sz))
                                for i in range(LAUNCHES_PER_GRAPH)]
                    us = time_torch_graph(torch, launches)
                    record("tinygemm bf16 (W4 g128)", us, k * n // 2 + k // 128 * n * 4 + base_bytes, fp16_us)
                except Exception as exc:
                    print(f"tinygemm failed at M={m}: {exc!r}", flush=True)
            torch.cuda.synchronize()

            for label, wt, gs, dt in OURS:
                ws_list = ours[label]
                a = [cp.asarray(rng.standard_normal((m, k), dtype=np.float32).astype(dtypes[dt])) for _ in range(2)]
                c = cp.empty((m, n), dtype=dtypes[dt])
                work = cp.zeros(gemm.workspace_numel(sms), dtype=np.int32)
                c_tmp = cp.empty(gemm.c_tmp_numel(sms), dtype=np.float32)
                def launches(policy=DEFAULT_GEMM_POLICY):
                    return [(lambda s, i=i: gemm.marlin_gemm(a[i % 2], ws_list[i % len(ws_list)], c=c,
                                                             workspace=work, c_tmp=c_tmp, stream=s, policy=policy))
                            for i in range(LAUNCHES_PER_GRAPH)]
                us = time_cupy_graph(cp, launches())
                record(label, us, weight_bytes(k, n, wt, gs) + base_bytes, fp16_us)
                if programmatic and label in PLAIN_TOO:
                    us = time_cupy_graph(cp, launches(PLAIN_POLICY))
                    record(f"{label} (plain launch)", us, weight_bytes(k, n, wt, gs) + base_bytes, fp16_us)
            del a16, abf
        del w16, tiny, ours
        torch.cuda.empty_cache()
        cp.get_default_memory_pool().free_all_blocks()

    meta = dict(gpu=gpu, sms=sms, l2_bytes=l2, copy_gbs=round(copy_gbs, 1),
                date=datetime.date.today().isoformat(), commit=os.environ.get("BENCH_COMMIT", "unknown"),
                torch=torch.__version__, cupy=cp.__version__, launches_per_graph=LAUNCHES_PER_GRAPH,
                replays=REPLAYS, l2_multiple=L2_MULTIPLE,
                # how ours launched: programmatic dependent launches back to back in the graphs (sm_90) or plain
                programmatic_launch=programmatic)
    tag = "".join(ch if ch.isalnum() else "_" for ch in gpu.lower()).strip("_")
    (args.out / f"gemm_{tag}.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    with open(args.out / f"gemm_{tag}.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    (args.out / f"gemm_{tag}.md").write_text(markdown_table(meta, rows))
    return 0


def markdown_table(meta, rows) -> str:
    """µs per (shape, M) with speedup over fp16 in parentheses; one column per method."""
    methods = list(dict.fromkeys(r["method"] for r in rows))
    lines = [f"GPU {meta['gpu']} ({meta['sms']} SMs), {meta['date']}, commit {meta['commit']}, device copy "
             f"{meta['copy_gbs']:.0f} GB/s (read+write). Cells: µs (speedup over cuBLAS fp16, % of copy bandwidth). "
             + ("Marlin launches: programmatic (the \"plain launch\" columns: the same kernels launched plainly)."
                if meta.get("programmatic_launch") else "Marlin launches: plain."),
             "", "| K×N | M | " + " | ".join(methods) + " |", "|---|---|" + "---|" * len(methods)]
    by_key = {}
    for r in rows:
        by_key.setdefault((r["k"], r["n"], r["m"]), {})[r["method"]] = r
    for (k, n, m), cells in by_key.items():
        vals = []
        for meth in methods:
            r = cells.get(meth)
            vals.append("—" if r is None else f"{r['us']:.1f} (×{r['speedup_vs_fp16']:.2f}, {r['pct_copy']:.0f}%)")
        lines.append(f"| {k}×{n} | {m} | " + " | ".join(vals) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
