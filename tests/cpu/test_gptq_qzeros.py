"""GPTQ v1 qzeros: ferrum-kernels' known values, the code-15 error, and the Marlin layout."""
import numpy as np
import pytest

from oracles import vllm_style_zero_points
from workbench import ops
from workbench.formats import gptq, packing


def u32(words):
    return np.array(words, dtype=np.uint32).view(np.int32)


def test_symmetric_detection_seed_values():
    assert ops.gptq_qzeros_are_symmetric_code7(u32([0x77777777]))
    assert not ops.gptq_qzeros_are_symmetric_code7(u32([0x77777778]))
    assert not ops.gptq_qzeros_are_symmetric_code7(u32([]))
    assert ops.gptq_qzeros_are_symmetric_code7(u32([0x7F7F7F7F]), num_bits=8)


def test_code8_becomes_zero_point_9():  # seed: qzeros_code8_repack_converts_to_actual_zero_point_9
    packed = ops.repack_gptq_qzeros_to_marlin(u32([0x88888888] * 8).reshape(1, 8), 128, 64, 128)
    assert np.array_equal(packed.view(np.uint32), np.full((1, 8), 0x99999999, np.uint32))


def test_v1_to_v2_preserves_layout():  # seed: qzeros_repack_preserves_kernel_layout (the +1 step)
    actual = np.array([1, 2, 3, 4, 5, 6, 7, 8, 8, 9, 10, 11, 12, 13, 14, 15], dtype=np.uint8)
    stored = np.concatenate([actual - 1, np.full(48, 7, np.uint8)]).reshape(1, 64)
    v2 = gptq.gptq_v1_qzeros_to_v2(packing.pack_cols(stored, 4)).view(np.uint32)
    assert v2[0, 0] == 0x87654321 and v2[0, 1] == 0xFEDCBA98 and v2[0, 2] == 0x88888888


def test_marlin_zero_points_are_permuted_plus_one(rng):
    zeros = rng.integers(1, 15, size=(2, 128), dtype=np.uint8)  # actual zero points 1..14
    qzeros = packing.pack_cols(zeros - 1, 4)
    got = ops.repack_gptq_qzeros_to_marlin(qzeros, 256, 128, 128)
    assert np.array_equal(got, vllm_style_zero_points(zeros, 4))
    assert np.array_equal(ops.marlin_to_gptq_qzeros(got, 256, 128, 128), qzeros)


def test_code15_names_group_packed_column_and_lane():
    stored = np.full((2, 64), 7, np.uint8)
    stored[1, 13] = 15  # group 1, packed column 1, lane 5
    with pytest.raises(ValueError, match="group=1 packed_col=1 lane=5 has code 15"):
        ops.repack_gptq_qzeros_to_marlin(packing.pack_cols(stored, 4), 256, 64, 128)


def test_8bit_code255_is_an_error():
    stored = np.full((1, 64), 127, np.uint8)
    stored[0, 6] = 255
    with pytest.raises(ValueError, match="group=0 packed_col=1 lane=2 has code 255"):
        ops.repack_gptq_qzeros_to_marlin(packing.pack_cols(stored, 8), 128, 64, -1, 8)


def test_sort_g_idx_groups_become_contiguous(rng):
    g_idx = rng.permutation(np.arange(256) // 32).astype(np.int32)
    g_sorted, perm = gptq.sort_g_idx(g_idx)
    assert np.array_equal(g_sorted, np.arange(256) // 32)
    assert np.array_equal(g_idx[perm], g_sorted)


def test_v2_qzeros_are_the_zero_points_v1_plus_one(rng):
    zeros = rng.integers(1, 15, size=(2, 64), dtype=np.uint8)
    v1 = packing.pack_cols(zeros - 1, 4)
    v2 = gptq.gptq_v1_qzeros_to_v2(v1)
    assert np.array_equal(packing.unpack_cols(v2, 4), zeros)
    assert np.array_equal(ops.marlin_zero_points(packing.unpack_cols(v2, 4), 256, 64, 4),
                          ops.repack_gptq_qzeros_to_marlin(v1, 256, 64, 128))
