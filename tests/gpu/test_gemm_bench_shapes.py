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

from gpu.test_gemm import BF16, error_bound, poisoned  # noqa: E402  (tests/ is on the pytest pythonpath)

LAYERS = ((4096, 4096), (4096, 14336), (14336, 4096), (8192, 8192), (8192, 28672), (28672, 8192))
# (weight type, group size, layers, M values): every layer for the INT4 headline type, the largest layers and the
# square one for the others (each weight build costs seconds of host time).
CASES = ([(S.U4B8, 128, kn, m) for kn in LAYERS for m in (1, 8, 16, 64)]
         + [(S.FE4M3FN, -1, kn, m) for kn in ((8192, 8192), (8192, 28672), (28672, 8192)) for m in (1, 16)]
         + [(S.U8B128, 128, kn, m) for kn in ((8192, 8192), (8192, 28672)) for m in (1, 16)]
         + [(S.U4, 128, (8192, 28672), m) for m in (1, 16)]
         # the 8-bit two-block pairs at M = 9..16 (GemmPolicy.pair_two_block_eight_bit_rows)
         + [(wt, gs, (4096, 14336), m) for wt, gs in ((S.FE4M3FN, -1), (S.U8B128, 128)) for m in (9, 16)])
CASES = [case + (np.float16,) for case in CASES]
# the 512 x 64 pairs of 4-bit weights (GemmPolicy.four_bit_pair_shapes) with zero points and with bf16; bf16 on
# the slice-aligned grid of swapped two-block kernels (GemmPolicy.aligned_swap_two_blocks)
CASES += [(wt, 128, (14336, 4096), m, act) for wt, act in ((S.U4, np.float16), (S.U4B8, BF16)) for m in (1, 16)]
CASES += [(S.U4B8, 128, (8192, 28672), 8, BF16)]
# long one-block pairs for zero points and bf16 (GemmPolicy.pair_long_acts / pair_long_zero_points: 56 steps a
# block on 28672 x 8192), bf16 in the swapped two-block pairs (GemmPolicy.two_block_pair_acts: 4096 x 14336 at M <= 8)
CASES += [(S.U4, 128, (28672, 8192), m, np.float16) for m in (1, 16)]
CASES += [(S.U4B8, 128, (28672, 8192), m, BF16) for m in (1, 16)]
CASES += [(S.U4B8, 128, (4096, 14336), m, BF16) for m in (1, 8)]
# the 512 x 128 tile at M = 9..16 (GemmPolicy.rows_wide_first): alone on the aligned grid (4096 x 14336), in pairs
# (8192^2), striped (8192 x 28672); M below 16, zero points and bf16
CASES += [(S.U4B8, 128, (8192, 8192), 9, np.float16), (S.U4, 128, (4096, 14336), 12, np.float16),
          (S.U4B8, 128, (4096, 14336), 16, BF16), (S.U4B8, 128, (8192, 28672), 13, BF16)]


@functools.lru_cache(maxsize=2)
def layer(wt, gs, k, n, act=np.float16):
    """(device MarlinWeight, reference W (K, N) float32) with fresh random codes, scales and zero points, for
    activations of dtype ``act``."""
    rng = np.random.default_rng()
    ng = 1 if gs == -1 else k // gs
    if wt is S.FE4M3FN:
        codes = rng.integers(0, 256, size=(k, n), dtype=np.uint8)
        codes[(codes & 0x7F) == 0x7F] ^= 1  # no NaN codes (S.1111.111)
        scales = (rng.random((ng, n), dtype=np.float32) * 0.02 + 0.001).astype(np.float32)
    else:
        codes = rng.integers(0, 1 << wt.bits, size=(k, n), dtype=np.uint8)
        scales = (rng.random((ng, n), dtype=np.float32) * 0.02 + 0.001).astype(act)
    zeros = rng.integers(0, 1 << wt.bits, size=(ng, n), dtype=np.uint8) if wt.has_zero_points else None
    w_ref = dequantize(codes, scales, zeros, wt, gs, act_dtype=act)
    q = QuantizedWeight(codes, scales, zeros, None, gs, wt, np.dtype(act), w_ref)
    return gemm.upload_weight(make_marlin_weight(q)), w_ref


