"""The native Marlin GEMM at the layer shapes bench/bench_gemm.py times, with the configuration and grid the library
picks for them, against the fp32 NumPy reference.

tests/gpu/test_gemm.py covers every feature on small layers; there every block gets one or two pipeline steps. At the
benchmark's shapes the grid has 128-264 blocks that stream tens of steps, straddle slice ends and share slices with
the cross-block reduction — the partitions the published timings come from. A speed number is only worth publishing
for a kernel that is right at that shape, so these cells are checked here (poisoned output, fp32 bound of
test_gemm.error_bound).

Weights: random codes, scales and zero points straight into a ``QuantizedWeight`` (no float quantization: that costs
tens of seconds per layer at these sizes), repacked by the NumPy reference ops; the reference is their exact
dequantization (``workbench.quantize.dequantize``).
"""
import functools

import numpy as np
import pytest

from workbench import gemm, hardware
from workbench.quantize import QuantizedWeight, dequantize
from workbench.scalar_types import ScalarType as S
from workbench.weight import make_marlin_weight

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not hardware.cupy_available(), reason="no CUDA GPU visible to CuPy")]

cp = pytest.importorskip("cupy")

from gpu.test_gemm import error_bound, poisoned  # noqa: E402  (tests/ is on the pytest pythonpath)

LAYERS = ((4096, 4096), (4096, 14336), (14336, 4096), (8192, 8192), (8192, 28672), (28672, 8192))
# (weight type, group size, layers, M values): every layer for the INT4 headline type, the largest layers and the
# square one for the others (each weight build costs seconds of host time).
CASES = ([(S.U4B8, 128, kn, m) for kn in LAYERS for m in (1, 8, 16, 64)]
         + [(S.FE4M3FN, -1, kn, m) for kn in ((8192, 8192), (8192, 28672), (28672, 8192)) for m in (1, 16)]
         + [(S.U8B128, 128, kn, m) for kn in ((8192, 8192), (8192, 28672)) for m in (1, 16)]
         + [(S.U4, 128, (8192, 28672), m) for m in (1, 16)])


@functools.lru_cache(maxsize=2)
def layer(wt, gs, k, n):
    """(device MarlinWeight, reference W (K, N) float32) with fresh random codes, scales and zero points."""
    rng = np.random.default_rng()
    ng = 1 if gs == -1 else k // gs
    if wt is S.FE4M3FN:
        codes = rng.integers(0, 256, size=(k, n), dtype=np.uint8)
        codes[(codes & 0x7F) == 0x7F] ^= 1  # no NaN codes (S.1111.111)
        scales = (rng.random((ng, n), dtype=np.float32) * 0.02 + 0.001).astype(np.float32)
    else:
        codes = rng.integers(0, 1 << wt.bits, size=(k, n), dtype=np.uint8)
        scales = (rng.random((ng, n), dtype=np.float32) * 0.02 + 0.001).astype(np.float16)
    zeros = rng.integers(0, 1 << wt.bits, size=(ng, n), dtype=np.uint8) if wt.has_zero_points else None
    w_ref = dequantize(codes, scales, zeros, wt, gs, act_dtype=np.float16)
    q = QuantizedWeight(codes, scales, zeros, None, gs, wt, np.dtype(np.float16), w_ref)
    return gemm.upload_weight(make_marlin_weight(q)), w_ref


@pytest.mark.parametrize("wt,gs,kn,m", CASES, ids=lambda v: str(v))
def test_bench_shape_matches_reference(wt, gs, kn, m):
    k, n = kn
    w, w_ref = layer(wt, gs, k, n)
    rng = np.random.default_rng()
    a = rng.standard_normal((m, k), dtype=np.float32).astype(np.float16)
    c = poisoned(m, n, np.float16)
    out = cp.asnumpy(gemm.marlin_gemm(cp.asarray(a), w, c=c)).astype(np.float32)
    assert np.all(np.isfinite(out)), f"{int((~np.isfinite(out)).sum())} elements not written (or not finite)"
    ref = a.astype(np.float32) @ w_ref
    bound = error_bound(a, w_ref, np.float16, "fp32", k)  # the default reduction: fp32 partials
    excess = np.abs(out - ref) - bound
    worst = np.unravel_index(int(np.argmax(excess)), excess.shape)
    assert excess[worst] <= 0, (f"C{worst} = {out[worst]} vs reference {ref[worst]} (bound {bound[worst]:.3g}); "
                                f"{int((excess > 0).sum())} elements out of bound")
