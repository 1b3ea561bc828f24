"""What the bench's method can measure at best: the floor under every GEMM cell of bench_gemm.py.

    python bench/floor_probe.py --out DIR

For each layer of bench_gemm.SHAPES and each weight size the GEMM table uses (INT4 + group-128 scales, 8-bit +
scales, fp16), times, with bench_gemm's method (a CUDA graph of 20 launches over inputs rotated through > 3x L2,
device events):
  empty     a kernel that does nothing (the launch floor of a graph node)
  read      a streaming read of exactly that many bytes (16-byte loads, several in flight per thread, one XOR result
            per block so the loads cannot be dropped): what a weight-streaming kernel with no compute, no
            reduction and no output costs at this size
  memcpy    a device-to-device copy of the same bytes (reads and writes them)
and the 1 GiB copy bandwidth bench_gemm.py quotes as its ceiling. For the MoE table (bench_moe.py), the bytes of the
experts one decode token touches (M = 1: top_k experts) are read the way bench_moe.py times a call: one launch
after an L2 flush, events around it, the GPU spinning ahead of the start event while the host queues the launch. A GEMM cell cannot beat "read" of its weight
bytes; a bar that needs less time than that is out of reach for any kernel timed this way.
Writes DIR/floor_<gpu>.json and prints a table.
"""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from bench_gemm import (LAUNCHES_PER_GRAPH, SHAPES, copies_for, copy_bandwidth, l2_bytes, time_cupy_graph,  # noqa: E402
                        weight_bytes)
from workbench.scalar_types import ScalarType  # noqa: E402

