"""Speed of the NumPy reference repacks on one CPU core (issue 2): fixed shapes and seeds, median of repeats.

    python bench/bench_reference.py [--repeats 7] [--out bench/results/reference_cpu.json]

Runs single-threaded (OMP/OPENBLAS threads = 1) so the figure is per core.
"""
from __future__ import annotations

import os

for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(var, "1")

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from workbench import ops  # noqa: E402
from workbench.formats import fp8, packing  # noqa: E402

SEED = 1234


def _time(fn, repeats: int) -> float:
    fn()  # warm
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def cases():
    rng = np.random.default_rng(SEED)
    k, n = 4096, 14336
    q4 = packing.pack_rows(rng.integers(0, 16, size=(k, n), dtype=np.uint8), 4)
    q8 = packing.pack_rows(rng.integers(0, 256, size=(k, n), dtype=np.uint8), 8)
    perm = rng.permutation(k).astype(np.int32)
    awq = packing.awq_pack(rng.integers(0, 16, size=(k, n), dtype=np.uint8), 4)
    row_major = rng.integers(0, 256, size=(n, k), dtype=np.uint8)
    scales = rng.standard_normal((k // 128, n)).astype(np.float16)
    inv = rng.uniform(1e-4, 1e-2, size=(n // 128, k // 128)).astype(np.float32)
    return [
        ("gptq_marlin_repack u4", (k, n), q4.nbytes, lambda: ops.gptq_marlin_repack(q4, None, k, n, 4)),
        ("gptq_marlin_repack u4 act-order", (k, n), q4.nbytes, lambda: ops.gptq_marlin_repack(q4, perm, k, n, 4)),
        ("awq_marlin_repack u4", (k, n), awq.nbytes, lambda: ops.awq_marlin_repack(awq, k, n, 4)),
        ("gptq_marlin_repack u8", (k, n), q8.nbytes, lambda: ops.gptq_marlin_repack(q8, None, k, n, 8)),
        ("block_fp8_group128_repack", (k, n), row_major.nbytes,
         lambda: ops.block_fp8_group128_repack(row_major, k, n)),
        ("marlin_permute_scales g128", (k, n), scales.nbytes, lambda: ops.marlin_permute_scales(scales, k, n, 128)),
        ("block_fp8_group128_scales", (k, n), inv.nbytes, lambda: ops.block_fp8_group128_scales(inv, k, n)),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default="bench/results/reference_cpu.json")
    args = ap.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    rows = []
    for name, (k, n), nbytes, fn in cases():
        t = _time(fn, args.repeats)
        rows.append({"op": name, "K": k, "N": n, "input_MB": nbytes / 1e6, "median_s": t,
                     "MB_per_s": nbytes / 1e6 / t})
        print(f"{name:34s} {k}x{n}  {nbytes / 1e6:8.1f} MB  {t * 1e3:8.1f} ms  {nbytes / 1e6 / t:8.0f} MB/s")
    meta = {"date": datetime.date.today().isoformat(), "commit": commit, "cpu": platform.processor() or
            platform.machine(), "numpy": np.__version__, "threads": 1, "repeats": args.repeats}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
