"""Diagnose the Marlin GEMM's speed: sweep kernel configurations and grid sizes at fixed shapes, or run a few
launches for Nsight Compute.

    python bench/profile_gemm.py sweep            # prints µs per (shape, M, config, sms)
    ncu ... python bench/profile_gemm.py launch M K N [u4b8|u8b128|fe4m3fn]   # 3 launches (profile the last)

Weights are random words (timing does not depend on their values). Results feed bench/NOTES_gemm.md.
"""
from __future__ import annotations

import dataclasses
import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from bench_gemm import copies_for, l2_bytes, random_weight, time_cupy_graph, weight_bytes  # noqa: E402
from workbench import gemm  # noqa: E402
from workbench.scalar_types import ScalarType as S  # noqa: E402


def forced(config_fields):
    """Replace choose_config so that every launch uses the given (n_tiles, k_warp, stages)."""
    original = gemm.choose_config

    def choose(act, weight, size_m, size_n, size_k, group_size, per_row, smem_limit, thread_k=-1, thread_n=-1,
               **kwargs):
        base = original(act, weight, size_m, size_n, size_k, group_size, per_row, smem_limit, **kwargs)
        n_tiles, k_warp, stages = config_fields
        # one block per SM: the forced shape need not fit the 128-register two-block variant
        return dataclasses.replace(base, n_tiles=n_tiles, k_warp=k_warp, stages=stages, blocks_per_sm=1)

    return original, choose


def time_case(cp, m, k, n, wt=S.U4B8, gs=128, sms=-1, config=None):
    rng = np.random.default_rng(0)
    l2 = l2_bytes(cp)
    ws = [random_weight(cp, k, n, wt, gs, np.float16, rng) for _ in range(copies_for(weight_bytes(k, n, wt, gs), l2))]
    a = [cp.asarray(rng.standard_normal((m, k), dtype=np.float32).astype(np.float16)) for _ in range(2)]
    c = cp.empty((m, n), dtype=np.float16)
    n_sms = gemm.device_properties(0)[1]
    work = cp.zeros(gemm.workspace_numel(n_sms), dtype=np.int32)
    c_tmp = cp.empty(gemm.c_tmp_numel(n_sms), dtype=np.float32)
    original = None
    if config is not None:
        original, gemm.choose_config = forced(config)
    try:
        launches = [(lambda s, i=i: gemm.marlin_gemm(a[i % 2], ws[i % len(ws)], c=c, workspace=work, c_tmp=c_tmp,
                                                     stream=s, sms=sms)) for i in range(20)]
        return time_cupy_graph(cp, launches)
    finally:
        if original is not None:
            gemm.choose_config = original


def sweep() -> None:
    import cupy as cp

    cases = [
        (1, 8192, 8192, [(2, 4, 8), (2, 4, 6), (2, 4, 4), (2, 2, 8), (2, 2, 4), (1, 1, 8), (2, 1, 8), (4, 2, 8)]),
        (16, 8192, 8192, [(2, 4, 8), (2, 2, 8), (1, 1, 8)]),
        (64, 4096, 4096, [(4, 2, 4), (2, 2, 4), (2, 1, 4), (1, 1, 4)]),
    ]
    for m, k, n, configs in cases:
        for cfg in configs:
            for sms in (-1, 66):
                try:
                    us = time_case(cp, m, k, n, config=cfg, sms=sms)
                    print(f"M={m:3d} K={k} N={n} (n_tiles, k_warp, stages)={cfg} sms={sms:4d}: {us:8.2f} us",
                          flush=True)
                except Exception as exc:  # a config may not fit shared memory
                    print(f"M={m} {cfg} sms={sms}: {exc!r}", flush=True)
    for wt, gs in ((S.U8B128, 128), (S.FE4M3FN, -1), (S.U4, 128)):
        us = time_case(cp, 1, 8192, 8192, wt=wt, gs=gs)
        print(f"M=1 8192x8192 {wt} g{gs}: {us:.2f} us", flush=True)


def launch(m: int, k: int, n: int, weight: str = "u4b8") -> None:
    import cupy as cp

    wt = S[weight.upper()]
    rng = np.random.default_rng(0)
    w = random_weight(cp, k, n, wt, -1 if wt is S.FE4M3FN else 128, np.float16, rng)
    a = cp.asarray(rng.standard_normal((m, k), dtype=np.float32).astype(np.float16))
    for _ in range(3):
        gemm.marlin_gemm(a, w)
    cp.cuda.Device().synchronize()


if __name__ == "__main__":
    if sys.argv[1] == "sweep":
        sweep()
    else:
        launch(*(int(x) for x in sys.argv[2:5]), *sys.argv[5:6])
