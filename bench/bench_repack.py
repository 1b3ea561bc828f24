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
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from repack_timer import DeviceTimer  # noqa: E402

SHAPES = [(8192, 28672), (28672, 8192)]
MOE = (64, 2048, 1408)  # experts, K, N
GROUP = 128


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/results", help="directory for the JSON and CSV results")
    parser.add_argument("--reps", type=int, default=25, help="timed repetitions per transform (median reported)")
    parser.add_argument("--sweep", action="store_true", help="also sweep the repack launch shape")
    parser.add_argument("--inverse-only", action="store_true",
                        help="only the inverse repacks (Marlin -> GPTQ u4/u8, AWQ u4/u8, row-major FP8) on every "
                             "shape incl. the stacked experts, each input made by the wrappers' forward launch "
                             "(untimed) and each output checked to round-trip")
    parser.add_argument("--ab", action="store_true",
                        help="round-4 A/B only: HEAD kernels (--ab-old) vs the working tree's, same inputs")
    parser.add_argument("--ab-shapes", default="8192x28672,28672x8192,64x2048x1408",
                        help="comma list of KxN or EXPERTSxKxN cells for --ab")
    parser.add_argument("--ab-old", default="artifacts/r4_repack_old",
                        help="folder holding the HEAD copy of kernels_numba/marlin_repack.py")
    args = parser.parse_args()
    if args.reps < 20:
        parser.error("--reps must be at least 20")
    if args.ab:
        cells = []
        for cell in args.ab_shapes.split(","):
            dims = tuple(int(v) for v in cell.split("x"))
            cells.append(dims if len(dims) == 3 else (1,) + dims)
        return ab_main(args.out, args.reps, cells, args.ab_old)

    import cupy as cp
    from numba import cuda

    from kernels_numba import marlin_repack as kr
    from kernels_numba import scales as ks

    timer = DeviceTimer(args.reps)
    gpu, stream, timed = timer.gpu, timer.stream, timer.timed
    rand_words, rand_u8 = timer.rand_words, timer.rand_u8

    rows = []

    def record(name, shape, nbytes_read, nbytes_written, seconds, note=""):
        copy_bytes = max(nbytes_read, nbytes_written)
        t_copy = timer.copy_seconds(copy_bytes)
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
        sweep = ktpt is not None or direct_threads != kr.DIRECT_THREADS or direct_row_major
        if not staged and not sweep:  # exactly the wrappers' kernel and grid
            out, launch = repack_launch(kr, src, perm, bits, source, k, n, stream)
        elif source in ("gptq", "row_major_bytes") and not staged:  # launch-shape sweep of the direct kernel
            out = cuda.device_array((experts, k // 16, n * 16 // pf), np.uint32, stream=stream)
            kernel = kr._direct_repack_kernel(bits, source, ktpt, direct_threads)
            grid = kr.direct_grid(k, n, bits, experts, ktpt, direct_threads)
            launch = lambda: kernel[grid, direct_threads, stream](src, out, n)  # noqa: E731
        else:
            out = cuda.device_array((experts, k // 16, n * 16 // pf), np.uint32, stream=stream)
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

    def weight_unpack(name, bits, target, k, n, marlin):
        out, launch = unpack_launch(kr, marlin, bits, target, k, n, stream)  # exactly the wrappers' kernel and grid
        cp.asarray(out).fill(0xDEADBEEF)  # poisoned: an unwritten word fails the round-trip check
        cp.cuda.Device().synchronize()  # the fill ran on CuPy's stream
        launch()
        stream.synchronize()
        experts = marlin.shape[0]
        nbytes = experts * k * n // (32 // bits) * 4
        record(name, f"{experts}x{k}x{n}" if experts > 1 else f"{k}x{n}", nbytes, nbytes, timed(launch))
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
        weight_repack("stacked gptq_marlin_repack u4", 4, "gptq", k, n, q4, experts=experts, note="one launch")
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

    def inverses(experts, k, n):
        """Every inverse the wrappers run, on a layer made by the wrappers' forward launch (not timed)."""
        for bits in (4, 8):
            pf = 32 // bits
            for source, target, label, src_shape in (
                    ("gptq", "gptq", f"marlin_to_gptq_qweight u{bits}", (experts, k // pf, n)),
                    ("awq", "awq", f"marlin_to_awq_qweight u{bits}", (experts, k, n // pf)),
                    ("row_major_bytes", "row_major_bytes", "marlin_to_block_fp8 (row-major)", (experts, n, k // 4))):
                if source == "row_major_bytes" and bits == 4:
                    continue
                src = rand_words(src_shape)
                marlin, forward = repack_launch(kr, src, None, bits, source, k, n, stream)
                forward()
                stream.synchronize()
                back = weight_unpack(("stacked " if experts > 1 else "") + label, bits, target, k, n, marlin)
                cell = f"{experts}x{k}x{n}" if experts > 1 else f"{k}x{n}"
                checks[f"{label} round trip {cell}"] = bool(cp.array_equal(cp.asarray(back), cp.asarray(src)))
                del src, marlin, back

    if args.inverse_only:
        for k, n in SHAPES:
            guarded(f"inverses {k}x{n}", inverses, 1, k, n)
        guarded("stacked inverses", inverses, *MOE)
    else:
        for k, n in SHAPES:
            guarded(f"layer {k}x{n}", layer, k, n)
        guarded("stacked loader wall time", loader_wall_time)
        guarded("stacked experts", stacked_experts)

    commit = os.environ.get("BENCH_COMMIT") or _git_commit()
    meta = dict(date=datetime.date.today().isoformat(), gpu=gpu, compute_capability=timer.compute_capability,
                commit=commit, reps=args.reps, method="CUDA events, median, L2 flushed, launch hidden behind a "
                "sleep kernel; copy = cudaMemcpyAsync D2D of max(read, written) bytes", checks=checks,
                errors=errors)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"repack{'_inverse' if args.inverse_only else ''}_{meta['date']}_"
                                  f"{gpu.replace(' ', '_')}")
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


def repack_launch(kr, src, perm, bits: int, source: str, k: int, n: int, stream):
    """(out, launch): the table's weight repack, a fresh output [E, K/16, N*16/pf] and the wrappers' own launch
    (``kr.weight_repack_launch``, with the two-pass temporary where the wrapper allocates one). Module level so a
    simulator test can check it against the wrappers (tests/sim/test_bench_dispatch.py)."""
    from numba import cuda

    experts, pf = src.shape[0], 32 // bits
    out = cuda.device_array((experts, k // 16, n * 16 // pf), np.uint32, stream=stream)
    temp = cuda.device_array((1, k, n // pf), np.uint32, stream=stream) if kr.uses_two_pass(source, experts) else None
    return out, kr.weight_repack_launch(src, perm, out, bits, source, k, n, stream, temp)


def unpack_launch(kr, marlin, bits: int, target: str, k: int, n: int, stream):
    """(out, launch): the table's inverse repack, a fresh uint32 output (``kr.unpack_shape``) and the wrappers' own
    launch (``kr.weight_unpack_launch``). Module level for the same simulator test."""
    from numba import cuda

    out = cuda.device_array(kr.unpack_shape(target, k, n, bits, marlin.shape[0]), np.uint32, stream=stream)
    return out, kr.weight_unpack_launch(marlin, out, bits, target, k, n, stream)


def load_old_module(old_dir: str):
    """The HEAD copy of kernels_numba/marlin_repack.py placed under ``old_dir`` (the A/B's "old" kernels)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("marlin_repack_old", os.path.join(old_dir, "marlin_repack.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["marlin_repack_old"] = module
    spec.loader.exec_module(module)
    return module


def ab_main(out_dir: str, reps: int, cells, old_dir: str) -> int:
    """Round-4 A/B: for each changed path, the HEAD kernel (loaded from ``old_dir``) against the working tree's
    variants, in one process, on the same fresh random inputs; every output starts poisoned (0xDEADBEEF) and every
    new output is compared bit for bit with the old one. ``cells``: (experts, K, N). Writes
    OUT/ab_repack_r4_<gpu>.json after every cell; prints µs and % of copy per variant."""
    import cupy as cp
    from numba import cuda

    from kernels_numba import marlin_repack as new

    old = load_old_module(old_dir)
    timer = DeviceTimer(reps)
    stream = timer.stream
    threads = new.DIRECT_THREADS

    def launcher(kernel, grid, block, inputs, size_n):
        """out -> a launch of kernel(*inputs, out, size_n) on the timer's stream."""
        return lambda out: (lambda: kernel[grid, block, stream](*inputs, out, size_n))

    rows = []
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"ab_repack_r4_{timer.gpu.replace(' ', '_')}.json")
    for experts, k, n in cells:
        shape = f"{experts}x{k}x{n}" if experts > 1 else f"{k}x{n}"
        # (path, bytes one way, extra bytes read, out shape (uint32), [(variant, out -> launch, compared)])
        cases = []
        for bits in (4, 8):
            pf = 32 // bits
            mshape = (experts, k // 16, n * 16 // pf)
            q = timer.rand_words((experts, k // pf, n))
            perm = timer.rand_perms(experts, k)
            temp = cuda.device_array((1, k, n // pf), np.uint32, stream=stream)
            if experts == 1:  # HEAD's route for one matrix: its two-pass launcher (k-fastest pass 2)
                variants = [("old two-pass", lambda out, q=q, perm=perm, temp=temp, bits=bits: (
                    lambda: old.launch_act_order_two_pass(q, perm, out, k, n, bits, stream, temp)), True)]
                for nfast in (True, False):
                    variants.append((f"new two-pass pass2 n_fastest={nfast}",
                                     lambda out, q=q, perm=perm, temp=temp, bits=bits, nfast=nfast: (
                                         lambda: new.launch_act_order_two_pass(q, perm, out, k, n, bits, stream, temp,
                                                                               nfast)), True))
                for label, mod in (("old", old), ("new", new)):  # pass 1 alone writes temp, not out
                    npk = mod._npacked_kernel(bits)
                    npk_grid = mod.npacked_grid(k, n, bits, 1)
                    variants.append((f"{label} pass 1 only", lambda out, npk=npk, npk_grid=npk_grid, q=q, temp=temp,
                                     block=mod.NPACK_THREADS: (lambda: npk[npk_grid, block, stream](q, temp, n)),
                                     False))
                ktpt2 = new.ACT_ORDER_PASS2_K_TILES_PER_THREAD[bits]
                for nfast in (False, True):  # temp holds pass 1 of q by then
                    gather = new._awq_direct_repack_kernel(bits, ktpt2, threads, True, True, nfast)
                    variants.append((f"new pass 2 only n_fastest={nfast}",
                                     launcher(gather, new.awq_grid(k, n, bits, 1, ktpt2, threads, nfast), threads,
                                              (temp, perm), n), True))
            else:  # stacks keep the one-pass kernel (round 4: its opening and stores are shared device functions)
                variants = [(f"{label} one-pass ktpt={mod.PERM_K_TILES_PER_THREAD[bits]}",
                             launcher(mod._perm_repack_kernel(bits), mod.perm_grid(k, n, bits, experts), threads,
                                      (q, perm), n), True) for label, mod in (("old", old), ("new", new))]
            cases.append((f"act-order u{bits}", experts * k * n // pf * 4, experts * k * 4, mshape, variants))

            # GPTQ -> Marlin, the direct kernel (round 4: tidied into shared device functions; SASS unchanged but
            # for register numbering): must not move
            variants = [(f"{label} direct", launcher(mod._direct_repack_kernel(bits, "gptq"),
                                                     mod.direct_grid(k, n, bits, experts), threads, (q,), n), True)
                        for label, mod in (("old", old), ("new", new))]
            cases.append((f"gptq->marlin u{bits} (tidy)", experts * k * n // pf * 4, 0, mshape, variants))

            aw = timer.rand_words((experts, k, n // pf))  # AWQ -> Marlin: the n-fastest grid, for information
            variants = [("old", launcher(old._awq_direct_repack_kernel(bits), old.awq_grid(k, n, bits, experts),
                                         threads, (aw,), n), True)]
            for nfast in (False, True):  # the wrapper's kernel (unsigned indices) on both grid orders
                fwd = new._awq_direct_repack_kernel(bits, None, threads, False, False, nfast)
                variants.append((f"new n_fastest={nfast}", launcher(fwd, new.awq_grid(k, n, bits, experts, None,
                                                                                      threads, nfast),
                                                                   threads, (aw,), n), True))
            cases.append((f"awq->marlin u{bits}", experts * k * n // pf * 4, 0, mshape, variants))

            m = timer.rand_words(mshape)  # any words are a valid Marlin layer
            old_grid = old.awq_grid(k, n, bits, experts, 1)
            old_kernel = old._awq_direct_unpack_kernel(bits, True)
            variants = [("old 8-byte stores", lambda out, m=m, kernel=old_kernel: (
                lambda: kernel[old_grid, threads, stream](m, out.view(np.uint64), n)), True)]
            for use_transpose, nfast in ((True, True), (True, False), (False, True)):
                kernel = new._awq_direct_unpack_kernel(bits, True, use_transpose, nfast)
                grid = new.awq_grid(k, n, bits, experts, 1, threads, nfast)
                variants.append((f"new transpose={use_transpose} n_fastest={nfast}",
                                 lambda out, m=m, kernel=kernel, grid=grid: (
                                     lambda: kernel[grid, threads, stream](m, out.view(np.uint64), n)), True))
            cases.append((f"marlin->awq u{bits}", experts * k * n // pf * 4, 0, (experts, k, n // pf), variants))
        m8 = timer.rand_words((experts, k // 16, 4 * n))
        tgrid = old.transpose_grid(k, n, experts)
        variants = [(f"old tile ({old.TRANSPOSE_INVERSE_MODE})", launcher(old._transpose_repack_kernel(True), tgrid,
                                                                         old.TRANSPOSE_THREADS, (m8,), n), True)]
        for mode in ("staged_marlin", "loads_first"):
            kernel = new._transpose_repack_kernel(True, mode)
            variants.append((f"new {mode}", launcher(kernel, new.transpose_grid(k, n, experts), new.TRANSPOSE_THREADS,
                                                      (m8,), n), True))
        cases.append(("marlin -> row-major fp8", experts * k * n, 0, (experts, n, k // 4), variants))

        for name, nbytes, extra_read, out_shape, variants in cases:
            t_copy = timer.copy_seconds(nbytes)
            reference = None
            for variant, make_launch, compared in variants:
                out = cuda.device_array(out_shape, np.uint32, stream=stream)
                cp.asarray(out).fill(0xDEADBEEF)
                cp.cuda.Device().synchronize()  # the fill ran on CuPy's stream
                t = timer.timed(make_launch(out))
                got = cp.asarray(out).copy()
                if reference is None:
                    reference, same = got, True
                else:
                    same = bool(cp.array_equal(got, reference)) if compared else None
                frac = (2 * nbytes + extra_read) / t / (2 * nbytes / t_copy)
                row = dict(shape=shape, path=name, variant=variant, us=round(t * 1e6, 2),
                           copy_us=round(t_copy * 1e6, 2), fraction_of_copy=round(frac, 3), equals_old=same)
                rows.append(row)
                print(f"{shape:16s} {name:24s} {variant:34s} {row['us']:9.1f} us {100 * frac:6.1f}% of copy"
                      f"  equals old: {same}", flush=True)
                del out, got
            del reference
        cases.clear()
        with open(path, "w") as f:
            json.dump(dict(gpu=timer.gpu, reps=reps, commit=_git_commit(), rows=rows), f, indent=1)
    bad = [r for r in rows if r["equals_old"] is False]
    return 1 if bad else 0


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
