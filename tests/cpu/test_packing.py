"""Bit fields: exhaustive over every code, known words, and round trips."""
import numpy as np
import pytest

from workbench.formats import packing


@pytest.mark.parametrize("bits", [4, 8])
def test_every_code_round_trips_through_rows_cols_and_awq(bits):
    pf = 32 // bits
    codes = np.arange(1 << bits, dtype=np.uint8)
    rows = np.tile(codes, pf).reshape(-1, 1 << bits)  # every code in every field position
    rows = np.ascontiguousarray(np.vstack([rows, rows[::-1]]))[: (rows.shape[0] * 2 // pf) * pf]
    assert np.array_equal(packing.unpack_rows(packing.pack_rows(rows, bits), bits), rows)
    cols = np.ascontiguousarray(rows.T[:, : (rows.shape[0] // pf) * pf])
    assert np.array_equal(packing.unpack_cols(packing.pack_cols(cols, bits), bits), cols)
    assert np.array_equal(packing.awq_unpack(packing.awq_pack(cols, bits), bits), cols)


def test_known_words():
    column = np.arange(8, dtype=np.uint8).reshape(8, 1)  # k = 0..7 of one column
    assert packing.pack_rows(column, 4).view(np.uint32)[0, 0] == 0x76543210  # lowest bits = lowest k
    row = np.arange(8, dtype=np.uint8).reshape(1, 8)  # n = 0..7 of one row
    assert packing.pack_cols(row, 4).view(np.uint32)[0, 0] == 0x76543210
    # AWQ: field j holds column order[j] = [0, 2, 4, 6, 1, 3, 5, 7][j]
    assert packing.awq_pack(row, 4).view(np.uint32)[0, 0] == 0x75316420
    assert packing.awq_pack(np.arange(4, dtype=np.uint8).reshape(1, 4), 8).view(np.uint32)[0, 0] == 0x03010200


def test_awq_undo_is_inverse_of_order():
    for bits in (4, 8):
        assert np.array_equal(packing.AWQ_ORDER[bits][packing.AWQ_UNDO[bits]], np.arange(32 // bits))


@pytest.mark.parametrize("bits", [4, 8])
def test_random_round_trip(bits, rng):
    codes = rng.integers(0, 1 << bits, size=(64, 128), dtype=np.uint8)
    assert np.array_equal(packing.unpack_rows(packing.pack_rows(codes, bits), bits), codes)
    assert np.array_equal(packing.awq_unpack(packing.awq_pack(codes, bits), bits), codes)


def test_bad_inputs():
    with pytest.raises(ValueError, match="K = 12 is not divisible by the pack factor 8"):
        packing.pack_rows(np.zeros((12, 8), np.uint8), 4)
    with pytest.raises(ValueError, match=r"outside the 4-bit code range \[0, 15\]"):
        packing.pack_rows(np.full((8, 8), 16, np.uint8), 4)
    with pytest.raises(ValueError, match="num_bits = 3"):
        packing.pack_rows(np.zeros((8, 8), np.uint8), 3)
    with pytest.raises(TypeError, match="integer codes"):
        packing.pack_cols(np.zeros((8, 8), np.float32), 4)
