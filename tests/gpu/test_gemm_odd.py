"""The native GEMM on shapes that are not tile multiples and with a bias, on a real GPU (docs/formats.md, "Shapes that
are not tile multiples"): N not a multiple of 64 (Qwen2-72B's 29568 at TP4: 7392), K a multiple of the pack factor
but not of 16 or of the pipeline step, a partial last group (DeepSeek-V2-Lite's 10944 with group 128), block-FP8
partial blocks; every weight type, channelwise and grouped scales, act-order (full K and a K shard), every reduction.

The weights are fresh random codes, scales and zero points; their Marlin arrays are built as the storage rule says,
with the reference repack functions on the weight zero-padded to whole 16 x 64 tiles (scales and zero points to
ceil(K / group) rows and the padded width), and the reference is the exact dequantization of the unpadded weight.
Poison: C starts as NaN (an unwritten element fails), and A is a view of rows whose columns past K are NaN (a kernel
that reads A beyond K fails: NaN x 0 is NaN).

Tolerance (reason): |C - (a @ w_ref + bias)| <= c (|a| @ |w_ref|) + r u |bias|, c = error_bound_factor (the output's
rounding, the weight rounding a late-scaling kernel leaves out, fp32 tensor-core accumulation) with the in-C and
atomic reductions' extra rounding per block (tests/gpu/test_gemm.py error_bound), r = the output roundings the bias
goes through.
"""
import dataclasses

import ml_dtypes
import numpy as np
import pytest

from workbench import gemm, hardware
from workbench.formats.fp8 import marlin_fp8_scales
from workbench.formats.gptq import sort_g_idx
from workbench.formats.marlin_tile import marlin_repack_codes
from workbench.formats.scales import permute_scales, zero_points_to_marlin
from workbench.quantize import act_order_g_idx, dequantize
from workbench.scalar_types import ScalarType as S
from workbench.weight import MarlinWeight

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not hardware.cupy_available(), reason="no CUDA GPU visible to CuPy")]

cp = pytest.importorskip("cupy")
BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
MODES = {"fp32": dict(use_fp32_reduce=True), "in_c": dict(use_fp32_reduce=False),
         "atomic": dict(use_atomic_add=True, use_fp32_reduce=False)}


