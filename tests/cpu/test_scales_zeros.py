"""Scale permutations and zero points."""
import ml_dtypes
import numpy as np
import pytest

from oracles import vllm_style_zero_points
from workbench import ops
from workbench.formats import packing, scales


def test_p64_is_an_8x8_transpose():
    assert np.array_equal(scales.SCALE_PERM_64.reshape(8, 8), np.arange(64).reshape(8, 8).T)


def test_p32_is_a_4x4_transpose_of_column_pairs():
    pairs = scales.SCALE_PERM_32.reshape(16, 2)
    assert np.array_equal(pairs[:, 1] - pairs[:, 0], np.ones(16))  # pairs stay together
    assert np.array_equal((pairs[:, 0] // 2).reshape(4, 4), np.arange(16).reshape(4, 4).T)


def test_p64_puts_a_lanes_columns_together():
    # a lane reads 8 consecutive scales at 8*(lane//4): after P64 they are columns lane//4 + 8j
    for lane in range(32):
        start = 8 * (lane // 4)
        assert np.array_equal(scales.SCALE_PERM_64[start:start + 8], lane // 4 + 8 * np.arange(8))


@pytest.mark.parametrize("size_k,group_size,grouped", [(256, 128, True), (256, 32, True), (128, 128, False),
                                                       (256, -1, False)])
def test_choice_of_permutation_and_round_trip(size_k, group_size, grouped, rng):
    size_n = 192
    ng = 1 if group_size == -1 else size_k // group_size
    s = rng.standard_normal((ng, size_n)).astype(np.float16)
    out = ops.marlin_permute_scales(s, size_k, size_n, group_size)
    perm = scales.SCALE_PERM_64 if grouped else scales.SCALE_PERM_32
    assert np.array_equal(out, s.reshape(-1, perm.size)[:, perm].reshape(s.shape))
    assert out.dtype == s.dtype
    assert np.array_equal(ops.marlin_unpermute_scales(out, size_k, size_n, group_size), s)


@pytest.mark.parametrize("bits", [4, 8])
def test_zero_points_match_spec_construction(bits, rng):
    zp = rng.integers(0, 1 << bits, size=(4, 256), dtype=np.uint8)
    got = ops.marlin_zero_points(zp, 512, 256, bits)
    assert np.array_equal(got, vllm_style_zero_points(zp, bits))
    assert np.array_equal(ops.marlin_zero_points_to_codes(got, 512, 256, bits), zp)


@pytest.mark.parametrize("bits", [4, 8])
def test_awq_zero_points(bits, rng):
    zp = rng.integers(0, 1 << bits, size=(3, 128), dtype=np.uint8)
    got = ops.awq_to_marlin_zero_points(packing.awq_pack(zp, bits), 384, 128, bits)
    assert np.array_equal(got, vllm_style_zero_points(zp, bits))
    assert np.array_equal(ops.marlin_to_awq_zero_points(got, 384, 128, bits), packing.awq_pack(zp, bits))


def test_bf16_scales_keep_dtype(rng):
    s = rng.standard_normal((2, 64)).astype(ml_dtypes.bfloat16)
    assert ops.marlin_permute_scales(s, 256, 64, 128).dtype == s.dtype
