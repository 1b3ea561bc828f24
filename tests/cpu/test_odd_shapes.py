"""Shapes that are not tile multiples (docs/formats.md, "Shapes that are not tile multiples"), NumPy backend.

The rule: the Marlin arrays of a (K, N) weight are exactly the Marlin arrays of that weight zero-padded to
K_pad = ceil(K/16)*16 rows and N_pad = ceil(N/64)*64 columns; scales have ceil(K/G) groups and N_pad columns (the
padded ones 0); inverses take the true sizes and return exactly the original tensor. Each test builds the padded
weight explicitly and runs the op at the aligned shape (the path every other test pins down), so "exactly that
rule" is what is compared, bit for bit.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from workbench import ops  # noqa: E402
from workbench.formats import fp8, packing, scales  # noqa: E402
from workbench.formats._checks import padded_k, padded_n  # noqa: E402
from workbench.quantize import dequantize, quantize_weights  # noqa: E402
from workbench.weight import make_marlin_weight  # noqa: E402

NP = dict(backend="numpy")


def pad(x: np.ndarray, rows: int, cols: int) -> np.ndarray:
    out = np.zeros((rows, cols), dtype=x.dtype)
    out[:x.shape[0], :x.shape[1]] = x
    return out


@st.composite
def odd_weight(draw, multiple_k: bool = True, multiple_n: bool = False):
    """(bits, K, N, seed): K a multiple of the pack factor (GPTQ rows) when ``multiple_k``, N when ``multiple_n``;
    up to three tiles each way, edges of every remainder."""
    bits = draw(st.sampled_from((4, 8)))
    pf = 32 // bits
    k = draw(st.integers(1, 48))
    n = draw(st.integers(1, 160))
    if multiple_k:
        k = -(-k // pf) * pf
    if multiple_n:
        n = -(-n // pf) * pf
    return bits, k, n, draw(st.integers(0, 2**31 - 1))


def codes_of(rng, k, n, bits):
    return rng.integers(0, 1 << bits, size=(k, n), dtype=np.uint8)


# ---------------------------------------------------------------------------------------------------------------
# weights
# ---------------------------------------------------------------------------------------------------------------
@given(odd_weight(), st.booleans())
def test_gptq_repack_is_the_padded_weights_repack_and_inverts(case, act_order):
    bits, k, n, seed = case
    rng = np.random.default_rng(seed)
    codes = codes_of(rng, k, n, bits)
    perm = rng.permutation(k).astype(np.int32) if act_order else None
    marlin = ops.gptq_marlin_repack(packing.pack_rows(codes, bits), perm, k, n, bits, **NP)
    # the padded weight: rows in Marlin order first (perm is over the K true rows), then zero rows and columns
    ordered = codes[perm] if act_order else codes
    expected = ops.gptq_marlin_repack(packing.pack_rows(pad(ordered, padded_k(k), padded_n(n)), bits), None,
                                      padded_k(k), padded_n(n), bits, **NP)
    assert marlin.shape == expected.shape == (padded_k(k) // 16, padded_n(n) * 16 // (32 // bits))
    np.testing.assert_array_equal(marlin, expected)
    back = ops.marlin_to_gptq_qweight(marlin, perm, k, n, bits, **NP)
    np.testing.assert_array_equal(back, packing.pack_rows(codes, bits))
    np.testing.assert_array_equal(ops.marlin_to_codes(marlin, k, n, bits, perm), codes)


@given(odd_weight(multiple_k=False, multiple_n=True))
def test_awq_repack_is_the_padded_weights_repack_and_inverts(case):
    bits, k, n, seed = case
    codes = codes_of(np.random.default_rng(seed), k, n, bits)
    q = packing.awq_pack(codes, bits)
    marlin = ops.awq_marlin_repack(q, k, n, bits, **NP)
    expected = ops.awq_marlin_repack(packing.awq_pack(pad(codes, padded_k(k), padded_n(n)), bits), padded_k(k),
                                     padded_n(n), bits, **NP)
    np.testing.assert_array_equal(marlin, expected)
    np.testing.assert_array_equal(ops.marlin_to_awq_qweight(marlin, k, n, bits, **NP), q)


@given(st.integers(1, 40), st.integers(1, 200), st.integers(0, 2**31 - 1))
def test_fp8_repacks_are_the_padded_weights_and_invert(k4, n, seed):
    k = 4 * k4
    rng = np.random.default_rng(seed)
    row_major = rng.integers(0, 256, size=(n, k), dtype=np.uint8)
    raw = fp8.pack_fp8_to_int32(row_major)
    marlin = ops.block_fp8_group128_repack(row_major, k, n, **NP)
    expected = ops.block_fp8_group128_repack(pad(row_major, padded_n(n), padded_k(k)), padded_k(k), padded_n(n), **NP)
    np.testing.assert_array_equal(marlin, expected)
    np.testing.assert_array_equal(ops.fp8_marlin_repack_raw_bits(raw, k, n, **NP), marlin)
    np.testing.assert_array_equal(ops.marlin_to_block_fp8(marlin, k, n, **NP), row_major)
    np.testing.assert_array_equal(ops.marlin_to_fp8_raw_bits(marlin, k, n, **NP), raw)


# ---------------------------------------------------------------------------------------------------------------
# scales and zero points
# ---------------------------------------------------------------------------------------------------------------
@given(st.integers(1, 400), st.integers(1, 200), st.sampled_from((-1, 32, 64, 128)),
       st.sampled_from((np.float16, ml_dtypes.bfloat16, np.float32)), st.integers(0, 2**31 - 1))
def test_scales_partial_groups_and_padded_columns(k, n, group, dtype, seed):
    ng = scales.num_groups(k, group)
    assert ng == (1 if group == -1 else -(-k // group))
    s = (np.random.default_rng(seed).standard_normal((ng, n)) + 2).astype(dtype)
    marlin = ops.marlin_permute_scales(s, k, n, group, **NP)
    # the permutation is chosen by the group count alone, so the aligned call with the same K keeps it
    expected = ops.marlin_permute_scales(pad(s, ng, padded_n(n)), k, padded_n(n), group, **NP)
    assert marlin.shape == (ng, padded_n(n)) and marlin.dtype == s.dtype
    np.testing.assert_array_equal(marlin.view(np.uint8), expected.view(np.uint8))
    assert (marlin == 0).sum() == ng * (padded_n(n) - n)  # only the padding is 0 (the scales are > 0)
    back = ops.marlin_unpermute_scales(marlin, k, n, group, **NP)
    np.testing.assert_array_equal(back.view(np.uint8), s.view(np.uint8))


@given(odd_weight(multiple_k=False, multiple_n=True), st.sampled_from((-1, 32, 128)))
def test_zero_points_padded_and_inverted(case, group):
    bits, k, n, seed = case
    ng = scales.num_groups(k, group)
    rng = np.random.default_rng(seed)
    zp = rng.integers(1, 1 << bits, size=(ng, n), dtype=np.uint8)  # >= 1: storable in GPTQ v1 too
    marlin = ops.marlin_zero_points(zp, k, n, bits, **NP)
    expected = ops.marlin_zero_points(pad(zp, ng, padded_n(n)), k, padded_n(n), bits, **NP)
    np.testing.assert_array_equal(marlin, expected)
    np.testing.assert_array_equal(ops.marlin_zero_points_to_codes(marlin, k, n, bits, **NP), zp)
    awq = packing.awq_pack(zp, bits)
    np.testing.assert_array_equal(ops.awq_to_marlin_zero_points(awq, k, n, bits, **NP), marlin)
    np.testing.assert_array_equal(ops.marlin_to_awq_zero_points(marlin, k, n, bits, **NP), awq)
    v1 = packing.pack_cols(zp - np.uint8(1), bits)
    np.testing.assert_array_equal(ops.repack_gptq_qzeros_to_marlin(v1, k, n, group, bits, **NP), marlin)
    np.testing.assert_array_equal(ops.marlin_to_gptq_qzeros(marlin, k, n, group, bits, **NP), v1)


@given(st.integers(1, 100), st.integers(1, 300), st.sampled_from((np.float16, ml_dtypes.bfloat16)),
       st.integers(0, 2**31 - 1))
def test_block_fp8_scales_partial_blocks(k4, n, act, seed):
    k = 4 * k4 * 3  # up to 1200: one to ten 128-blocks, the last one partial
    shape = fp8.block_scale_shape(k, n)
    assert shape == (-(-n // 128), -(-k // 128))
    inv = np.exp2(np.random.default_rng(seed).integers(-12, -4, size=shape)).astype(ml_dtypes.bfloat16)
    marlin = ops.block_fp8_group128_scales(inv, k, n, act, **NP)
    per_column = np.repeat(inv.astype(np.float32).T, 128, axis=1)[:, :n]  # [ceil(K/128), N]
    expected = scales.permute_scales(pad((per_column * fp8.exponent_bias(act)).astype(act), shape[1],
                                         padded_n(n)), k, padded_n(n), 128)
    np.testing.assert_array_equal(marlin.view(np.uint8), expected.view(np.uint8))
    np.testing.assert_array_equal(ops.marlin_to_block_fp8_scales(marlin, k, n, act), inv.astype(np.float32))
    # the scale gather formula names the source of every kept scale and -1 for the padding
    sources = fp8.block_fp8_scale_sources(np.arange(marlin.size), k, n).reshape(marlin.shape)
    flat = inv.astype(np.float32).ravel()
    folded = np.where(sources >= 0, flat[np.maximum(sources, 0)] * fp8.exponent_bias(act), 0).astype(act)
    np.testing.assert_array_equal(folded.view(np.uint8), marlin.view(np.uint8))


@given(st.integers(1, 10), st.integers(1, 100))
def test_block_fp8_word_sources_name_the_padding(k4, n):
    k = 4 * k4
    row_major = np.random.default_rng(k * 1000 + n).integers(1, 256, size=(n, k), dtype=np.uint8)
    marlin = ops.block_fp8_group128_repack(row_major, k, n, **NP).view(np.uint32)
    sources = fp8.block_fp8_word_sources(np.arange(marlin.size), k, n)
    flat = np.concatenate([row_major.ravel(), np.zeros(1, np.uint8)])  # index -1: the padding's zero byte
    rebuilt = sum(flat[sources[:, j]].astype(np.uint32) << np.uint32(8 * j) for j in range(4))
    np.testing.assert_array_equal(rebuilt, marlin.ravel())


# ---------------------------------------------------------------------------------------------------------------
# quantizer and MarlinWeight
# ---------------------------------------------------------------------------------------------------------------
@given(st.sampled_from(("u4b8", "u4", "u8b128", "fe4m3fn")), st.integers(1, 30), st.integers(1, 150),
       st.sampled_from((-1, 32, 64)), st.booleans())
def test_quantized_odd_weight_carries_true_sizes_and_padded_arrays(wtype, k8, n, group, act_order):
    k = 8 * k8
    act_order = act_order and group != -1 and wtype != "fe4m3fn"
    w = np.random.default_rng(k * 7 + n).standard_normal((k, n)).astype(np.float32)
    q = quantize_weights(w, wtype, group, act_order=act_order)
    m = make_marlin_weight(q)
    m.require_padded_arrays()
    assert (m.size_k, m.size_n, m.padded_k, m.padded_n) == (k, n, padded_k(k), padded_n(n))
    assert m.scales.shape == (scales.num_groups(k, group), padded_n(n))
    if m.zeros is not None:
        assert m.zeros.shape == (m.num_groups, padded_n(n) // (32 // q.weight_type.bits))
    # everything a kernel reads past the true sizes is zero bytes
    codes = ops.marlin_to_codes(m.qweight, padded_k(k), padded_n(n), q.weight_type.bits)
    assert not codes[k:].any() and not codes[:, n:].any()
    logical = ops.marlin_unpermute_scales(m.scales, k, padded_n(n), group, **NP)  # all N_pad columns, unpermuted
    assert not logical.view(np.uint8).reshape(m.num_groups, padded_n(n), -1)[:, n:].any()
    # and the true part dequantizes to the reference weight
    s = ops.marlin_unpermute_scales(m.scales, k, n, group, **NP)
    if q.weight_type.name == "FE4M3FN":
        s = s.astype(np.float32) / np.float32(fp8.exponent_bias(q.act_dtype))
    zeros = None if m.zeros is None else ops.marlin_zero_points_to_codes(m.zeros, k, n, q.weight_type.bits, **NP)
    back = ops.marlin_to_codes(m.qweight, k, n, q.weight_type.bits, m.perm)
    np.testing.assert_array_equal(dequantize(back, s, zeros, q.weight_type, group, q.g_idx, q.act_dtype), q.w_ref)


@pytest.mark.parametrize("k,n,group", [(16, 7392, 128), (10944, 64, 128)], ids=["Qwen2-72B TP4 N", "DSV2-Lite K"])
def test_motivating_shapes(k, n, group, rng):
    """N = 7392 (7392 % 64 = 32) and K = 10944 with groups of 128 (85.5 groups)."""
    codes = codes_of(rng, k, n, 4)
    q = packing.pack_rows(codes, 4)
    marlin = ops.gptq_marlin_repack(q, None, k, n, 4, **NP)
    assert marlin.shape == (padded_k(k) // 16, padded_n(n) * 2)
    np.testing.assert_array_equal(ops.marlin_to_gptq_qweight(marlin, None, k, n, 4, **NP), q)
    s = rng.standard_normal((scales.num_groups(k, group), n)).astype(np.float16)
    assert s.shape[0] == -(-k // group)
    np.testing.assert_array_equal(ops.marlin_unpermute_scales(ops.marlin_permute_scales(s, k, n, group, **NP), k, n,
                                                              group, **NP), s)


# ---------------------------------------------------------------------------------------------------------------
# what a format cannot represent
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("call,message", [
    (lambda: ops.gptq_marlin_repack(np.zeros((2, 10), np.int32), None, 12, 10, 4),
     r"size_k = 12 is not a multiple of the pack factor 8 \(GPTQ packs 8 rows"),
    (lambda: ops.marlin_to_gptq_qweight(np.zeros((1, 256), np.int32), None, 10, 64, 8),
     r"size_k = 10 is not a multiple of the pack factor 4"),
    (lambda: ops.awq_marlin_repack(np.zeros((5, 3), np.int32), 5, 20, 4), r"size_n = 20 is not a multiple of the "
     r"pack factor 8 \(AWQ"),
    (lambda: ops.marlin_zero_points(np.ones((1, 0), np.uint8), 16, 0, 4), r"size_n = 0 must be positive"),
    (lambda: ops.block_fp8_group128_repack(np.zeros((3, 10), np.uint8), 10, 3), r"size_k = 10 is not a multiple "
     r"of the pack factor 4 \(FP8 bytes"),
    (lambda: ops.block_fp8_group128_scales(np.ones((1, 1), np.float32), 200, 3),
     r"inverse_scales has shape \(1, 1\), expected \(1, 2\)"),
    (lambda: ops.marlin_permute_scales(np.ones((1, 70), np.float16), 16, 70, -1, **NP), None),
    (lambda: ops.marlin_permute_scales(np.ones((1, 70), np.float16), -16, 70, -1), r"size_k = -16 must be positive"),
])
def test_unrepresentable_shapes_are_refused(call, message):
    if message is None:  # a control: the same call with legal sizes succeeds
        assert call().shape == (1, 128)
        return
    with pytest.raises(ValueError, match=message):
        call()


def test_marlin_weight_refuses_arrays_that_are_not_padded():
    """A weight object carries the true sizes and the padded arrays: an unpadded qweight is named, not guessed."""
    from workbench.scalar_types import ScalarType
    from workbench.weight import MarlinWeight, workspace_size

    w = MarlinWeight(np.zeros((2, 200), np.int32), np.zeros((1, 128), np.float16), None, None, None, 24, 100, -1,
                     ScalarType.U4B8, np.dtype(np.float16))
    with pytest.raises(ValueError, match=r"qweight has shape \(2, 200\), expected \[E,\] \(2, 256\)"):
        w.require_padded_arrays()
    w = MarlinWeight(np.zeros((2, 256), np.int32), np.zeros((1, 100), np.float16), None, None, None, 24, 100, -1,
                     ScalarType.U4B8, np.dtype(np.float16))
    with pytest.raises(ValueError, match=r"scales has shape \(1, 100\), expected \[E,\] \(1, 128\)"):
        w.require_padded_arrays()
    assert workspace_size(7392) == 116 * 16  # one set of lock counters per 64-column stripe of N_pad = 7424
