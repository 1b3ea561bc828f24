"""Bandwidth of every Numba repack / scale / zero-point transform beside a device-to-device copy (GPU only).

For each transform: effective bandwidth = (bytes read + bytes written) / kernel time, where kernel time is the
median over ``--reps`` (≥ 20) warm runs timed with CUDA events. Before each timed run the L2 is flushed (a 512 MiB
fill) and a ~200 µs sleep kernel is queued ahead of the start event, so the host's launch overhead hides behind the
sleep instead of landing between the events. The ceiling is a ``cudaMemcpyAsync`` device-to-device copy of the same
byte count, timed the same way in the same run.

Shapes: K×N ∈ {8192×28672, 28672×8192} (Llama-3 70B MLP) and 64 experts × (2048×1408) stacked (one launch).

    python bench/bench_repack.py --out bench/results            # writes repack_<date>.json / .csv, prints a table
"""
from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import statistics
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

SHAPES = [(8192, 28672), (28672, 8192)]
MOE = (64, 2048, 1408)  # experts, K, N
GROUP = 128


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/results", help="directory for the JSON and CSV results")
    parser.add_argument("--reps", type=int, default=25, help="timed repetitions per transform (median reported)")
    parser.add_argument("--sweep", action="store_true", help="also sweep the repack launch shape")
    parser.add_argument("--ab", action="store_true", help="round-2 A/B only: old vs new kernels of the slow paths")
    parser.add_argument("--ab-shapes", default="8192x28672,28672x8192", help="K x N list for --ab")
    args = parser.parse_args()
    if args.reps < 20:
        parser.error("--reps must be at least 20")
    if args.ab:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.ab_shapes.split(",")]
        return ab_main(args.out, args.reps, shapes)

    import cupy as cp
    from numba import cuda

    from kernels_numba import marlin_repack as kr
    from kernels_numba import scales as ks

    dev = cuda.get_current_device()
    gpu = dev.name.decode() if isinstance(dev.name, bytes) else dev.name
    stream = cuda.stream()
    handle = stream.handle
    stream_ptr = handle.value if hasattr(handle, "value") else int(handle)  # ctypes or cuda-python handle
    cp_stream = cp.cuda.ExternalStream(stream_ptr)
    flush_buffer = cp.empty(512 << 20, dtype=cp.uint8)
    start, end = cuda.event(), cuda.event()

    @cuda.jit
    def sleep_kernel(rounds):
        for _ in range(rounds):
            cuda.nanosleep(50_000)

    def timed(launch, reps=args.reps, warmup=3):
        times = []
        for r in range(warmup + reps):
            with cp_stream:
                flush_buffer.fill(r & 0xFF)
            sleep_kernel[1, 1, stream](4)
            start.record(stream)
            launch()
            end.record(stream)
            end.synchronize()
            if r >= warmup:
                times.append(cuda.event_elapsed_time(start, end) * 1e-3)
        return statistics.median(times)

    def copy_time(nbytes):
        src = cp.empty(nbytes, dtype=cp.uint8)
        dst = cp.empty(nbytes, dtype=cp.uint8)
        src.fill(1)

        def launch():
            cp.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, nbytes, cp.cuda.runtime.memcpyDeviceToDevice,
                                        stream_ptr)

        return timed(launch)

    def rand_words(shape):
        return cuda.as_cuda_array(cp.random.randint(0, 2**32, size=shape, dtype=cp.uint64).astype(cp.uint32))

    def rand_u8(shape):
        return cuda.as_cuda_array(cp.random.randint(0, 256, size=shape, dtype=cp.uint8))

    rows = []
    copy_cache = {}

    def record(name, shape, nbytes_read, nbytes_written, seconds, note=""):
        copy_bytes = max(nbytes_read, nbytes_written)
        if copy_bytes not in copy_cache:
            copy_cache[copy_bytes] = copy_time(copy_bytes)
        t_copy = copy_cache[copy_bytes]
        bw = (nbytes_read + nbytes_written) / seconds
        copy_bw = 2 * copy_bytes / t_copy
        row = dict(transform=name, shape=shape, bytes_read=nbytes_read, bytes_written=nbytes_written,
                   kernel_us=round(seconds * 1e6, 2), bandwidth_GBps=round(bw / 1e9, 1),
                   copy_us=round(t_copy * 1e6, 2), copy_GBps=round(copy_bw / 1e9, 1),
                   fraction_of_copy=round(bw / copy_bw, 3), note=note)
        rows.append(row)
        print(f"{name:34s} {shape:22s} {row['kernel_us']:9.1f} us {row['bandwidth_GBps']:8.1f} GB/s  copy "
              f"{row['copy_GBps']:8.1f} GB/s  {100 * row['fraction_of_copy']:5.1f}%", flush=True)

    dummy_perm = cuda.to_device(np.zeros((1, 1), np.int32), stream=stream)

    def weight_repack(name, bits, source, k, n, src, perm=None, experts=1, tiles=kr.TILES_PER_BLOCK,
                      threads=kr.THREADS, note="", staged=False, ktpt=None, direct_threads=kr.DIRECT_THREADS,
                      direct_row_major=False):
        pf = 32 // bits
        out = cuda.device_array((experts, k // 16, n * 16 // pf), np.uint32, stream=stream)
        if source == "gptq_perm" and not staged:  # what the wrappers run (round 2: direct kernels everywhere)
            kernel = kr._perm_repack_kernel(bits)
            grid = kr.perm_grid(k, n, bits, experts)
            launch = lambda: kernel[grid, kr.DIRECT_THREADS, stream](src, perm, out, n)  # noqa: E731
        elif source == "awq" and not staged:
            kernel = kr._awq_direct_repack_kernel(bits)
            grid = kr.awq_grid(k, n, bits, experts)
            launch = lambda: kernel[grid, kr.DIRECT_THREADS, stream](src, out, n)  # noqa: E731
        elif source == "row_major_bytes" and not staged and not direct_row_major:
            kernel = kr._transpose_repack_kernel(False)
            grid = kr.transpose_grid(k, n, experts)
            launch = lambda: kernel[grid, kr.TRANSPOSE_THREADS, stream](src, out, n)  # noqa: E731
        elif source in ("gptq", "row_major_bytes") and not staged:
            kernel = kr._direct_repack_kernel(bits, source, ktpt, direct_threads)
            grid = kr.direct_grid(k, n, bits, experts, ktpt, direct_threads)
            launch = lambda: kernel[grid, direct_threads, stream](src, out, n)  # noqa: E731
        else:
            kernel = kr._repack_kernel(bits, source, tiles, threads)
            grid = (k // 16, -(-n // (64 * tiles)), experts)
            p = perm if perm is not None else dummy_perm
            launch = lambda: kernel[grid, threads, stream](src, p, out, n)  # noqa: E731
        launch()
        stream.synchronize()
        nbytes = experts * k * n // pf * 4
        extra = 0 if perm is None else perm.size * 4
        shape = f"{experts}x{k}x{n}" if experts > 1 else f"{k}x{n}"
        record(name, shape, nbytes + extra, nbytes, timed(launch), note)
        return out

    def weight_unpack(name, bits, target, k, n, marlin, experts=1):
        pf = 32 // bits
        shape_out = {"gptq": (experts, k // pf, n), "awq": (experts, k, n // pf),
                     "row_major_bytes": (experts, n, k // 4)}[target]
        out = cuda.device_array(shape_out, np.uint32, stream=stream)
        if target == "awq":
            kernel = kr._awq_direct_unpack_kernel(bits)
            grid = kr.awq_grid(k, n, bits, experts, 1)
            launch = lambda: kernel[grid, kr.DIRECT_THREADS, stream](marlin, out, n)  # noqa: E731
        elif target == "row_major_bytes":
            kernel = kr._transpose_repack_kernel(True)
            grid = kr.transpose_grid(k, n, experts)
            launch = lambda: kernel[grid, kr.TRANSPOSE_THREADS, stream](marlin, out, n)  # noqa: E731
        else:
            kernel = kr._direct_unpack_kernel(bits, target)
            grid = kr.direct_grid(k, n, bits, experts, kr.DIRECT_UNPACK_K_TILES_PER_THREAD[bits])
            launch = lambda: kernel[grid, kr.DIRECT_THREADS, stream](marlin, out, n)  # noqa: E731
        launch()
        stream.synchronize()
        nbytes = experts * k * n // pf * 4
        record(name, f"{k}x{n}", nbytes, nbytes, timed(launch))
        return out

    def elementwise(name, shape, kernel, total, launch_args, nbytes_read, nbytes_written, note=""):
        blocks = ks._blocks(total)
        launch = lambda: kernel[blocks, ks.THREADS, stream](*launch_args)  # noqa: E731
        launch()
        stream.synchronize()
        record(name, shape, nbytes_read, nbytes_written, timed(launch), note)

    checks = {}
    errors = []

    def guarded(title, fn, *fn_args):
        """Run one benchmark section; a failure is reported and recorded, and the other sections still run."""
        import traceback

        try:
            fn(*fn_args)
        except Exception as exc:  # a benchmark run should report every section it can
            traceback.print_exc()
            errors.append(f"{title}: {type(exc).__name__}: {exc}")

    def layer(k, n):
        q4 = rand_words((1, k // 8, n))
        m4 = weight_repack("gptq_marlin_repack u4", 4, "gptq", k, n, q4)
        back = weight_unpack("marlin_to_gptq_qweight u4", 4, "gptq", k, n, m4)
        checks[f"u4 round trip {k}x{n}"] = bool(cp.array_equal(cp.asarray(back), cp.asarray(q4)))
        perm = cuda.as_cuda_array(cp.random.permutation(k).astype(cp.int32).reshape(1, k))
        weight_repack("gptq_marlin_repack u4 act-order", 4, "gptq_perm", k, n, q4, perm=perm)
        aw = rand_words((1, k, n // 8))
        m_awq = weight_repack("awq_marlin_repack u4", 4, "awq", k, n, aw)
        back = weight_unpack("marlin_to_awq_qweight u4", 4, "awq", k, n, m_awq)
        checks[f"awq round trip {k}x{n}"] = bool(cp.array_equal(cp.asarray(back), cp.asarray(aw)))
        del q4, m4, aw, m_awq, back
        q8 = rand_words((1, k // 4, n))
        weight_repack("gptq_marlin_repack u8", 8, "gptq", k, n, q8)
        weight_repack("fp8_marlin_repack_raw_bits", 8, "gptq", k, n, q8, note="same kernel as u8")
        perm = cuda.as_cuda_array(cp.random.permutation(k).astype(cp.int32).reshape(1, k))
        weight_repack("gptq_marlin_repack u8 act-order", 8, "gptq_perm", k, n, q8, perm=perm)
        del q8
        rm = rand_u8((1, n, k))
        m8 = weight_repack("block_fp8_group128_repack", 8, "row_major_bytes", k, n, rm.view(np.uint32))
        back = weight_unpack("marlin_to_block_fp8 (row-major)", 8, "row_major_bytes", k, n, m8)
        checks[f"block-fp8 round trip {k}x{n}"] = bool(cp.array_equal(cp.asarray(back).view(cp.uint8),
                                                                        cp.asarray(rm)))
        del rm, m8, back
        if args.sweep and (k, n) == SHAPES[0]:  # the shared-memory (staged) kernel on the same paths
            q4 = rand_words((1, k // 8, n))
            q8 = rand_words((1, k // 4, n))
            weight_repack("staged gptq_marlin_repack u4", 4, "gptq", k, n, q4, staged=True, note="staged kernel")
            weight_repack("staged gptq_marlin_repack u8", 8, "gptq", k, n, q8, staged=True, note="staged kernel")
            for ktpt in (1, 2, 4):
                for threads in (128, 256):
                    weight_repack(f"direct u4 ktpt={ktpt} threads={threads}", 4, "gptq", k, n, q4, ktpt=ktpt,
                                  direct_threads=threads, note="direct-kernel sweep")
                    weight_repack(f"direct u8 ktpt={ktpt} threads={threads}", 8, "gptq", k, n, q8, ktpt=ktpt,
                                  direct_threads=threads, note="direct-kernel sweep")
            rm = rand_u8((1, n, k)).view(np.uint32)
            for ktpt in (2, 4):
                weight_repack(f"direct row-major ktpt={ktpt}", 8, "row_major_bytes", k, n, rm, ktpt=ktpt,
                              note="direct-kernel sweep", direct_row_major=True)
            del rm
            del q4, q8

        # small transforms for this layer (group 128)
        ng = k // GROUP
        s16 = rand_u8((ng * n * 2,)).view(np.uint16)
        s_out = cuda.device_array(ng * n, np.uint16, stream=stream)
        elementwise("marlin_permute_scales f16 (P64)", f"{ng}x{n}", ks._permute_kernel(64, "none"), ng * n,
                    (s16, s_out), ng * n * 2, ng * n * 2)
        zp = rand_u8((ng, n)).view(np.uint8)
        for bits in (4, 8):
            z_out = cuda.device_array((ng, n * bits // 32), np.uint32, stream=stream)
            err = cuda.to_device(np.array([ks.NO_ERROR, 0], np.int64), stream=stream)
            zcodes = cuda.as_cuda_array(cp.asarray(zp) & cp.uint8((1 << bits) - 1))
            elementwise(f"marlin_zero_points u{bits}", f"{ng}x{n}", ks._zp_kernel(bits, "codes"), z_out.size,
                        (zcodes, z_out, n, err), ng * n, z_out.size * 4)
            v1 = cuda.as_cuda_array(cp.full((ng, n * bits // 32), 0x66666666,
                                            dtype=cp.uint32))
            elementwise(f"repack_gptq_qzeros_to_marlin u{bits}", f"{ng}x{n}", ks._zp_kernel(bits, "gptq_v1"),
                        z_out.size, (v1, z_out, n, err), z_out.size * 4, z_out.size * 4)
        inv = cuda.as_cuda_array(cp.random.random((1, -(-n // 128), k // 128)).astype(cp.float32))
        f_out = cuda.device_array((1, (k // 128) * n), np.uint16, stream=stream)
        elementwise("block_fp8_group128_scales f32->f16", f"{k // 128}x{n}", ks._block_fp8_scales_kernel(False, "f16"),
                    f_out.size, (inv, f_out, k // 128, n), inv.size * 4, f_out.size * 2)

    def stacked_experts():
        experts, k, n = MOE
        q4 = rand_words((experts, k // 8, n))
        m4 = weight_repack("stacked gptq_marlin_repack u4", 4, "gptq", k, n, q4, experts=experts, note="one launch")
        q8 = rand_words((experts, k // 4, n))
        weight_repack("stacked gptq_marlin_repack u8", 8, "gptq", k, n, q8, experts=experts, note="one launch")
        ng = k // GROUP
        total = experts * ng * n
        s16 = rand_u8((total * 2,)).view(np.uint16)
        s_out = cuda.device_array(total, np.uint16, stream=stream)
        elementwise("stacked marlin_permute_scales f16", f"{experts}x{ng}x{n}", ks._permute_kernel(64, "none"), total,
                    (s16, s_out), total * 2, total * 2, "one launch")
        per_expert_kernel = ks._permute_kernel(64, "none")
        per = ng * n

        def per_expert_launches():
            for e in range(experts):
                per_expert_kernel[ks._blocks(per), ks.THREADS, stream](s16[e * per:(e + 1) * per],
                                                                        s_out[e * per:(e + 1) * per])

        per_expert_launches()
        stream.synchronize()
        record("stacked scales, 64 launches", f"{experts}x{ng}x{n}", total * 2, total * 2, timed(per_expert_launches),
               "for comparison: one launch per expert")
        v1 = cuda.as_cuda_array(cp.full((experts * ng, n // 8), 0x66666666, dtype=cp.uint32))
        z_out = cuda.device_array((experts * ng, n // 8), np.uint32, stream=stream)
        err = cuda.to_device(np.array([ks.NO_ERROR, 0], np.int64), stream=stream)
        elementwise("stacked repack_gptq_qzeros u4", f"{experts}x{ng}x{n}", ks._zp_kernel(4, "gptq_v1"), z_out.size,
                    (v1, z_out, n, err), z_out.size * 4, z_out.size * 4, "one launch")

    def loader_wall_time():
        """End to end (allocation, staging, all launches, one sync) wall time of the stacked loader, both routes."""
        import time

        from kernels_numba import moe as kmoe

        experts, k, n = MOE
        rng = np.random.default_rng(0)
        qws = rng.integers(0, 2**32, (experts, k // 8, n), dtype=np.uint64).astype(np.uint32).view(np.int32)
        scs = rng.standard_normal((experts, k // GROUP, n)).astype(np.float32)
        qzs = np.full((experts, k // GROUP, n // 8), 0x66666666, np.uint32).view(np.int32)
        d_in = [cp.asarray(a) for a in (qws, scs, qzs)]
        for route, inputs in (("host lists, one-expert staging", (list(qws), list(scs), list(qzs))),
                              ("device stack, one launch per tensor", d_in)):
            kmoe.stack_gptq_experts_to_marlin(*inputs, 4, GROUP, k, n)  # warm (compile)
            cp.cuda.Device().synchronize()
            t0 = time.perf_counter()
            kmoe.stack_gptq_experts_to_marlin(*inputs, 4, GROUP, k, n)
            cp.cuda.Device().synchronize()
            wall = time.perf_counter() - t0
            print(f"stacked loader, {route}: {wall * 1e3:.2f} ms wall for {experts} experts", flush=True)
            checks[f"loader wall ms ({route})"] = round(wall * 1e3, 2)

    for k, n in SHAPES:
        guarded(f"layer {k}x{n}", layer, k, n)
    guarded("stacked loader wall time", loader_wall_time)
    guarded("stacked experts", stacked_experts)

    commit = os.environ.get("BENCH_COMMIT") or _git_commit()
    meta = dict(date=datetime.date.today().isoformat(), gpu=gpu, compute_capability=list(dev.compute_capability),
                commit=commit, reps=args.reps, method="CUDA events, median, L2 flushed, launch hidden behind a "
                "sleep kernel; copy = cudaMemcpyAsync D2D of max(read, written) bytes", checks=checks,
                errors=errors)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"repack_{meta['date']}_{gpu.replace(' ', '_')}")
    with open(stem + ".json", "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    if rows:
        with open(stem + ".csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    print(json.dumps(meta))
    print(markdown_table(rows))
    return 0 if all(v for v in checks.values() if isinstance(v, bool)) and not errors else 1


def ab_main(out_dir: str, reps: int, shapes) -> int:
    """Round-2 A/B: the previous kernel of each slow path against its direct replacement, in one process, on the
    same inputs, interleaved per path; every new output is compared bit for bit with the old one. The old kernels
    are still in kernels_numba.marlin_repack (staged kernel, direct row-major kernel) and unchanged, so "old" is
    the HEAD code. Writes OUT/ab_repack_<gpu>.json after every shape; prints old µs, new µs, ratio, % of copy."""
    import cupy as cp
    from numba import cuda

    from kernels_numba import marlin_repack as kr

    dev = cuda.get_current_device()
    gpu = dev.name.decode() if isinstance(dev.name, bytes) else dev.name
    stream = cuda.stream()
    handle = stream.handle
    stream_ptr = handle.value if hasattr(handle, "value") else int(handle)
    cp_stream = cp.cuda.ExternalStream(stream_ptr)
    flush_buffer = cp.empty(512 << 20, dtype=cp.uint8)
    start, end = cuda.event(), cuda.event()

    @cuda.jit
    def sleep_kernel(rounds):
        for _ in range(rounds):
            cuda.nanosleep(50_000)

    def timed(launch):
        launch()  # compile + warm
        stream.synchronize()
        times = []
        for r in range(3 + reps):
            with cp_stream:
                flush_buffer.fill(r & 0xFF)
            sleep_kernel[1, 1, stream](4)
            start.record(stream)
            launch()
            end.record(stream)
            end.synchronize()
            if r >= 3:
                times.append(cuda.event_elapsed_time(start, end) * 1e-3)
        return statistics.median(times)

    copy_cache = {}

    def copy_seconds(nbytes):
        if nbytes not in copy_cache:
            src = cp.ones(nbytes, dtype=cp.uint8)
            dst = cp.empty(nbytes, dtype=cp.uint8)
            copy_cache[nbytes] = timed(lambda: cp.cuda.runtime.memcpyAsync(
                dst.data.ptr, src.data.ptr, nbytes, cp.cuda.runtime.memcpyDeviceToDevice, stream_ptr))
        return copy_cache[nbytes]

    def rand_words(shape):
        return cuda.as_cuda_array(cp.random.randint(0, 2**32, size=shape, dtype=cp.uint64).astype(cp.uint32))

    def launcher(kernel, grid, threads, *args):
        return lambda: kernel[grid, threads, stream](*args)  # noqa: E731

    rows = []
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"ab_repack_{gpu.replace(' ', '_')}.json")
    for k, n in shapes:
        shape = f"{k}x{n}"
        # (path, bytes one way, [(variant, kernel, grid, threads, args before out)], out shape, extra bytes read)
        cases = []
        for bits in (4, 8):
            pf = 32 // bits
            mshape = (1, k // 16, n * 16 // pf)
            q = rand_words((1, k // pf, n))
            perm = cuda.as_cuda_array(cp.random.permutation(k).astype(cp.int32).reshape(1, k))
            variants = [("old staged", kr._repack_kernel(bits, "gptq_perm"), (k // 16, -(-n // kr.CHUNK_N), 1),
                         kr.THREADS, (q, perm))]
            for ktpt in (1, 2):
                variants.append((f"new ktpt={ktpt}", kr._perm_repack_kernel(bits, ktpt),
                                 kr.perm_grid(k, n, bits, 1, ktpt), kr.DIRECT_THREADS, (q, perm)))
            cases.append((f"act-order u{bits}", k * n // pf * 4, variants, mshape, k * 4))
            aw = rand_words((1, k, n // pf))
            variants = [("old staged", kr._repack_kernel(bits, "awq"), (k // 16, -(-n // kr.CHUNK_N), 1),
                         kr.THREADS, (aw, kr_dummy_perm(cuda, stream)))]
            for ktpt in (1, 2, 4):
                variants.append((f"new ktpt={ktpt}", kr._awq_direct_repack_kernel(bits, ktpt),
                                 kr.awq_grid(k, n, bits, 1, ktpt), kr.DIRECT_THREADS, (aw,)))
            cases.append((f"awq u{bits}", k * n // pf * 4, variants, mshape, 0))
            m = rand_words(mshape)
            variants = [("old staged", kr._unpack_kernel(bits, "awq"), (k // 16, -(-n // kr.CHUNK_N), 1),
                         kr.THREADS, (m,)),
                        ("new", kr._awq_direct_unpack_kernel(bits), kr.awq_grid(k, n, bits, 1, 1), kr.DIRECT_THREADS,
                         (m,))]
            cases.append((f"marlin->awq u{bits}", k * n // pf * 4, variants, (1, k, n // pf), 0))
            variants = [(f"{'old' if t == 1 else 'new'} ktpt={t}", kr._direct_unpack_kernel(bits, "gptq", t),
                         kr.direct_grid(k, n, bits, 1, t), kr.DIRECT_THREADS, (m,)) for t in (1, 2, 4)]
            cases.append((f"marlin->gptq u{bits}", k * n // pf * 4, variants, (1, k // pf, n), 0))
        rm = rand_words((1, n, k // 4))
        old_ktpt = kr.DIRECT_K_TILES_PER_THREAD[8]  # what the HEAD wrapper ran
        variants = [(f"old direct ktpt={old_ktpt}", kr._direct_repack_kernel(8, "row_major_bytes", old_ktpt),
                     kr.direct_grid(k, n, 8, 1, old_ktpt), kr.DIRECT_THREADS, (rm,))]
        variants.append(("new tile", kr._transpose_repack_kernel(False), kr.transpose_grid(k, n, 1),
                         kr.TRANSPOSE_THREADS, (rm,)))
        cases.append(("row-major fp8 -> marlin", k * n, variants, (1, k // 16, 4 * n), 0))
        m8 = rand_words((1, k // 16, 4 * n))
        variants = [("old direct", kr._direct_unpack_kernel(8, "row_major_bytes", 1), kr.direct_grid(k, n, 8, 1, 1),
                     kr.DIRECT_THREADS, (m8,)),
                    ("new tile", kr._transpose_repack_kernel(True), kr.transpose_grid(k, n, 1), kr.TRANSPOSE_THREADS,
                     (m8,))]
        cases.append(("marlin -> row-major fp8", k * n, variants, (1, n, k // 4), 0))

        for name, nbytes, variants, out_shape, extra_read in cases:
            t_copy = copy_seconds(nbytes)
            reference = None
            for variant, kernel, grid, threads, args in variants:
                out = cuda.device_array(out_shape, np.uint32, stream=stream)
                cp.asarray(out).fill(0xDEADBEEF)
                cp.cuda.Device().synchronize()  # the fill ran on CuPy's stream
                t = timed(launcher(kernel, grid, threads, *args, out, n))
                got = cp.asarray(out).copy()
                same = True if reference is None else bool(cp.array_equal(got, reference))
                if reference is None:
                    reference = got
                frac = (2 * nbytes + extra_read) / t / (2 * nbytes / t_copy)
                row = dict(shape=shape, path=name, variant=variant, us=round(t * 1e6, 2),
                           copy_us=round(t_copy * 1e6, 2), fraction_of_copy=round(frac, 3), equals_old=same)
                rows.append(row)
                print(f"{shape:12s} {name:26s} {variant:20s} {row['us']:9.1f} us {100 * frac:6.1f}% of copy"
                      f"  equals old: {same}", flush=True)
                del out
            del reference
        del q, aw, m, rm, m8
        with open(path, "w") as f:
            json.dump(dict(gpu=gpu, reps=reps, commit=_git_commit(), rows=rows), f, indent=1)
    bad = [r for r in rows if not r["equals_old"]]
    return 1 if bad else 0


def kr_dummy_perm(cuda, stream):
    return cuda.to_device(np.zeros((1, 1), np.int32), stream=stream)

def markdown_table(rows) -> str:
    lines = ["| transform | shape | kernel µs | GB/s | copy GB/s | % of copy | note |",
             "|---|---|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['transform']} | {r['shape']} | {r['kernel_us']} | {r['bandwidth_GBps']} | "
                     f"{r['copy_GBps']} | {100 * r['fraction_of_copy']:.1f} | {r['note']} |")
    return "\n".join(lines)


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except Exception:
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