@pytest.mark.parametrize("wt,gs,kn,m,act", CASES, ids=lambda v: getattr(v, "__name__", str(v)))
def test_bench_shape_matches_reference(wt, gs, kn, m, act):
    k, n = kn
    w, w_ref = layer(wt, gs, k, n, act)
    rng = np.random.default_rng()
    a = rng.standard_normal((m, k), dtype=np.float32).astype(act)
    c = poisoned(m, n, act)
    out = cp.asnumpy(gemm.marlin_gemm(cp.asarray(a), w, c=c)).astype(np.float32)
    assert np.all(np.isfinite(out)), f"{int((~np.isfinite(out)).sum())} elements not written (or not finite)"
    ref = a.astype(np.float32) @ w_ref
    bound = error_bound(a, w_ref, act, "fp32", k)  # the default reduction: fp32 partials
    excess = np.abs(out - ref) - bound
    worst = np.unravel_index(int(np.argmax(excess)), excess.shape)
    assert excess[worst] <= 0, (f"C{worst} = {out[worst]} vs reference {ref[worst]} (bound {bound[worst]:.3g}); "
                                f"{int((excess > 0).sum())} elements out of bound")


def test_two_full_grids_on_two_streams_finish_and_match_their_serial_results():
    """Two launches whose grids each fill the GPU (two blocks per SM on 8192 x 28672 at M = 16, one per SM on 8192^2
    at M = 1), repeated on two streams at once. In the default fp32 reduction a slice's first contributor waits for
    the other blocks of its own launch to count in, so every block must become resident while the other launch holds
    SMs (the dispatch order the gemm module doc relies on). A hang fails here after a deadline instead of blocking;
    each stream's output must equal its own serial launch bit for bit (the fp32 sum runs in block order)."""
    import time

    jobs = [(S.U4B8, 128, 8192, 28672, 16), (S.U4B8, 128, 8192, 8192, 1)]
    rng = np.random.default_rng()
    device = cp.cuda.Device().id
    sms = gemm.device_properties(device)[1]
    runs = []
    for wt, gs, k, n, m in jobs:
        w, _ = layer(wt, gs, k, n)
        a = cp.asarray(rng.standard_normal((m, k), dtype=np.float32).astype(np.float16))
        serial = cp.asnumpy(gemm.marlin_gemm(a, w, c=poisoned(m, n, np.float16)))
        stream = cp.cuda.Stream(non_blocking=True)
        ws = cp.zeros(gemm.workspace_numel(sms), dtype=np.int32)
        runs.append(dict(w=w, a=a, serial=serial, stream=stream, ws=ws, c=poisoned(m, n, np.float16),
                         c_tmp=cp.empty(gemm.c_tmp_numel(sms), dtype=np.float32)))
    cp.cuda.Device().synchronize()
    for _ in range(25):
        for r in runs:
            gemm.marlin_gemm(r["a"], r["w"], c=r["c"], workspace=r["ws"], c_tmp=r["c_tmp"], stream=r["stream"])
    deadline = time.monotonic() + 60.0
    while not all(r["stream"].done for r in runs):
        if time.monotonic() > deadline:
            pytest.fail("two concurrent full-grid GEMMs did not finish within 60 s: blocks waiting on blocks of "
                        "their own launch that never became resident")
        time.sleep(0.005)
    for (wt, gs, k, n, m), r in zip(jobs, runs):
        np.testing.assert_array_equal(cp.asnumpy(r["c"]), r["serial"], err_msg=f"{wt} {k}x{n} M={m}")
        assert int(cp.count_nonzero(r["ws"])) == 0, "lock counters must be left zero"


@pytest.mark.parametrize("wt,gs,kn,m", [(S.U4B8, 128, (14336, 4096), 1), (S.FE4M3FN, -1, (4096, 14336), 1),
                                        (S.U4B8, 128, (4096, 14336), 1), (S.FE4M3FN, -1, (4096, 14336), 16)],
                         ids=lambda v: str(v))
def test_programmatic_plans_keep_their_planned_blocks_per_sm(wt, gs, kn, m):
    """GemmPolicy.programmatic_pin_occupancy: a programmatic launch's shared memory lets no more blocks share an SM than
    its plan counts on (unpinned, the first two cells lost 15-33% when the next grid's blocks stacked two to an SM
    on the SMs the grid before left idle; the last two plan two blocks per SM)."""
    device = cp.cuda.Device().id
    if not gemm.programmatic_launches(device):
        pytest.skip("programmatic launches off or not sm_90")
    k, n = kn
    w, _ = layer(wt, gs, k, n)
    a = cp.asarray(np.random.default_rng().standard_normal((m, k), dtype=np.float32).astype(np.float16))
    gemm.marlin_gemm(a, w)
    plans = [p for p in gemm.launch._prepared.values() if (p.m, p.n, p.k, p.cfg.weight) == (m, n, k, wt)]
    assert plans and all(p.programmatic for p in plans)
    for p in plans:
        kernel = gemm.get_kernel(p.cfg.name_expression, device, p.smem)
        assert p.launch_smem >= p.smem
        assert gemm.kernels._resident_blocks(kernel, p.launch_smem) <= p.cfg.blocks_per_sm, (p.cfg, p.launch_smem)
