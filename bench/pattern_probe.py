"""Is the weight fetch slow because of the order it reads memory in, or because of how it waits?

    python bench/pattern_probe.py --out DIR

The Marlin GEMM reads its weights "column-walk": a block owns a column tile and walks down the k16 rows of the
(K/16, N*16/pack) Marlin matrix, reading one contiguous chunk (the tile's bytes) per row, rows a whole matrix row
apart. bench/ablation_probe.py found the kernel's fetch alone (no compute) far below a streaming read of the same
bytes. This probe reads the same bytes with no compute in four ways and times each as bench_gemm.py does (CUDA
graph of 20 launches over inputs rotated through > 3x L2, device events):
  contiguous   block b reads one contiguous 1/grid of the matrix (floor_probe.py's read kernel: plain 16-byte loads,
               8 in flight per thread)
  colwalk      the kernel's order (chunk bytes CB per row, the rows split over `ksplit` blocks per column), plain
               16-byte loads, UNROLL rows in flight per thread: is the order itself slow?
  colwalk_async the same order through a cp.async ring of STAGES slots with a wait + block barrier per stage, as the
               kernel's main loop does: is the pipeline's waiting slow?
  striped_async the ring of colwalk_async over the GEMM's striped split (one linear (column, stage) range cut into
               equal parts, so blocks read unrelated rows at any moment): does losing that alignment cost?
Writes DIR/pattern_<gpu>.json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import floor_probe  # noqa: E402
from bench_gemm import LAUNCHES_PER_GRAPH, copies_for, device_summary, time_cupy_graph  # noqa: E402

_SOURCE = r"""
// Block (col, part): rows [part R / ksplit, (part + 1) R / ksplit) of column chunk col (chunk_i4 int4 per row).
// Thread t reads int4 t % chunk_i4 of rows t / chunk_i4 + j (256 / chunk_i4); U of its rows in flight.
extern "C" __global__ void colwalk(const int4* __restrict__ src, int rows, int row_i4, int chunk_i4, int ksplit,
                                   int* __restrict__ out) {
  const int cols = row_i4 / chunk_i4;
  const int col = blockIdx.x % cols, part = blockIdx.x / cols;
  const int r0 = part * rows / ksplit, r1 = (part + 1) * rows / ksplit;
  const int rows_per_pass = blockDim.x / chunk_i4;
  const int c = threadIdx.x % chunk_i4;
  int acc = 0;
  constexpr int U = 8;
  for (int r = r0 + threadIdx.x / chunk_i4; r < r1; r += U * rows_per_pass) {
    int4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int rr = r + u * rows_per_pass;
      v[u] = rr < r1 ? __ldcs(src + (long long)rr * row_i4 + (long long)col * chunk_i4 + c) : make_int4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  if (acc == 0x12345678) out[0] = acc;
}

// The same order through a STAGES-slot cp.async ring, stage = stage_rows rows of the chunk, a wait and a block
// barrier per stage (the GEMM main loop's structure, no compute: each thread reads back one int4 it copied).
template <int STAGES>
__global__ void colwalk_async(const int4* __restrict__ src, int rows, int row_i4, int chunk_i4, int ksplit,
                              int stage_rows, int* __restrict__ out) {
  extern __shared__ int4 smem[];
  const int cols = row_i4 / chunk_i4;
  const int col = blockIdx.x % cols, part = blockIdx.x / cols;
  const int r0 = part * rows / ksplit, r1 = (part + 1) * rows / ksplit;
  const int steps = (r1 - r0) / stage_rows;
  const int stage_i4 = stage_rows * chunk_i4;
  const int copies = stage_i4 / blockDim.x;
  auto fetch = [&](int s) {
    if (s < steps) {
      int4* slot = smem + (s % STAGES) * stage_i4;
      for (int n = 0; n < copies; ++n) {
        const int e = threadIdx.x + n * blockDim.x;
        const int rr = r0 + s * stage_rows + e / chunk_i4;
        const int4* g = src + (long long)rr * row_i4 + (long long)col * chunk_i4 + e % chunk_i4;
        const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(slot + e));
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(g));
      }
    }
    asm volatile("cp.async.commit_group;\n" ::);
  };
  for (int s = 0; s < STAGES - 1; ++s) fetch(s);
  int acc = 0;
  for (int s = 0; s < steps; ++s) {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(STAGES - 2));
    __syncthreads();
    fetch(s + STAGES - 1);
    const int4 v = smem[(s % STAGES) * stage_i4 + threadIdx.x];
    acc ^= v.x ^ v.w;
  }
  asm volatile("cp.async.wait_group 0;\n" ::);
  if (acc == 0x12345678) out[0] = acc;
}