# Each block streams a contiguous range of 16-byte vectors, UNROLL loads per thread in flight per step.
_SOURCE = r"""
extern "C" __global__ void empty_kernel(int* out) {}

extern "C" __global__ void spin_kernel(long long cycles) {
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
}

extern "C" __global__ void read_kernel(const int4* __restrict__ src, long long n_vec, int* __restrict__ out) {
  const long long per_block = (n_vec + gridDim.x - 1) / gridDim.x;
  const long long begin = blockIdx.x * per_block;
  const long long end = begin + per_block < n_vec ? begin + per_block : n_vec;
  int acc = 0;
  constexpr int UNROLL = 8;
  for (long long i = begin + threadIdx.x; i < end; i += (long long)UNROLL * blockDim.x) {
    int4 v[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const long long j = i + (long long)u * blockDim.x;
      v[u] = j < end ? __ldcs(src + j) : make_int4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  if (acc == 0x7fffffff) out[blockIdx.x] = acc;  // practically never taken; keeps the loads alive
}
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=pathlib.Path, required=True)
    ap.add_argument("--blocks-per-sm", type=int, default=4)
    args = ap.parse_args(argv)

    import cupy as cp

    dev = cp.cuda.Device()
    props = cp.cuda.runtime.getDeviceProperties(dev.id)
    gpu = props["name"].decode()
    sms = props["multiProcessorCount"]
    module = cp.RawModule(code=_SOURCE, options=("-std=c++17",))
    empty_k = module.get_function("empty_kernel")
    read_k = module.get_function("read_kernel")
    out = cp.zeros(sms * args.blocks_per_sm, dtype=np.int32)
    l2 = l2_bytes(cp)
    rows = []

    def sizes():
        for k, n in SHAPES:
            yield k, n, "u4b8 g128", weight_bytes(k, n, ScalarType.U4B8, 128)
            yield k, n, "8-bit + scales", weight_bytes(k, n, ScalarType.FE4M3FN, -1)
            yield k, n, "fp16", 2 * k * n

    t_empty = time_cupy_graph(cp, [lambda s: empty_k((1,), (32,), (out,), stream=s)] * LAUNCHES_PER_GRAPH)
    for k, n, what, nbytes in sizes():
        nvec = nbytes // 16
        copies = copies_for(nbytes, l2)
        bufs = [cp.empty(nvec * 16, dtype=np.uint8) for _ in range(copies)]
        dsts = [cp.empty(nvec * 16, dtype=np.uint8) for _ in range(copies)]
        for b in bufs:
            b.fill(1)
        grid = sms * args.blocks_per_sm

        def read(i):
            return lambda s: read_k((grid,), (512,), (bufs[i % copies], np.int64(nvec), out), stream=s)

        def memcpy(i):
            return lambda s: cp.cuda.runtime.memcpyAsync(dsts[i % copies].data.ptr, bufs[i % copies].data.ptr,
                                                         nvec * 16, cp.cuda.runtime.memcpyDeviceToDevice, s.ptr)

        t_read = time_cupy_graph(cp, [read(i) for i in range(LAUNCHES_PER_GRAPH)])
        t_copy = time_cupy_graph(cp, [memcpy(i) for i in range(LAUNCHES_PER_GRAPH)])
        rows.append(dict(k=k, n=n, weights=what, bytes=nbytes, empty_us=t_empty, read_us=t_read,
                         read_gbs=nbytes / t_read / 1e3, memcpy_us=t_copy, memcpy_gbs=2 * nbytes / t_copy / 1e3))
        bufs = dsts = None  # free before the next size
        cp.get_default_memory_pool().free_all_blocks()
        r = rows[-1]
        print(f"{k:>5}x{n:<6} {what:15} {nbytes / 1e6:8.2f} MB  read {t_read:7.2f} us ({r['read_gbs']:6.0f} GB/s)  "
              f"memcpy {t_copy:7.2f} us ({r['memcpy_gbs']:6.0f} GB/s r+w)", flush=True)
    from bench_moe import CONFIGS as MOE_CONFIGS, touched_bytes

    flush = cp.empty(512 << 20, dtype=np.uint8)
    spin = module.get_function("spin_kernel")
    moe_rows = []
    for name, experts, k, n, top_k in MOE_CONFIGS:
        nbytes = touched_bytes(top_k, k, n)
        nvec = nbytes // 16
        buf = cp.empty(nvec * 16, dtype=np.uint8)
        buf.fill(1)
        grid = sms * args.blocks_per_sm
        times = []
        for rep in range(8):
            flush.fill(0)
            spin((1,), (1,), (np.int64(200 * 2100),))  # >= 200 us at <= 2.1 GHz: the host queues what follows
            start, stop = cp.cuda.Event(), cp.cuda.Event()
            start.record()
            read_k((grid,), (512,), (buf, np.int64(nvec), out))
            stop.record()
            stop.synchronize()
            if rep:  # the first is a warm-up
                times.append(cp.cuda.get_elapsed_time(start, stop) * 1e3)
        t = float(np.median(times))
        moe_rows.append(dict(config=name, m=1, experts_touched=top_k, k=k, n=n, bytes=nbytes, read_us=t,
                             read_gbs=nbytes / t / 1e3))
        print(f"moe {name:10} M=1 {top_k} experts {nbytes / 1e6:8.2f} MB  read (one launch) {t:7.2f} us "
              f"({nbytes / t / 1e3:6.0f} GB/s)", flush=True)
        del buf
    meta = dict(date=datetime.date.today().isoformat(), gpu=gpu, sms=sms, empty_us=t_empty,
                copy_1gib_gbs=copy_bandwidth(cp), launches_per_graph=LAUNCHES_PER_GRAPH,
                read_grid=f"{sms * args.blocks_per_sm} blocks x 512 threads, 8 x 16-byte loads in flight per thread")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"floor_{gpu.replace(' ', '_')}.json"
    path.write_text(json.dumps(dict(meta=meta, rows=rows, moe_rows=moe_rows), indent=1))
    print(f"empty kernel {t_empty:.2f} us per launch; 1 GiB copy {meta['copy_1gib_gbs']:.0f} GB/s; wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
