"""Microscaling formats: every E2M1 and E8M0 code, the quantizers against loop oracles, the exact dequantizers."""
import math

import ml_dtypes
import numpy as np
import pytest

from workbench.formats import microscale as ms

CODES4 = np.arange(16, dtype=np.uint8)
BYTES = np.arange(256, dtype=np.uint8)


def e2m1_spec_value(code: int) -> float:
    """E2M1 from its definition: sign, 2 exponent bits (bias 1), 1 mantissa bit; exponent 0 is subnormal."""
    sign = -1.0 if code & 8 else 1.0
    e, m = (code >> 1) & 3, code & 1
    return sign * (m * 0.5 if e == 0 else 2.0 ** (e - 1) * (1 + m / 2))


def test_all_16_e2m1_codes_match_the_definition_and_ml_dtypes():
    assert [e2m1_spec_value(c) for c in range(16)] == ms.E2M1_VALUES.tolist()
    assert ms.E2M1_VALUES.tolist() == CODES4.view(ml_dtypes.float4_e2m1fn).astype(np.float32).tolist()
    assert np.array_equal(ms.float_to_e2m1(ms.e2m1_to_float32(CODES4)), CODES4)  # including -0 (code 8)
    assert ms.E2M1_VALUES.max() == ms.E2M1_MAX == 6.0


def _nearest_even_oracle(x: float) -> int:
    """The E2M1 code nearest to x (ties: even mantissa), by search over the 8 magnitudes; beyond 6: saturate."""
    mag = min(abs(x), 6.0)
    best = min(range(8), key=lambda c: (abs(e2m1_spec_value(c) - mag), c & 1))
    return best | (8 if math.copysign(1.0, x) < 0 else 0)


def test_float_to_e2m1_rounds_to_nearest_even_and_saturates_on_a_dense_grid():
    grid = np.concatenate([np.arange(-8, 8.001, 0.03125), [7.0, -7.0, 100.0, -1e30, 0.25, 0.75, 1.25, 2.5, 3.5, 5.0]])
    got = ms.float_to_e2m1(grid)
    want = np.array([_nearest_even_oracle(float(x)) for x in grid], np.uint8)
    assert np.array_equal(got, want)


def test_float_to_e2m1_refuses_nan():
    with pytest.raises(ValueError, match="NaN"):
        ms.float_to_e2m1(np.array([1.0, np.nan]))


def test_nibble_packing_of_every_byte():
    codes = ms.unpack_fp4(BYTES.reshape(16, 16))
    assert np.array_equal(codes[:, 0::2].ravel(), BYTES & 15)  # element 2j: the low nibble
    assert np.array_equal(codes[:, 1::2].ravel(), BYTES >> 4)
    assert np.array_equal(ms.pack_fp4(codes), BYTES.reshape(16, 16))


def test_e2m1_code_checks_name_the_value():
    with pytest.raises(ValueError, match=r"codes\[0, 1\] = 16 is not an E2M1 code \(0..15; 2 such\)"):
        ms.check_e2m1_codes(np.array([[1, 16, 17]], np.uint8))
    with pytest.raises(ValueError, match="K must be even"):
        ms.pack_fp4(np.zeros((2, 3), np.uint8))


def test_all_256_e8m0_codes():
    finite = BYTES[:255]
    assert np.array_equal(ms.e8m0_to_float(finite), 2.0 ** (finite.astype(np.float64) - 127))
    assert np.array_equal(ms.e8m0_to_float(finite), finite.view(ml_dtypes.float8_e8m0fnu).astype(np.float64))
    assert np.isnan(np.array([255], np.uint8).view(ml_dtypes.float8_e8m0fnu).astype(np.float32))[0]
    with pytest.raises(ValueError, match=r"scales\[1, 0\] = 0xFF is E8M0's NaN code.*\(2 such code"):
        ms.check_e8m0_codes(np.array([[3, 4], [255, 255]], np.uint8))


def test_e4m3_scale_nan_is_refused():
    with pytest.raises(ValueError, match=r"weight_scale\[0, 2\] = 0xff is E4M3's NaN \(2 such\)"):
        ms.check_e4m3_scales(np.array([[1, 2, 0xFF, 0x7F]], np.uint8))


def test_group_size_is_the_formats():
    assert ms.check_group_size(ms.NVFP4, 16) == 16
    for fmt, bad in ((ms.NVFP4, 32), (ms.MXFP4, 16), (ms.MXFP8, True)):
        with pytest.raises(ValueError, match=f"is not {fmt.name}'s {fmt.group_size}"):
            ms.check_group_size(fmt, bad)
    with pytest.raises(ValueError, match="size_k = 48 is not a positive multiple of mxfp4's group size 32"):
        ms.quantize_mx(np.ones((4, 48), np.float32), "mxfp4")


