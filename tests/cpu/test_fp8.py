"""FP8 E4M3: all 256 codes, the exponent-bias factor, ferrum-kernels' direct repack and scale oracles, gate/up fusion."""
import ml_dtypes
import numpy as np
import pytest

from oracles import seed_nested_fp8_tiles, seed_scale_source_index
from workbench import ops
from workbench.formats import fp8

ALL = np.arange(256, dtype=np.uint8)
FINITE = ALL[(ALL & 0x7F) != 0x7F]


def test_decode_encode_round_trip_all_finite_codes():
    assert FINITE.size == 254
    assert np.array_equal(fp8.float_to_e4m3(fp8.e4m3_to_float32(FINITE)), FINITE)
    assert np.isnan(fp8.e4m3_to_float32(np.array([0x7F, 0xFF], np.uint8))).all()
    assert fp8.e4m3_to_float32(np.array([0x7E], np.uint8))[0] == 448.0


def test_fp16_bit_move_times_256_is_the_true_value_for_all_finite_codes():
    moved = fp8.kernel_bit_move_f16(FINITE).astype(np.float32)
    assert np.array_equal(moved * 256.0, fp8.e4m3_to_float32(FINITE))


def test_bf16_bit_move_times_2_pow_120_is_the_true_value():
    b = FINITE.astype(np.uint16)
    moved = (((b & 0x80) << 8) | ((b & 0x7F) << 4)).astype(np.uint16).view(ml_dtypes.bfloat16).astype(np.float64)
    assert np.array_equal(moved * 2.0**120, fp8.e4m3_to_float32(FINITE).astype(np.float64))


def test_exponent_bias_formula():
    for dt, e_bits in ((np.float16, 5), (ml_dtypes.bfloat16, 8)):
        assert fp8.exponent_bias(dt) == 2.0 ** (2 ** (e_bits - 1) - 2 ** (4 - 1))


@pytest.mark.parametrize("size_k,size_n", [(256, 256), (128, 64), (384, 192)])
def test_block_repack_matches_seed_nested_oracle(size_k, size_n, rng):
    source = rng.integers(0, 256, size=size_n * size_k, dtype=np.uint8)
    got = ops.block_fp8_group128_repack(source.reshape(size_n, size_k), size_k, size_n)
    assert np.array_equal(got.view(np.uint8).ravel(), seed_nested_fp8_tiles(source, size_k, size_n))
    direct = source[fp8.block_fp8_word_sources(np.arange(size_n * size_k // 4), size_k, size_n)]
    assert np.array_equal(direct.ravel(), got.view(np.uint8).ravel())
    assert np.array_equal(ops.marlin_to_block_fp8(got, size_k, size_n), source.reshape(size_n, size_k))


def test_raw_bit_repack_equals_block_repack(rng):
    w = rng.integers(0, 256, size=(192, 256), dtype=np.uint8)  # [N, K]
    raw = fp8.pack_fp8_to_int32(w)
    assert raw.shape == (64, 192)
    a = ops.fp8_marlin_repack_raw_bits(raw, 256, 192)
    assert np.array_equal(a, ops.block_fp8_group128_repack(w, 256, 192))
    assert np.array_equal(ops.marlin_to_fp8_raw_bits(a, 256, 192), raw)


def test_gate_up_fused_by_concatenation_before_tiling(rng):  # seed: fuses_gate_up_before_tiling
    k, n = 128, 128
    gate = rng.integers(0, 256, size=(n, k), dtype=np.uint8)
    up = rng.integers(0, 256, size=(n, k), dtype=np.uint8)
    fused = np.concatenate([gate, up])
    packed = ops.block_fp8_group128_repack(fused, k, 2 * n)
    word, field = np.divmod(np.flatnonzero(fp8.block_fp8_word_sources(np.arange(2 * n * k // 4), k, 2 * n).ravel()
                                           == n * k)[0], 4)
    assert packed.view(np.uint8).ravel()[4 * word + field] == up[0, 0]
    assert np.array_equal(ops.marlin_to_block_fp8(packed, k, 2 * n)[n:], up)


@pytest.mark.parametrize("size_n,size_k", [(128, 128), (256, 256), (192, 384)])
def test_block_scales_match_seed_oracle(size_n, size_k):
    groups = size_k // 128
    rows = -(-size_n // 128)
    inv = (((np.arange(rows * groups) + 1) / 8.0).astype(ml_dtypes.bfloat16)).reshape(rows, groups)
    got = ops.block_fp8_group128_scales(inv, size_k, size_n)
    assert got.dtype == np.float16 and got.shape == (groups, size_n)
    flat = inv.ravel().astype(np.float32)
    expect = np.array([flat[seed_scale_source_index(d, size_k, size_n)] * 256.0 for d in range(groups * size_n)],
                      dtype=np.float32).astype(np.float16)
    assert np.array_equal(got.ravel(), expect)
    assert np.array_equal(flat[fp8.block_fp8_scale_sources(np.arange(groups * size_n), size_k, size_n)],
                          expect.astype(np.float32) / 256)


def test_block_scales_accept_float32_and_bf16_activations(rng):
    inv = rng.uniform(1e-4, 1e-2, size=(2, 2)).astype(np.float32)
    f16 = ops.block_fp8_group128_scales(inv, 256, 256)
    bf16 = ops.block_fp8_group128_scales(inv, 256, 256, ml_dtypes.bfloat16)
    assert bf16.dtype == ml_dtypes.bfloat16
    back = ops.marlin_to_block_fp8_scales(bf16, 256, 256, ml_dtypes.bfloat16)
    assert np.array_equal(back, inv.astype(ml_dtypes.bfloat16).astype(np.float32))
    back16 = ops.marlin_to_block_fp8_scales(f16, 256, 256)
    assert np.array_equal(back16, (inv * 256).astype(np.float16).astype(np.float32) / 256)