// The GEMM's striped split: the (col, stage) iterations of all columns form one linear range, block b takes
// [b T / G, (b + 1) T / G); so at any moment the blocks read stages at unrelated rows (unlike colwalk_async, where
// every block of a split reads the same rows at the same time).
template <int STAGES>
__global__ void striped_async(const int4* __restrict__ src, int rows, int row_i4, int chunk_i4, int stage_rows,
                              int* __restrict__ out) {
  extern __shared__ int4 smem[];
  const int cols = row_i4 / chunk_i4;
  const int steps = rows / stage_rows;
  const long long total = (long long)cols * steps;
  const int it0 = (int)(blockIdx.x * total / gridDim.x), it1 = (int)((blockIdx.x + 1) * total / gridDim.x);
  const int stage_i4 = stage_rows * chunk_i4;
  const int copies = stage_i4 / blockDim.x;
  auto fetch = [&](int it, int s) {
    if (it < it1) {
      const int col = it / steps, st = it % steps;
      int4* slot = smem + (s % STAGES) * stage_i4;
      for (int n = 0; n < copies; ++n) {
        const int e = threadIdx.x + n * blockDim.x;
        const int rr = st * stage_rows + e / chunk_i4;
        const int4* g = src + (long long)rr * row_i4 + (long long)col * chunk_i4 + e % chunk_i4;
        const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(slot + e));
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(g));
      }
    }
    asm volatile("cp.async.commit_group;\n" ::);
  };
  for (int s = 0; s < STAGES - 1; ++s) fetch(it0 + s, s);
  int acc = 0;
  for (int s = 0; it0 + s < it1; ++s) {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(STAGES - 2));
    __syncthreads();
    fetch(it0 + s + STAGES - 1, s + STAGES - 1);
    const int4 v = smem[(s % STAGES) * stage_i4 + threadIdx.x];
    acc ^= v.x ^ v.w;
  }
  asm volatile("cp.async.wait_group 0;\n" ::);
  if (acc == 0x12345678) out[0] = acc;
}
"""

# (name, K, N, bits): the Marlin matrix is (K/16) rows of N*16*bits/8/... bytes: K/16 rows x (N * 16 * bits / 8) bytes
LAYERS = (("u4b8 8192x28672", 8192, 28672, 4), ("fp8 8192x28672", 8192, 28672, 8), ("u4b8 4096x14336", 4096, 14336, 4),
          ("u4b8 8192x8192", 8192, 8192, 4))
# (chunk bytes, blocks per column, threads) per layer are chosen to give grids near 1-2 x #SMs
CHUNKS = (512, 1024, 2048, 4096)
STAGES = (3, 4, 8)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=pathlib.Path)
    parser.add_argument("--launch", default="", help="K,N,bits,chunk,stages: only launch that colwalk_async 3 times "
                        "(for Nsight Compute), then exit")
    args = parser.parse_args(argv)
    import cupy as cp

    gpu, sms, l2, copy_gbs = device_summary(cp)
    names = [f"colwalk_async<{s}>" for s in STAGES] + [f"striped_async<{s}>" for s in STAGES]
    # "contiguous" is floor_probe.py's streaming read kernel (the floor table's "read")
    mod = cp.RawModule(code=floor_probe._SOURCE + _SOURCE, options=("-std=c++17",), name_expressions=names)
    contiguous, colwalk = mod.get_function("read_kernel"), mod.get_function("colwalk")
    asyncs = {s: mod.get_function(f"colwalk_async<{s}>") for s in STAGES}
    stripeds = {s: mod.get_function(f"striped_async<{s}>") for s in STAGES}
    out = cp.zeros(1, dtype=cp.int32)
    if args.launch:
        k, n, bits, chunk, st = (int(x) for x in args.launch.split(","))
        rows, row_bytes = k // 16, n * 16 * bits // 8
        buf = cp.ones(rows * row_bytes // 4, dtype=cp.int32)
        stage_rows = max(1, 16384 // chunk)
        f = asyncs[st]
        f.max_dynamic_shared_size_bytes = st * stage_rows * chunk
        for _ in range(3):
            f((row_bytes // chunk,), (256,), (buf, cp.int32(rows), cp.int32(row_bytes // 16), cp.int32(chunk // 16),
                                              cp.int32(1), cp.int32(stage_rows), out), shared_mem=st * stage_rows * chunk)
        cp.cuda.Device().synchronize()
        return 0
    rows_out = []

    def record(layer, kind, us, nbytes, **extra):
        gbs = nbytes / (us * 1e-6) / 1e9
        rows_out.append(dict(layer=layer, kind=kind, us=round(us, 3), gbs=round(gbs, 1),
                             pct_copy=round(100 * gbs / copy_gbs, 1), **extra))
        print(f"{layer:18s} {kind:16s} {us:8.2f} us {gbs:7.0f} GB/s {100 * gbs / copy_gbs:5.1f}% "
              + " ".join(f"{a}={b}" for a, b in extra.items()), flush=True)

    for layer, k, n, bits in LAYERS:
        rows = k // 16
        row_bytes = n * 16 * bits // 8
        nbytes = rows * row_bytes
        bufs = [cp.empty(nbytes // 4, dtype=cp.int32) for _ in range(copies_for(nbytes, l2))]
        for b in bufs:
            b[...] = 1
        row_i4 = row_bytes // 16
        for grid in (sms, 2 * sms, 4 * sms):
            us = time_cupy_graph(cp, [(lambda s, i=i, g=grid: contiguous(
                (g,), (256,), (bufs[i % len(bufs)], cp.int64(nbytes // 16), out), stream=s))
                for i in range(LAUNCHES_PER_GRAPH)])
            record(layer, "contiguous", us, nbytes, grid=grid)
        for chunk in CHUNKS:
            cols = row_bytes // chunk
            chunk_i4 = chunk // 16
            for ksplit in sorted({max(1, round(sms / cols)), max(1, round(2 * sms / cols))}):
                grid = cols * ksplit
                us = time_cupy_graph(cp, [(lambda s, i=i, g=grid, ks=ksplit, ci=chunk_i4: colwalk(
                    (g,), (256,), (bufs[i % len(bufs)], cp.int32(rows), cp.int32(row_i4), cp.int32(ci),
                                   cp.int32(ks), out), stream=s)) for i in range(LAUNCHES_PER_GRAPH)])
                record(layer, "colwalk", us, nbytes, chunk=chunk, ksplit=ksplit, grid=grid)
                stage_rows = max(1, 16384 // chunk)  # 16 KiB stages, as the kernels' (2,4) / (4,2) tiles
                if (rows // ksplit) % stage_rows:
                    continue
                for st in STAGES:
                    smem = st * stage_rows * chunk
                    f = asyncs[st]
                    f.max_dynamic_shared_size_bytes = smem
                    us = time_cupy_graph(cp, [(lambda s, i=i, g=grid, ks=ksplit, ci=chunk_i4, f=f, sm=smem, sr=stage_rows: f(
                        (g,), (256,), (bufs[i % len(bufs)], cp.int32(rows), cp.int32(row_i4), cp.int32(ci),
                                       cp.int32(ks), cp.int32(sr), out), stream=s, shared_mem=sm))
                        for i in range(LAUNCHES_PER_GRAPH)])
                    record(layer, f"colwalk_async{st}", us, nbytes, chunk=chunk, ksplit=ksplit, grid=grid,
                           stage_kib=stage_rows * chunk // 1024)
        for chunk in CHUNKS:
            stage_rows = max(1, 16384 // chunk)
            for grid in (sms, 2 * sms):
                for st in (3, 4):
                    smem = st * stage_rows * chunk
                    if grid > sms and smem > 110 * 1024:
                        continue
                    f = stripeds[st]
                    f.max_dynamic_shared_size_bytes = smem
                    us = time_cupy_graph(cp, [(lambda s, i=i, g=grid, ci=chunk // 16, f=f, sm=smem, sr=stage_rows: f(
                        (g,), (256,), (bufs[i % len(bufs)], cp.int32(rows), cp.int32(row_i4), cp.int32(ci),
                                       cp.int32(sr), out), stream=s, shared_mem=sm))
                        for i in range(LAUNCHES_PER_GRAPH)])
                    record(layer, f"striped_async{st}", us, nbytes, chunk=chunk, grid=grid,
                           stage_kib=stage_rows * chunk // 1024)
        del bufs
        cp.get_default_memory_pool().free_all_blocks()
    args.out.mkdir(parents=True, exist_ok=True)
    tag = "".join(ch if ch.isalnum() else "_" for ch in gpu.lower()).strip("_")
    meta = dict(gpu=gpu, sms=sms, copy_gbs=round(copy_gbs, 1), date=datetime.date.today().isoformat())
    (args.out / f"pattern_{tag}.json").write_text(json.dumps(dict(meta=meta, rows=rows_out), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