# ---------------------------------------------------------------------------------------------------------------
# quantizers against per-element loop oracles
# ---------------------------------------------------------------------------------------------------------------
def _weights(rng, n=8, k=64):
    w = rng.standard_normal((n, k)).astype(np.float32) * np.float32(rng.uniform(0.01, 3))
    w[0, :16] = 0.0  # an all-zero block
    w[1, 5] *= 40  # an outlier
    return w


def test_nvfp4_quantizer_against_a_loop_oracle(rng):
    w = _weights(rng)
    packed, scales, g = ms.quantize_nvfp4(w)
    assert packed.shape == (8, 32) and scales.shape == (8, 4) and g.dtype == np.float32
    assert g == np.float32(np.abs(w).max() / np.float32(6 * 448))
    codes = ms.unpack_fp4(packed)
    for n in range(8):
        for b in range(4):
            block = w[n, 16 * b:16 * b + 16]
            want_scale = ml_dtypes.float8_e4m3fn(np.float32(np.float32(np.abs(block).max() / np.float32(6)) / g))
            assert scales[n, b] == np.array(want_scale).view(np.uint8)
            step = np.float32(float(want_scale)) * g
            for j, x in enumerate(block):
                want = _nearest_even_oracle(float(np.float32(x / step))) if step > 0 else 0
                assert codes[n, 16 * b + j] == want, (n, b, j)


def test_nvfp4_dequantizer_is_exact(rng):
    w = _weights(rng)
    packed, scales, g = ms.quantize_nvfp4(w)
    got = ms.dequantize_nvfp4(packed, scales, g)
    codes = ms.unpack_fp4(packed)
    for n, k in [(0, 0), (1, 5), (7, 63), (3, 17)]:
        want = e2m1_spec_value(int(codes[n, k])) * float(scales[n:n + 1, k // 16].view(ml_dtypes.float8_e4m3fn)[0]) \
            * float(g)
        assert got[n, k] == want
    assert np.abs(got - w).max() <= np.abs(w).max() / 6 * 1.01  # at most half the widest E2M1 step (2 of 6)


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
def test_mx_quantizer_follows_the_ocp_shared_exponent(fmt, rng):
    f = ms.FORMATS[fmt]
    w = _weights(rng)
    w[2, 32:64] = 1e-39  # below 2^-127 · 2^emax: the exponent clamps at -127
    elements, codes = ms.quantize_mx(w, fmt)
    assert codes.shape == (8, 2) and codes.dtype == np.uint8
    values = ms.dequantize_mx(elements, codes, fmt)
    for n in range(8):
        for b in range(2):
            block = w[n, 32 * b:32 * b + 32].astype(np.float64)
            amax = np.abs(block).max()
            x = -127 if amax == 0 else max(-127, math.frexp(amax)[1] - 1 - f.element_emax)
            assert codes[n, b] == x + 127
            scaled = np.clip(block / 2.0 ** x, -f.element_max, f.element_max)
            if f.element == "e2m1":
                want = np.array([e2m1_spec_value(_nearest_even_oracle(float(v))) for v in scaled]) * 2.0 ** x
            else:
                want = scaled.astype(np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * 2.0 ** x
            assert np.array_equal(values[n, 32 * b:32 * b + 32], want), (n, b)


def test_mx_dequantizer_covers_the_whole_e8m0_range():
    codes = np.array([[0, 254]], np.uint8)
    elements = ms.pack_fp4(np.full((1, 64), 7, np.uint8))  # 6.0 everywhere
    got = ms.dequantize_mx(elements, codes, "mxfp4")
    assert got[0, 0] == 6 * 2.0 ** -127 and got[0, 63] == 6 * 2.0 ** 127  # float32 would overflow the second


def test_quantizers_refuse_nonfinite_and_bad_shapes():
    with pytest.raises(ValueError, match="NaN or Inf"):
        ms.quantize_nvfp4(np.full((2, 16), np.inf, np.float32))
    with pytest.raises(ValueError, match="must be 2-D"):
        ms.quantize_nvfp4(np.ones(16, np.float32))
    with pytest.raises(ValueError, match="not an MX format"):
        ms.quantize_mx(np.ones((2, 32)), "nvfp4")
    with pytest.raises(ValueError, match="'fp3' is not one of nvfp4, mxfp4, mxfp8"):
        ms.microscale_format("fp3")