def odd_weight(k, n, wt, group, act=F16, seed=0, act_order=False, is_k_full=True, pow2_scales=False):
    """(MarlinWeight on the host, w_ref (k, n) float32) of random codes / scales / zero points, its arrays those of
    the weight zero-padded to whole tiles (the storage rule), built with the reference repack functions.
    ``pow2_scales``: integer-weight scales that are powers of two (every dequantized weight exact)."""
    rng = np.random.default_rng(seed)
    bits = wt.bits
    k_pad, n_pad = gemm.padded_shape(k, n)
    groups = 1 if group == -1 else -(-k // group)
    if wt is S.FE4M3FN:
        codes = rng.integers(0, 256, (k, n)).astype(np.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0x3C  # (no NaN codes: a checkpoint holds finite weights)
        scales = (rng.random((groups, n)) * 0.02 + 0.002).astype(np.float32)
    else:
        codes = rng.integers(0, 1 << bits, (k, n)).astype(np.uint8)
        scales = (rng.random((groups, n)) * 0.02 + 0.002).astype(act)
        if pow2_scales:
            scales = (2.0 ** -rng.integers(6, 10, (groups, n))).astype(act)
    zeros = rng.integers(0, 1 << bits, (groups, n)).astype(np.uint8) if wt.has_zero_points else None
    g_idx = act_order_g_idx(k, group, rng) if act_order else None
    w_ref = dequantize(codes, scales, zeros, wt, group, g_idx, act)
    g_sorted = perm = None
    if act_order:
        g_sorted, perm = sort_g_idx(g_idx)
        codes = codes[perm]
    padded = np.zeros((k_pad, n_pad), np.uint8)
    padded[:k, :n] = codes
    qweight = marlin_repack_codes(padded, bits)
    # scales / zero points: ceil(K / group) rows, columns padded with zeros; the permutations see a K of whole
    # groups (they move columns within a row only)
    k_groups = k_pad if group == -1 else groups * group
    s_pad = np.zeros((groups, n_pad), scales.dtype)
    s_pad[:, :n] = scales
    if wt is S.FE4M3FN:
        m_scales = marlin_fp8_scales(s_pad, k_groups, n_pad, group, act)
    else:
        m_scales = permute_scales(s_pad, k_groups, n_pad, group)
    m_zeros = None
    if zeros is not None:
        z_pad = np.zeros((groups, n_pad), np.uint8)
        z_pad[:, :n] = zeros
        m_zeros = zero_points_to_marlin(z_pad, k_groups, n_pad, bits)
    w = MarlinWeight(qweight, m_scales, m_zeros, g_sorted, perm, k, n, group, wt, act, is_k_full)
    return w, w_ref


def nan_padded_rows(a):
    """a (m, k) as a view of rows padded with NaN to a multiple of 8 plus 8 (the kernel must not read them)."""
    m, k = a.shape
    buf = np.full((m, -(-k // 8) * 8 + 8), np.nan, a.dtype)
    buf[:, :k] = a
    return cp.asarray(buf)[:, :k]


def check(a, w_dev, w_ref, act, mode="fp32", bias=None, **kw):
    m, k = a.shape
    n = w_dev.size_n
    c = cp.full((m, n), np.nan, dtype=act)
    out = gemm.marlin_gemm(nan_padded_rows(a) if m > 1 else cp.asarray(a), w_dev, c=c,
                           bias=None if bias is None else cp.asarray(bias), **MODES[mode], **kw)
    assert out is c and out.shape == (m, n)
    got = cp.asnumpy(out).astype(np.float32)
    ref = a.astype(np.float32) @ w_ref
    b = np.zeros(n, np.float32) if bias is None else bias.astype(np.float32)
    ref = ref + b
    roundings = 1 + (k // 64 if mode in ("in_c", "atomic") else 0)
    s = np.abs(a.astype(np.float32)) @ np.abs(w_ref)
    u = gemm.UNIT_ROUNDOFF[np.dtype(act).name]
    bound = gemm.error_bound_factor(act, k, output_roundings=roundings) * s + roundings * u * np.abs(b) + 1e-30
    assert np.all(np.isfinite(got)), f"{np.count_nonzero(~np.isfinite(got))} elements unwritten or NaN"
    err = np.abs(got - ref)
    assert np.all(err <= bound), f"max err {err.max()} (bound there {bound.flat[np.argmax(err - bound)]})"
    return got


SHAPES = (  # (K, N): the cells and the edge cases around them
    (1024, 7392),  # N = 115.5 64-column tiles (Qwen2-72B TP4)
    (10944, 320),  # K = 684 k16 tiles, group 128: 85.5 groups (DeepSeek-V2-Lite)
    (200, 97),  # K = 12.5 k16 tiles, an odd N inside one tile
    (40, 64),  # K below one 64-row step
)


def types_and_groups():
    for wt in (S.U4B8, S.U4, S.U8B128, S.FE4M3FN):
        for group in ((-1, 128) if wt is S.FE4M3FN else (-1, 64, 128)):
            yield wt, group


def grid_cases():
    """(K, N, type, group, act, row counts): every shape with every type and group, the activation type and the row
    counts rotating (one and 50 rows: the swapped loop and four m16 blocks; 16 and 33: one block, two or three)."""
    cases = []
    for k, n in SHAPES:
        for wt, group in types_and_groups():
            odd = len(cases) % 2
            cases.append((k, n, wt, group, BF16 if odd else F16, (1, 50) if odd else (16, 33)))
    return cases


BIAS_CASES = ((10944, 7392, S.U4B8, 128), (512, 256, S.U4, 64), (200, 97, S.U8B128, -1))
BIAS_ROWS = ((1, -1), (16, 8), (33, 20))  # (M, sms): fewer SMs split slices over blocks
ACT_ORDER_CASES = ((True, (10944, 200)), (False, (10944, 7392)), (False, (200, 97)))


@pytest.fixture(scope="module", autouse=True)
def compile_once():
    """Every instantiation the module's plans pick, compiled up front in parallel threads (NVRTC outside the GIL)."""
    device = cp.cuda.Device().id
    cc, sms, smem, sm_smem = gemm.device_properties(device)
    todo = []

    def add(act, wt, m, n, k, group, per_row=False, n_sms=sms):
        todo.append(gemm.choose_config(gemm.act_scalar_type(act), wt, m, n, k, group, per_row, smem, sm_smem=sm_smem,
                                       sms=n_sms, pairs=gemm.pairs_possible(cc, True)))

    for k, n, wt, group, act, ms in grid_cases():
        for m in ms:
            add(act, wt, m, n, k, group)
    for wt in (S.U8B128, S.FE4M3FN):
        for m in (1, 3, 16, 40):
            add(F16, wt, m, 7392, 4100, 128)
    for act in (F16, BF16):
        for k, n, wt, group in BIAS_CASES:
            for m, n_sms in BIAS_ROWS:
                add(act, wt, m, n, k, group, n_sms=sms if n_sms < 0 else n_sms)
    for m in (1, 16, 64):
        add(F16, S.U8B128, m, 97, 200, -1)
        add(F16, S.U4B8, m, 7392, 10944, 128)
    for wt in (S.U4B8, S.U8B128):
        for is_k_full, (k, n) in ACT_ORDER_CASES:
            for m in (1, 16, 40):
                add(F16, wt, m, n, k, 128, per_row=not is_k_full)
    gemm.precompile(todo, device, workers=16)


@pytest.mark.parametrize("k,n,wt,group,act,ms", grid_cases(), ids=str)
def test_odd_shapes_every_type_and_group(k, n, wt, group, act, ms, rng):
    w, w_ref = odd_weight(k, n, wt, group, act, seed=int(rng.integers(1 << 20)))
    w_dev = gemm.upload_weight(w)
    for m in ms:
        a = rng.standard_normal((m, k), dtype=np.float32).astype(act)
        check(a, w_dev, w_ref, act)


@pytest.mark.parametrize("wt", (S.U8B128, S.FE4M3FN), ids=str)
def test_eight_bit_k_ending_inside_an_a_chunk(wt, rng):
    """8-bit weights pack 4 codes a word: K = 4100 ends 4 columns into A's last 16-byte chunk (A passed as a view of
    wider rows; its columns past K are NaN and must not be read); block FP8's partial last block, both edges."""
    k, n = 4100, 7392
    w, w_ref = odd_weight(k, n, wt, 128, F16, seed=int(rng.integers(1 << 20)))
    w_dev = gemm.upload_weight(w)
    for m in (1, 3, 16, 40):
        check(rng.standard_normal((m, k), dtype=np.float32).astype(F16), w_dev, w_ref, F16)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("act", (F16, BF16), ids=str)
def test_bias_in_the_epilogue_every_reduction(mode, act, rng):
    """bias= in every reduction, on odd and aligned shapes; sms pinned low so that slices are split over blocks."""
    for k, n, wt, group in BIAS_CASES:
        w, w_ref = odd_weight(k, n, wt, group, act, seed=int(rng.integers(1 << 20)))
        w_dev = gemm.upload_weight(w)
        bias = (rng.standard_normal(n) * 4).astype(act)
        for m, sms in BIAS_ROWS:
            a = rng.standard_normal((m, k), dtype=np.float32).astype(act)
            check(a, w_dev, w_ref, act, mode, bias=bias, sms=sms)


@pytest.mark.parametrize("m", (1, 16, 64))
def test_bias_is_added_before_the_one_rounding(m, rng):
    """Rows of 0 / 1 over weights with power-of-two scales make every sum exact in fp32 (integers times 2^-9, below
    2^24) but not in fp16 (up to 16 bits): the output must be rnd(sum + bias), one rounding, bit for bit; adding
    the bias after C's rounding (a second pass) gives rnd(rnd(sum) + bias), which differs on some elements."""
    k, n = 200, 97
    w, w_ref = odd_weight(k, n, S.U8B128, -1, F16, seed=int(rng.integers(1 << 20)), pow2_scales=True)
    w_dev = gemm.upload_weight(w)
    a = (rng.random((m, k)) < 0.2).astype(F16)
    bias = (rng.standard_normal(n) * 3).astype(F16)
    got = cp.asnumpy(gemm.marlin_gemm(cp.asarray(a), w_dev, bias=cp.asarray(bias)))
    exact = (a.astype(np.float64) @ w_ref.astype(np.float64)) + bias.astype(np.float64)
    assert np.array_equal(got.view(np.uint16), exact.astype(F16).view(np.uint16)), "bias not added before rounding"


@pytest.mark.parametrize("wt", (S.U4B8, S.U8B128), ids=str)
def test_odd_shapes_act_order(wt, rng):
    """Act-order on the partial-group K = 10944 (full K: groups in Marlin row order) and on a K shard (per-row
    groups through g_idx), odd N."""
    for is_k_full, (k, n) in ACT_ORDER_CASES:
        w, w_ref = odd_weight(k, n, wt, 128, F16, seed=int(rng.integers(1 << 20)), act_order=True,
                              is_k_full=is_k_full)
        w_dev = gemm.upload_weight(w)
        for m in (1, 16, 40):
            check(rng.standard_normal((m, k), dtype=np.float32).astype(F16), w_dev, w_ref, F16)


def test_odd_shape_matches_its_padded_problem_bitwise(rng):
    """The odd problem and the padded one it is stored as (A's extra columns zero, C's extra columns dropped) give
    the same bits where the planner picks the same kernel for both: the edge handling changes no sum."""
    k, n = 10944, 7392
    w, _ = odd_weight(k, n, S.U4B8, 128, F16, seed=int(rng.integers(1 << 20)))
    w_dev = gemm.upload_weight(w)
    k_pad, n_pad = gemm.padded_shape(k, n)
    padded = dataclasses.replace(w_dev, size_k=k_pad, size_n=n_pad)
    for m in (1, 16, 64):
        a = rng.standard_normal((m, k), dtype=np.float32).astype(F16)
        a_pad = np.zeros((m, k_pad), F16)
        a_pad[:, :k] = a
        odd = cp.asnumpy(gemm.marlin_gemm(cp.asarray(a), w_dev, deterministic=True))
        full = cp.asnumpy(gemm.marlin_gemm(cp.asarray(a_pad), padded, deterministic=True))
        assert np.array_equal(odd.view(np.uint16), full[:, :n].view(np.uint16)), m
