"""Marlin layouts of NVFP4 / MXFP4 / MXFP8: weights against vLLM's route and the tile maps, every S0E5M3 byte,
the shuffle, the global scale, the whole scale routes and their inverses, and the ops' input checks."""
import warnings

import ml_dtypes
import numpy as np
import pytest

from workbench import ops
from workbench.formats import fp4_marlin as fm
from workbench.formats import microscale as ms
from workbench.formats import packing
from workbench.formats.marlin_tile import TILE_K
from workbench.formats.scales import permute_scales

BF16 = np.dtype(ml_dtypes.bfloat16)
E4M3_ALL = np.arange(256, dtype=np.uint8)
E4M3_NONNEG = E4M3_ALL[(E4M3_ALL < 0x80) & (E4M3_ALL != 0x7F)]  # the 127 finite non-negative codes
SHAPES = [(64, 64), (128, 192), (256, 128)]


def _packed(rng, n, k):
    return rng.integers(0, 256, size=(n, k // 2), dtype=np.uint8)


# ---------------------------------------------------------------------------------------------------------------
# weights
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("size_k,size_n", SHAPES)
def test_fp4_repack_equals_vllms_gptq_route_and_inverts(size_k, size_n, rng):
    packed = _packed(rng, size_n, size_k)
    got = ops.fp4_marlin_repack(packed, size_k, size_n)
    # vLLM: weight.view(int32).T -> gptq_marlin_repack(num_bits=4); the view, built here from the nibbles
    gptq = packing.pack_rows(np.ascontiguousarray(ms.unpack_fp4(packed).T), 4)
    assert np.array_equal(fm.gptq_view_of_fp4(packed), gptq)
    assert np.array_equal(got, ops.gptq_marlin_repack(gptq, None, size_k, size_n, 4))
    assert got.dtype == np.int32 and got.shape == (size_k // TILE_K, 2 * size_n)
    assert np.array_equal(ops.marlin_to_fp4(got, size_k, size_n), packed)


def test_fp4_word_sources_closed_form_for_every_word(rng):
    size_k, size_n = 64, 128
    codes = rng.integers(0, 16, size=(size_n, size_k), dtype=np.uint8)
    marlin = ops.fp4_marlin_repack(ms.pack_fp4(codes), size_k, size_n).view(np.uint32).ravel()
    words = np.arange(marlin.size)
    src = fm.fp4_word_sources(words, size_k, size_n)
    assert np.array_equal(np.sort(src.ravel()), np.arange(size_k * size_n))  # every element exactly once
    fields = codes.ravel()[src].astype(np.uint32)
    assert np.array_equal((fields << (4 * np.arange(8, dtype=np.uint32))).sum(axis=1, dtype=np.uint32), marlin)
    # the docstring's closed form: fields (j, j + 4) are the two nibbles of one checkpoint byte
    tile, wit = np.divmod(words, 128)
    k_tile, n_tile = np.divmod(tile, size_n // 64)
    lane, warp = np.divmod(wit, 4)
    r, n0 = 16 * k_tile + 2 * (lane % 4), 64 * n_tile + 16 * warp + lane // 4
    first = np.stack([n0 * size_k + r, n0 * size_k + r + 8, (n0 + 8) * size_k + r, (n0 + 8) * size_k + r + 8], -1)
    assert np.array_equal(src[:, :4], first) and np.array_equal(src[:, 4:], first + 1)


def test_mxfp8_repack_is_the_block_fp8_byte_route(rng):
    w = rng.integers(0, 256, size=(128, 256), dtype=np.uint8)
    got = ops.mxfp8_marlin_repack(w.view(ml_dtypes.float8_e4m3fn), 256, 128)
    assert np.array_equal(got, ops.fp8_marlin_repack_raw_bits(packing.pack_rows(np.ascontiguousarray(w.T), 8), 256,
                                                              128))
    assert np.array_equal(ops.marlin_to_mxfp8(got, 256, 128), w)


# ---------------------------------------------------------------------------------------------------------------
# the shuffle and the S0E5M3 byte
# ---------------------------------------------------------------------------------------------------------------
def test_shuffle_is_vllms_view_and_an_involution(rng):
    s = rng.integers(0, 255, size=(3, 64), dtype=np.uint8)
    assert np.array_equal(fm.shuffle_scales(s), s.reshape(-1, 4)[:, [0, 2, 1, 3]].reshape(3, 64))
    assert np.array_equal(fm.shuffle_scales(fm.shuffle_scales(s)), s)


def _vllm_s0e5m3(half_scales: np.ndarray) -> np.ndarray:
    """vLLM's steps on already-shuffled fp16 scales: (s * 2^7) in fp16, viewed int16, << 1, high byte."""
    bits = (half_scales * np.float16(2 ** 7)).view(np.int16) << np.int16(1)
    return bits.view(np.uint8)[..., 1::2]


def test_every_nonnegative_e4m3_scale_gets_its_s0e5m3_byte():
    values = E4M3_NONNEG.view(ml_dtypes.float8_e4m3fn).astype(np.float16)
    s = np.tile(values, 2)[:192].reshape(3, 64)  # three rows of 64 (N a multiple of 64)
    raw, sf = fm.nvfp4_marlin_process_scales(s, a_dtype=np.float16)
    assert sf == 1.0 and raw.dtype == np.uint8
    assert np.array_equal(raw, _vllm_s0e5m3(fm.shuffle_scales(s)))
    back = fm.shuffle_scales(raw)
    codes = np.tile(E4M3_NONNEG, 2)[:192].reshape(3, 64)
    normal = codes >= 8
    assert np.array_equal(back[normal], codes[normal] + 120)  # a normal E4M3 byte: exponent re-biased by 15
    subnormal_bytes = {1: 13 << 3, 2: 14 << 3, 3: (14 << 3) | 4, 4: 15 << 3, 5: (15 << 3) | 2, 6: (15 << 3) | 4,
                       7: (15 << 3) | 6, 0: 0}  # m/8 · 2^-6 · 2^7 = m/4 as fp16's exponent and 3 mantissa bits
    for i, j in zip(*np.nonzero(~normal)):
        assert back[i, j] == subnormal_bytes[int(codes[i, j])]
    assert np.array_equal(fm.s0e5m3_to_float(raw), fm.shuffle_scales(s).astype(np.float64))
    assert np.array_equal(fm.nvfp4_marlin_unprocess_scales(raw), np.tile(E4M3_NONNEG, 2)[:192].reshape(3, 64))


def test_bf16_scale_factor_sets_the_top_bit_of_every_nonzero_byte(rng):
    codes = rng.integers(1, 0x30, size=(4, 64), dtype=np.uint8)  # small scales, some below 2 / 2^7
    s = codes.view(ml_dtypes.float8_e4m3fn).astype(BF16)
    raw, sf = ops.nvfp4_marlin_process_scales(s, a_dtype=BF16)
    v = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    assert sf == 2.0 ** np.ceil(np.log2(2 / (v.min() * 2 ** 7)))  # vLLM's formula
    assert (raw >= 0x80).all() and sf > 1
    assert np.array_equal(raw, _vllm_s0e5m3((fm.shuffle_scales(v) * sf).astype(np.float16)))
    assert np.array_equal(fm.nvfp4_marlin_unprocess_scales(raw, sf), codes)
    _, sf16 = ops.nvfp4_marlin_process_scales(s.astype(np.float16), a_dtype=np.float16)
    assert sf16 == 1.0  # vLLM never rescales for fp16
    raw2, sf2 = ops.nvfp4_marlin_process_scales(s, scale_factor=2 * sf, a_dtype=BF16)  # shared over experts
    assert sf2 == 2 * sf and np.array_equal(fm.nvfp4_marlin_unprocess_scales(raw2, sf2), codes)


def test_negative_scales_warn_and_are_stored_as_their_magnitude(rng):
    codes = rng.integers(0x08, 0x70, size=(2, 64), dtype=np.uint8)
    s = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float16)
    neg = s.copy()
    neg[1, 3] = -neg[1, 3]
    with pytest.warns(RuntimeWarning, match=r"marlin_scales\[1, 3\] = .* is negative \(1 such\).*magnitude"):
        got, _ = ops.nvfp4_marlin_process_scales(neg, a_dtype=np.float16)
    want, _ = ops.nvfp4_marlin_process_scales(s, a_dtype=np.float16)
    assert np.array_equal(got, want)
    assert np.array_equal(got, _vllm_s0e5m3(fm.shuffle_scales(neg)))  # what vLLM does with it, bit for bit


def test_scale_processing_refusals():
    ok = np.full((1, 64), 1.0, np.float16)
    with pytest.raises(ValueError, match=r"marlin_scales\[0, 1\] = 1.0625 is not an E4M3 value \(1 such\)"):
        fm.nvfp4_marlin_process_scales(np.where(np.arange(64) == 1, 1.0625, 1.0).astype(np.float32)[None])
    with pytest.raises(ValueError, match="scale_factor = 3 is not a power of two >= 1"):
        ops.nvfp4_marlin_process_scales(ok, scale_factor=3, a_dtype=np.float16)
    big = np.full((1, 64), 448.0, np.float16)
    with pytest.raises(ValueError, match=r"marlin_scales\[0, 0\] = 448.0: · scale_factor 4 · 2\^7 = 229376 exceeds"
                       r" fp16's 65504 \(64 such\)"):
        ops.nvfp4_marlin_process_scales(big, scale_factor=4, a_dtype=BF16)
    with pytest.raises(TypeError, match="nvfp4 runs with float16 or bfloat16 activations in Marlin, not float32"):
        ops.nvfp4_marlin_process_scales(ok, a_dtype=np.float32)
    with pytest.raises(ValueError, match=r"expected \[num_groups > 0, N_pad\] with N_pad a multiple of 64"):
        ops.nvfp4_marlin_process_scales(np.ones((1, 32), np.float16))


# ---------------------------------------------------------------------------------------------------------------
# global scale
# ---------------------------------------------------------------------------------------------------------------
def test_global_scale_exponents_follow_vllms_formula():
    for dt, e_bits, want in ((np.float16, 5, 7), (BF16, 8, 119)):
        assert fm.GLOBAL_SCALE_EXPONENT[np.dtype(dt)] == 2 ** (e_bits - 1) - 2 ** (2 - 1) - 7 == want
        g = np.float32(0.0123)
        out = ops.nvfp4_marlin_process_global_scale(np.array([g]), dt)
        assert out.dtype == np.float32 and out[0] == g * np.float32(2.0 ** want)
        assert ops.nvfp4_marlin_global_scale(g, dt, 8.0) == np.float32(g * np.float32(2.0 ** want) / 8)
    assert ops.nvfp4_marlin_process_global_scale(np.float16(1.0)) == 128  # a_dtype from the input, as vLLM
    with pytest.raises(ValueError, match="must be finite and positive"):
        ops.nvfp4_marlin_process_global_scale(np.float32(-1), np.float16)
    with pytest.raises(ValueError, match="has 2 values"):
        ops.nvfp4_marlin_global_scale(np.ones(2, np.float32), np.float16)


def test_kernel_view_reproduces_the_nvfp4_values_exactly_in_fp16(rng):
    """Dequantizing as the fp16 kernel does — E2M1 bits moved into a half (value · 2^-14), times the S0E5M3 byte read
    as a half (s · 2^7), times the processed global scale — gives the exact NVFP4 values."""
    size_k, size_n = 64, 64
    w = rng.standard_normal((size_n, size_k)).astype(np.float32)
    packed, scales, g = ms.quantize_nvfp4(w)
    marlin_q = ops.fp4_marlin_repack(packed, size_k, size_n)
    raw, sf = ops.nvfp4_marlin_scales(scales, size_k, size_n, np.float16)
    gs = ops.nvfp4_marlin_global_scale(g, np.float16, sf)
    codes = ops.marlin_to_codes(marlin_q, size_k, size_n, 4).astype(np.uint16)  # (K, N), Marlin rows = K rows
    moved = (((codes & 8) << 12) | ((codes & 7) << 9)).view(np.float16).astype(np.float64)
    assert np.array_equal(moved * 2.0 ** 14, ms.e2m1_to_float32(codes.astype(np.uint8)))
    unshuffled = fm.shuffle_scales(raw)
    from workbench.formats.scales import unpermute_scales
    scale_half = unpermute_scales((unshuffled.astype(np.uint16) << 7).view(np.float16), size_k, size_n, 16)
    got = moved * np.repeat(scale_half.astype(np.float64), 16, axis=0) * np.float64(gs)
    assert np.array_equal(got.T, ms.dequantize_nvfp4(packed, scales, g))


# ---------------------------------------------------------------------------------------------------------------
# whole routes and their inverses
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("size_k,size_n", SHAPES)
@pytest.mark.parametrize("act", [np.float16, BF16])
def test_nvfp4_scale_route_is_vllms_steps_and_inverts(size_k, size_n, act, rng):
    # bf16: vLLM's rescale multiplies every scale; a range wider than fp16 can then hold is refused (next test)
    low = 1 if act == np.float16 else 0x20
    codes = rng.choice(E4M3_NONNEG[low:], size=(size_n, size_k // 16)).astype(np.uint8)
    raw, sf = ops.nvfp4_marlin_scales(codes, size_k, size_n, act)
    half = codes.view(ml_dtypes.float8_e4m3fn).astype(act)  # vLLM: .to(param_dtype), then .T and permute
    steps = fm.nvfp4_marlin_process_scales(permute_scales(np.ascontiguousarray(half.T), size_k, size_n, 16),
                                           a_dtype=act)
    assert sf == steps[1] and np.array_equal(raw, steps[0]) and raw.shape == (size_k // 16, size_n)
    assert np.array_equal(ops.marlin_to_nvfp4_scales(raw, size_k, size_n, sf), codes)


def test_bf16_rescale_that_would_overflow_fp16_is_refused_where_vllm_would_store_inf():
    codes = np.full((64, 4), 0x7E, np.uint8)  # 448, the largest scale a normalised checkpoint has
    codes[9, 1] = 0x01  # 2^-9: rescale 2 / (2^-9 · 2^7) = 8
    with pytest.raises(ValueError, match=r"scale_factor 8 · 2\^7 = 458752 exceeds fp16's 65504"):
        ops.nvfp4_marlin_scales(codes, 64, 64, BF16)
    v = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    with np.errstate(over="ignore"):
        assert (_vllm_s0e5m3((v * 8).astype(np.float16)) == 0xF8).sum() > 0  # fp16 inf, shifted: not a scale
    raw, sf = ops.nvfp4_marlin_scales(codes, 64, 64, np.float16)  # fp16 never rescales
    assert sf == 1.0 and np.array_equal(ops.marlin_to_nvfp4_scales(raw, 64, 64), codes)


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
def test_mx_scale_route_equals_vllms_bf16_round_trip_for_every_code(fmt, rng):
    size_k, size_n = 256, 128
    codes = rng.integers(0, 255, size=(size_n, size_k // 32), dtype=np.uint8)
    codes.ravel()[:255] = np.arange(255)  # every non-NaN code at least once
    got = ops.mx_marlin_scales(codes, size_k, size_n, fmt)
    # vLLM: .view(e8m0).to(bf16), .T, marlin_permute_scales, shuffle, .to(e8m0)
    values = codes.view(ml_dtypes.float8_e8m0fnu).astype(BF16)
    permuted = ops.marlin_permute_scales(np.ascontiguousarray(values.T), size_k, size_n, 32)
    vllm = fm.shuffle_scales(permuted).astype(ml_dtypes.float8_e8m0fnu).view(np.uint8)
    assert np.array_equal(got, vllm)
    assert np.array_equal(ops.mxfp4_marlin_process_scales(permuted), vllm)  # bf16 values in, codes out
    assert np.array_equal(ops.mxfp8_marlin_process_scales(permuted.view(np.uint16).view(BF16)), vllm)
    assert np.array_equal(ops.marlin_to_mx_scales(got, size_k, size_n, fmt), codes)


def test_mx_scale_refusals():
    codes = np.full((64, 4), 127, np.uint8)
    codes[5, 2] = 0xFF
    with pytest.raises(ValueError, match=r"weight_scale\[5, 2\] = 0xFF is E8M0's NaN code"):
        ops.mx_marlin_scales(codes, 128, 64)
    not_pow2 = np.full((2, 64), 1.0, np.float32)
    not_pow2[1, 7] = 3.0
    with pytest.raises(ValueError, match=r"marlin_scales\[1, 7\] = 3.0 is not an E8M0 value"):
        ops.mxfp4_marlin_process_scales(not_pow2)
    with pytest.raises(ValueError, match="group_size = 16 is not mxfp4's 32"):
        ops.mx_marlin_scales(np.full((64, 4), 127, np.uint8), 128, 64, group_size=16)
    with pytest.raises(ValueError, match="group_size = 32 is not nvfp4's 16"):
        ops.nvfp4_marlin_scales(np.ones((64, 8), np.uint8), 128, 64, group_size=32)
    with pytest.raises(ValueError, match=r"weight_scale has shape \(64, 3\), expected \(64, 4\)"):
        ops.mx_marlin_scales(np.ones((64, 3), np.uint8), 128, 64)
    with pytest.raises(ValueError, match="size_k = 80 is not a multiple of 32 \\(mxfp8 has one scale per 32 elements"):
        ops.mx_marlin_scales(np.ones((64, 2), np.uint8), 80, 64, "mxfp8")
    with pytest.raises(ValueError, match="size_k = 48 is not a multiple of 32 \\(mxfp4 has one scale per 32 elements"):
        ops.mx_marlin_scales(np.ones((96, 1), np.uint8), 48, 96)
    with pytest.raises(ValueError, match="size_k = 40 is not a multiple of 16 \\(nvfp4 has one scale per 16 elements"):
        ops.nvfp4_marlin_scales(np.ones((96, 2), np.uint8), 40, 96)
    with pytest.raises(TypeError, match="only 16-bit activations"):
        ops.mxfp4_marlin_process_scales(np.ones((1, 64), np.uint8), input_dtype=ml_dtypes.float8_e4m3fn)


def test_weight_op_refusals(rng):
    with pytest.raises(ValueError, match=r"weight_packed has shape \(64, 64\), expected \(64, 32\)"):
        ops.fp4_marlin_repack(np.zeros((64, 64), np.uint8), 64, 64)
    with pytest.raises(TypeError, match="weight_packed must have dtype uint8, got int32"):
        ops.fp4_marlin_repack(np.zeros((64, 32), np.int32), 64, 64)
    with pytest.raises(ValueError, match="size_k = 40 is not a multiple of 16 \\(microscaled weights: NVFP4 has one"):
        ops.fp4_marlin_repack(np.zeros((96, 20), np.uint8), 40, 96)
    with pytest.raises(ValueError, match="size_k = 40 is not a multiple of 16 \\(microscaled weights"):
        ops.mxfp8_marlin_repack(np.zeros((96, 40), np.uint8), 40, 96)
    with pytest.raises(ValueError, match=r"marlin_q has shape \(3, 192\), expected \(3, 256\) \(\[K/16, 2 N_pad\]"):
        ops.marlin_to_fp4(np.zeros((3, 192), np.int32), 48, 96)  # N = 96 is N_pad = 128 wide
    with pytest.raises(ValueError, match="size_n = 0 must be positive"):
        ops.fp4_marlin_repack(np.zeros((0, 32), np.uint8), 64, 0)
    with pytest.raises(TypeError, match="must be an int"):
        ops.fp4_marlin_repack(np.zeros((64, 32), np.uint8), 64.0, 64)
    with pytest.raises(TypeError, match="convert it with np.asarray"):
        ops.fp4_marlin_repack([[0] * 32] * 64, 64, 64)


def test_ops_do_not_mutate_inputs(rng):
    packed = _packed(rng, 64, 64)
    keep = packed.copy()
    ops.fp4_marlin_repack(packed, 64, 64)
    s = rng.choice(E4M3_NONNEG[0x20:], size=(64, 4)).astype(np.uint8)
    keep_s = s.copy()
    ops.nvfp4_marlin_scales(s, 64, 64, BF16)
    assert np.array_equal(packed, keep) and np.array_equal(s, keep_s)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ops.nvfp4_marlin_scales(s, 64, 64, np.float16)  # nothing to warn about
