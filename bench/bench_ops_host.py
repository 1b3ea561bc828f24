"""Host time per call of every public op on device arrays, the runtime launch against Numba's dispatcher, and the
end-to-end bandwidth of the weight repacks on a layer of more than 100 MB (GPU only).

1. **Bitwise**: every op on fresh random inputs, launched through the runtime and again inside
   ``kernels_numba._launch.numba_dispatcher()`` (Numba's own launch of the same kernels), and through the NumPy
   reference: the three outputs must be equal byte for byte.
2. **Host µs per call** at steady state, CuPy and torch inputs: a small layer (the GPU work per call stays below the
   host's), ``--calls`` calls queued back to back without a synchronisation, wall time / calls, median of 5
   batches. Ops that must read a device verdict before they return (a device perm's check, zero-point codes, GPTQ
   v1 qzeros) synchronise inside the call; their time includes the kernel's.
3. **% of copy incl. host** on K×N = 8192×28672 (u4: 117 MB in, 117 MB out): per call, wall time from the call to
   the stream's end (median of ``--reps``), bytes moved / time, against a device-to-device copy of the same bytes
   timed the same way (call + synchronise).

    python bench/bench_ops_host.py --out /tmp/ops_host.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

SMALL = (1024, 1024)  # K, N for the host-time cells
LAYER = (8192, 28672)
GROUP = 128


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="ops_host.json")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--only", default="", help="comma-separated substrings: time only the ops whose names hold one")
    args = parser.parse_args()

    import cupy as cp
    import ml_dtypes
    import torch

    from kernels_numba._launch import numba_dispatcher
    from workbench import ops
    from workbench.formats import fp8 as fp8_fmt

    rng = np.random.default_rng(7)
    k, n = SMALL
    ng = k // GROUP

    def words(shape):
        return rng.integers(0, 2 ** 32, size=shape, dtype=np.uint64).astype(np.uint32).view(np.int32)

    perm = rng.permutation(k).astype(np.int32)
    host = {
        "q4": words((k // 8, n)), "q8": words((k // 4, n)), "awq4": words((k, n // 8)),
        "perm": perm, "fp8_rows": rng.integers(0, 256, size=(n, k), dtype=np.uint8),
        "s16": rng.standard_normal((ng, n)).astype(np.float16),
        "sbf": rng.standard_normal((ng, n)).astype(np.float32).astype(ml_dtypes.bfloat16),
        "codes": rng.integers(0, 16, size=(ng, n), dtype=np.uint8),
        "zp4": words((ng, n // 8)), "inv": (rng.random((n // 128, k // 128)) + 0.5).astype(np.float32),
    }
    host["fp8_kmajor"] = fp8_fmt.pack_fp8_to_int32(host["fp8_rows"])
    from workbench.formats import marlin_tile, packing

    host["v1"] = packing.pack_cols(rng.integers(0, 15, size=(ng, n), dtype=np.uint8), 4)  # no all-ones field
    host["m4"] = ops.gptq_marlin_repack(host["q4"], None, k, n, 4, backend="numpy")
    host["m8"] = ops.gptq_marlin_repack(host["q8"], None, k, n, 8, backend="numpy")
    host["zpm"] = ops.marlin_zero_points(host["codes"], k, n, 4, backend="numpy")
    host["zpm_nz"] = ops.marlin_zero_points(host["codes"] | np.uint8(1), k, n, 4, backend="numpy")
    host["sm16"] = ops.marlin_permute_scales(host["s16"], k, n, GROUP, backend="numpy")
    del marlin_tile

    cases = [  # (op name, tensors, call(x, **kw))
        ("gptq_marlin_repack u4", ("q4",), lambda x, **kw: ops.gptq_marlin_repack(x[0], None, k, n, 4, **kw)),
        ("gptq_marlin_repack u8", ("q8",), lambda x, **kw: ops.gptq_marlin_repack(x[0], None, k, n, 8, **kw)),
        ("gptq_marlin_repack u4 act-order", ("q4", "perm"),
         lambda x, **kw: ops.gptq_marlin_repack(x[0], x[1], k, n, 4, **kw)),
        ("awq_marlin_repack u4", ("awq4",), lambda x, **kw: ops.awq_marlin_repack(x[0], k, n, 4, **kw)),
        ("fp8_marlin_repack_raw_bits", ("fp8_kmajor",),
         lambda x, **kw: ops.fp8_marlin_repack_raw_bits(x[0], k, n, **kw)),
        ("block_fp8_group128_repack", ("fp8_rows",),
         lambda x, **kw: ops.block_fp8_group128_repack(x[0], k, n, **kw)),
        ("marlin_permute_scales f16", ("s16",), lambda x, **kw: ops.marlin_permute_scales(x[0], k, n, GROUP, **kw)),
        ("marlin_permute_scales bf16", ("sbf",), lambda x, **kw: ops.marlin_permute_scales(x[0], k, n, GROUP, **kw)),
        ("marlin_zero_points", ("codes",), lambda x, **kw: ops.marlin_zero_points(x[0], k, n, 4, **kw)),
        ("awq_to_marlin_zero_points", ("zp4",), lambda x, **kw: ops.awq_to_marlin_zero_points(x[0], k, n, 4, **kw)),
        ("repack_gptq_qzeros_to_marlin", ("v1",),
         lambda x, **kw: ops.repack_gptq_qzeros_to_marlin(x[0], k, n, GROUP, 4, **kw)),
        ("block_fp8_group128_scales", ("inv",),
         lambda x, **kw: ops.block_fp8_group128_scales(x[0], k, n, np.float16, **kw)),
        ("marlin_to_gptq_qweight u4", ("m4",), lambda x, **kw: ops.marlin_to_gptq_qweight(x[0], None, k, n, 4, **kw)),
        ("marlin_to_gptq_qweight u4 act-order", ("m4", "perm"),
         lambda x, **kw: ops.marlin_to_gptq_qweight(x[0], x[1], k, n, 4, **kw)),
        ("marlin_to_awq_qweight u4", ("m4",), lambda x, **kw: ops.marlin_to_awq_qweight(x[0], k, n, 4, **kw)),
        ("marlin_to_fp8_raw_bits", ("m8",), lambda x, **kw: ops.marlin_to_fp8_raw_bits(x[0], k, n, **kw)),
        ("marlin_to_block_fp8", ("m8",), lambda x, **kw: ops.marlin_to_block_fp8(x[0], k, n, **kw)),
        ("marlin_unpermute_scales f16", ("sm16",),
         lambda x, **kw: ops.marlin_unpermute_scales(x[0], k, n, GROUP, **kw)),
        ("marlin_zero_points_to_codes", ("zpm",),
         lambda x, **kw: ops.marlin_zero_points_to_codes(x[0], k, n, 4, **kw)),
        ("marlin_to_awq_zero_points", ("zpm",), lambda x, **kw: ops.marlin_to_awq_zero_points(x[0], k, n, 4, **kw)),
        ("marlin_to_gptq_qzeros", ("zpm_nz",),
         lambda x, **kw: ops.marlin_to_gptq_qzeros(x[0], k, n, GROUP, 4, **kw)),
        ("gptq_qzeros_are_symmetric_code7", ("v1",),
         lambda x, **kw: ops.gptq_qzeros_are_symmetric_code7(x[0], 4, **kw)),
    ]

    def to_bytes(y):
        if isinstance(y, (bool, np.bool_)):
            return np.array([y], np.uint8)
        if isinstance(y, torch.Tensor):
            y = y.contiguous().view(torch.uint8).cpu().numpy()
        elif isinstance(y, cp.ndarray):
            y = cp.asnumpy(y)
        return np.ascontiguousarray(np.asarray(y)).view(np.uint8).ravel()

    def on(framework, names):
        out = []
        for name in names:
            a = host[name]
            if framework == "cupy":
                out.append(cp.asarray(a.view(np.uint16) if a.dtype == ml_dtypes.bfloat16 else a))
            else:
                t = torch.from_numpy(a.view(np.uint16) if a.dtype == ml_dtypes.bfloat16 else a).cuda()
                out.append(t.view(torch.bfloat16) if a.dtype == ml_dtypes.bfloat16 else t)
        return out

    rows, failures = [], []
    torch.cuda.synchronize()
    only = [w for w in args.only.split(",") if w]
    cases = [c for c in cases if not only or any(w in c[0] for w in only)]
    for name, tensors, call in cases:
        for framework in ("cupy", "torch"):
            x = on(framework, tensors)
            try:
                ref = to_bytes(call([host[t] for t in tensors], backend="numpy"))
                got = to_bytes(call(x, backend="numba"))
                with numba_dispatcher():
                    old = to_bytes(call(x, backend="numba"))
                same = np.array_equal(got, old) and np.array_equal(got, ref)
                if not same:
                    failures.append(f"{name} [{framework}]: runtime == dispatcher {np.array_equal(got, old)}, "
                                    f"== reference {np.array_equal(got, ref)}")
                timings = []
                for _ in range(5):
                    cp.cuda.Device().synchronize()
                    t0 = time.perf_counter()
                    for _ in range(args.calls):
                        call(x, backend="numba")
                    timings.append((time.perf_counter() - t0) / args.calls)
                    cp.cuda.Device().synchronize()
                us = statistics.median(timings) * 1e6
                with numba_dispatcher():
                    t0 = time.perf_counter()
                    for _ in range(20):
                        call(x, backend="numba")
                    us_old = (time.perf_counter() - t0) / 20 * 1e6
                    cp.cuda.Device().synchronize()
                replayed = to_bytes(call(x, backend="numba"))  # a call through its plan: the same bytes
                same = same and np.array_equal(replayed, ref)
                if not np.array_equal(replayed, ref):
                    failures.append(f"{name} [{framework}]: the replayed call differs from the reference")
                rows.append(dict(op=name, framework=framework, k=k, n=n, method="ours", us=round(us, 1),
                                 us_numba_dispatcher=round(us_old, 1), bitwise=bool(same)))
                print(f"{name:40s} {framework:6s} host {us:7.1f} us/call   dispatcher {us_old:7.1f}   "
                      f"bitwise {same}", flush=True)
            except Exception as exc:  # report and go on: one broken cell must not hide the others
                failures.append(f"{name} [{framework}]: {type(exc).__name__}: {exc}")
                print(f"{name:40s} {framework:6s} FAILED {type(exc).__name__}: {exc}", flush=True)

    # end-to-end bandwidth incl. host on a >= 100 MB layer
    lk, ln = LAYER
    bw_rows = []
    stream = cp.cuda.get_current_stream()

    def wall(fn):
        fn()
        stream.synchronize()
        ts = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            fn()
            stream.synchronize()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    big = {"u4": cp.asarray(words((lk // 8, ln))), "awq": cp.asarray(words((lk, ln // 8))),
           "perm": cp.asarray(rng.permutation(lk).astype(np.int32))}
    nbytes = big["u4"].nbytes
    dst = cp.empty_like(big["u4"])
    t_copy = wall(lambda: dst.data.copy_from_device_async(big["u4"].data, nbytes, stream))
    copy_gbs = 2 * nbytes / t_copy / 1e9
    for label, wtype, fn, extra in (
            ("gptq_marlin_repack", "u4", lambda: ops.gptq_marlin_repack(big["u4"], None, lk, ln, 4), 0),
            ("gptq_marlin_repack act-order", "u4",
             lambda: ops.gptq_marlin_repack(big["u4"], big["perm"], lk, ln, 4), lk * 4),
            ("awq_marlin_repack", "u4", lambda: ops.awq_marlin_repack(big["awq"], lk, ln, 4), 0)):
        try:
            t = wall(fn)
            gbs = (2 * nbytes + extra) / t / 1e9
            bw_rows.append(dict(op=label, k=lk, n=ln, wtype=wtype, method="ours", us=round(t * 1e6, 1),
                                gbs=round(gbs, 1), pct_copy=round(100 * gbs / copy_gbs, 1), launch="plain, incl. host"))
            print(f"{label:32s} {lk}x{ln} {t * 1e6:8.1f} us  {gbs:7.1f} GB/s  {100 * gbs / copy_gbs:5.1f}% of copy "
                  f"({copy_gbs:.0f} GB/s)", flush=True)
        except Exception as exc:
            failures.append(f"{label} layer: {type(exc).__name__}: {exc}")
            print(f"{label} layer FAILED {type(exc).__name__}: {exc}", flush=True)

    props = cp.cuda.runtime.getDeviceProperties(0)
    result = {"schema": 1, "family": "host",
              "meta": {"gpu": props["name"].decode(), "sms": props["multiProcessorCount"],
                       "date": datetime.date.today().isoformat(), "torch": torch.__version__, "cupy": cp.__version__,
                       "ceilings": {"copy_gbs": round(copy_gbs, 1)},
                       "method": {"host_calls": args.calls, "batches": 5, "small_layer": list(SMALL),
                                  "layer": list(LAYER), "layer_reps": args.reps,
                                  "layer_timing": "wall time call + stream synchronize, median"}},
              "rows": rows + bw_rows, "failures": failures}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"{len(failures)} failure(s)" + "".join(f"\n  {m}" for m in failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
