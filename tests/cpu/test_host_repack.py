"""The ops' ``backend="cpu"`` (workbench.host_repack) against the NumPy reference, bit for bit.

Every op of the host loops, on the shapes the checkpoint pipeline meets: both widths, act-order, AWQ, the transposed
sources (compressed-tensors, block-FP8) read through views, and shapes that are not tile multiples (docs/formats.md,
"Shapes that are not tile multiples"): hypothesis draws K and N up to several tiles and column blocks, derandomized
(tests/conftest.py). Structured data first (every code names its source), then random words.
"""
from __future__ import annotations

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from workbench import host_repack, ops  # noqa: E402
from workbench.formats import fp8, packing  # noqa: E402
from workbench.formats.scales import num_groups  # noqa: E402

REF = dict(backend="numpy")
CPU = dict(backend="cpu")


def words(rng, shape) -> np.ndarray:
    return rng.integers(-2**31, 2**31, size=shape, dtype=np.int32)


def same_bits(a: np.ndarray, b: np.ndarray) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(a.view(f"u{a.dtype.itemsize}"), b.view(f"u{b.dtype.itemsize}"))


@st.composite
def weight_case(draw):
    """(bits, K, N, seed): K a multiple of the pack factor (GPTQ rows); N past one 256-column block and its edge."""
    bits = draw(st.sampled_from((4, 8)))
    pf = 32 // bits
    k = -(-draw(st.integers(1, 72)) // pf) * pf
    n = draw(st.one_of(st.integers(1, 200), st.integers(250, 330)))
    return bits, k, n, draw(st.integers(0, 2**31 - 1))


# ---------------------------------------------------------------------------------------------------------------
# structured: one whole tile, every code its own position
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [4, 8])
def test_a_tile_of_position_coded_words_repacks_as_the_reference(bits):
    pf = 32 // bits
    codes = (np.arange(16 * 64).reshape(16, 64) % (1 << bits)).astype(np.uint8)  # (K, N) codes in every field
    q = packing.pack_rows(codes, bits)
    same_bits(ops.gptq_marlin_repack(q, None, 16, 64, bits, **CPU), ops.gptq_marlin_repack(q, None, 16, 64, bits,
                                                                                           **REF))
    # every field once: a word whose fields are 1..pf at one position, zero elsewhere, lands where the maps say
    for row in range(16 // pf):
        for col in range(64):
            one = np.zeros((16 // pf, 64), np.uint32)
            one[row, col] = sum((f + 1) << (bits * f) for f in range(pf)) & ((1 << 32) - 1)
            one = one.view(np.int32)
            same_bits(host_repack.gptq_marlin_repack(one, None, 16, 64, bits),
                      ops.gptq_marlin_repack(one, None, 16, 64, bits, **REF))


# ---------------------------------------------------------------------------------------------------------------
# weights: every source layout, odd shapes
# ---------------------------------------------------------------------------------------------------------------
@given(weight_case(), st.booleans())
def test_gptq_repack_matches_the_reference(case, act_order):
    bits, k, n, seed = case
    rng = np.random.default_rng(seed)
    q = words(rng, (k * bits // 32, n))
    perm = rng.permutation(k).astype(np.int32) if act_order else None
    want = ops.gptq_marlin_repack(q, perm, k, n, bits, **REF)
    same_bits(ops.gptq_marlin_repack(q, perm, k, n, bits, **CPU), want)
    # compressed-tensors: the same words stored [N, K/pf], read through the transposed view
    same_bits(host_repack.gptq_marlin_repack(np.ascontiguousarray(q.T).T, perm, k, n, bits), want)


@given(weight_case())
def test_awq_repack_and_zero_points_match_the_reference(case):
    bits, k, n, seed = case
    pf = 32 // bits
    k, n = k + seed % 5, -(-n // pf) * pf  # AWQ: any K, N a multiple of the pack factor
    rng = np.random.default_rng(seed)
    q = words(rng, (k, n // pf))
    same_bits(ops.awq_marlin_repack(q, k, n, bits, **CPU), ops.awq_marlin_repack(q, k, n, bits, **REF))
    qz = words(rng, (num_groups(k, 32), n // pf))
    same_bits(ops.awq_to_marlin_zero_points(qz, k, n, bits, **CPU),
              ops.awq_to_marlin_zero_points(qz, k, n, bits, **REF))


@given(weight_case(), st.sampled_from([-1, 32, 128]))
def test_zero_points_match_the_reference(case, group):
    bits, k, n, seed = case
    zp = np.random.default_rng(seed).integers(0, 1 << bits, size=(num_groups(k, group), n), dtype=np.uint8)
    same_bits(ops.marlin_zero_points(zp, k, n, bits, **CPU), ops.marlin_zero_points(zp, k, n, bits, **REF))


@given(st.integers(1, 80).map(lambda v: 4 * v), st.one_of(st.integers(1, 200), st.integers(250, 330)),
       st.integers(0, 2**31 - 1))
def test_block_fp8_repack_matches_the_reference(k, n, seed):
    rng = np.random.default_rng(seed)
    row_major = rng.integers(0, 256, size=(n, k), dtype=np.uint8)
    want = ops.block_fp8_group128_repack(row_major, k, n, **REF)
    same_bits(ops.block_fp8_group128_repack(row_major.view(fp8.E4M3), k, n, **CPU), want)
    raw = fp8.pack_fp8_to_int32(row_major)  # the same bytes as K-major words [K/4, N]
    same_bits(ops.fp8_marlin_repack_raw_bits(raw, k, n, **CPU), want)
    # rows at an offset that is not a multiple of 4 bytes (a tensor inside a file) are read the same
    shifted = np.empty(row_major.size + 1, np.uint8)[1:].reshape(n, k)
    shifted[...] = row_major
    same_bits(host_repack.block_fp8_group128_repack(shifted, k, n), want)


# ---------------------------------------------------------------------------------------------------------------
# scales
# ---------------------------------------------------------------------------------------------------------------
@given(weight_case(), st.sampled_from([-1, 64, 128, 1000]),
       st.sampled_from([np.float16, fp8.BF16, np.float32]))
def test_permuted_scales_match_the_reference(case, group, dtype):
    _, k, n, seed = case
    s = (np.random.default_rng(seed).standard_normal((num_groups(k, group), n)) * 1e-2).astype(dtype)
    s[0, 0] = np.nan  # moved as bits: a NaN keeps its payload
    with pytest.warns(RuntimeWarning):
        ref = ops.marlin_permute_scales(s, k, n, group, **REF)
    with pytest.warns(RuntimeWarning):
        same_bits(ops.marlin_permute_scales(s, k, n, group, **CPU), ref)


@given(st.integers(1, 80).map(lambda v: 4 * v), st.one_of(st.integers(1, 200), st.integers(250, 330)),
       st.sampled_from([fp8.BF16, np.float32]), st.sampled_from([np.float16, fp8.BF16]), st.integers(0, 2**31 - 1))
def test_block_fp8_scales_match_the_reference(k, n, inv_dtype, act_dtype, seed):
    rng = np.random.default_rng(seed)
    inv = (rng.random(fp8.block_scale_shape(k, n), dtype=np.float32) * 2.0 ** rng.integers(-30, 30)).astype(inv_dtype)
    same_bits(ops.block_fp8_group128_scales(inv, k, n, act_dtype, **CPU),
              ops.block_fp8_group128_scales(inv, k, n, act_dtype, **REF))


# ---------------------------------------------------------------------------------------------------------------
# out=: a column block of a wider tensor, the pipeline's case
# ---------------------------------------------------------------------------------------------------------------
def test_writes_into_a_column_block_of_a_wider_tensor(rng):
    k, n, bits = 272, 200, 4  # K and N not tile multiples
    q = words(rng, (k // 8, n))
    wide = np.full((k // 16, 3 * 512), -1, np.int32)  # three 256-column Marlin blocks of 4-bit words
    block = wide[:, 512:1024]
    host_repack.gptq_marlin_repack(q, None, k, n, bits, out=block)
    same_bits(block, ops.gptq_marlin_repack(q, None, k, n, bits, **REF))
    assert (wide[:, :512] == -1).all() and (wide[:, 1024:] == -1).all()  # nothing outside the block touched
    with pytest.raises(ValueError, match="out"):
        host_repack.gptq_marlin_repack(q, None, k, n, bits, out=wide)


def test_cpu_backend_runs_the_reference_for_ops_without_a_host_loop(rng):
    q = words(rng, (16, 64))
    marlin = ops.gptq_marlin_repack(q, None, 128, 64, 4, **CPU)
    same_bits(ops.marlin_to_gptq_qweight(marlin, None, 128, 64, 4, **CPU), q)  # (no host loop: the reference)
    assert "gptq_marlin_repack" in host_repack.OPS and "marlin_to_gptq_qweight" not in host_repack.OPS
