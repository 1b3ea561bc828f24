"""Reference RTN quantizer and dequantizer."""
import ml_dtypes
import numpy as np
import pytest

from workbench.quantize import dequantize, quantize_weights
from workbench.scalar_types import WEIGHT_TYPES, ScalarType


def test_every_int4_code_dequantizes_exactly():
    codes = np.arange(16, dtype=np.uint8).reshape(16, 1).repeat(64, 1)
    scales = np.full((1, 64), 0.5, np.float16)
    assert np.array_equal(dequantize(codes, scales, None, "u4b8", -1)[:, 0], (np.arange(16) - 8) * 0.5)
    zeros = np.full((1, 64), 3, np.uint8)
    assert np.array_equal(dequantize(codes, scales, zeros, "u4", -1)[:, 0], (np.arange(16) - 3) * 0.5)


@pytest.mark.parametrize("wt", [t.label for t in WEIGHT_TYPES])
@pytest.mark.parametrize("group_size", [-1, 32, 128])
@pytest.mark.parametrize("act", [np.float16, ml_dtypes.bfloat16])
def test_quantizer_properties(wt, group_size, act, rng):
    w = rng.standard_normal((256, 128)).astype(np.float32) * 0.1
    q = quantize_weights(w, wt, group_size, act_dtype=act, seed=int(rng.integers(1 << 30)))
    t = ScalarType.parse(wt)
    ng = 1 if group_size == -1 else 256 // group_size
    assert q.codes.dtype == np.uint8 and q.codes.shape == (256, 128) and q.scales.shape == (ng, 128)
    assert (q.zeros is not None) == t.has_zero_points
    assert q.w_ref.dtype == np.float32
    assert np.array_equal(q.w_ref.astype(act).astype(np.float32), q.w_ref)  # representable in act dtype
    if t is not ScalarType.FE4M3FN:
        assert q.codes.max() < (1 << t.bits)
        # round-to-nearest: the error is at most half a step (plus the act-dtype rounding of the product)
        rows = np.arange(256) // (256 if group_size == -1 else group_size)
        step = q.scales.astype(np.float32)[rows]
        assert np.all(np.abs(q.w_ref - w) <= 0.5 * step + 2e-2 * np.abs(w) + 1e-6)
    else:
        assert np.all(np.abs(q.w_ref - w) <= 0.07 * np.abs(w) + 1e-3)  # 3 mantissa bits: ≤ 2^-4 relative


def test_act_order_groups_have_exactly_group_size_members(rng):
    q = quantize_weights(rng.standard_normal((512, 64)).astype(np.float32), "u4b8", 128, act_order=True)
    assert q.g_idx is not None and np.array_equal(np.bincount(q.g_idx), [128] * 4)
    assert not np.array_equal(q.g_idx, np.arange(512) // 128)


def test_bad_arguments():
    w = np.ones((256, 64), np.float32)
    with pytest.raises(ValueError, match="group_size = 48"):
        quantize_weights(w, "u4b8", 48)
    with pytest.raises(ValueError, match="unknown weight type 'int3'"):
        quantize_weights(w, "int3", 128)
    with pytest.raises(ValueError, match="act_order needs a group size"):
        quantize_weights(w, "u4b8", -1, act_order=True)
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        quantize_weights(w, "u4b8", 128, act_dtype=np.float32)
