"""The NumPy mirror of the kernels' register-level dequantization (workbench.formats.register_dequant) equals the
reference dequantizer bit for bit: exhaustively over every (code, zero) pair in every field position, over every
combination of the fields that share a register, and over whole repacked tiles placed by the fragment maps."""
import itertools

import numpy as np
import pytest

from workbench.formats import marlin_tile as mt
from workbench.formats import register_dequant as rd
from workbench.formats.fp8 import exponent_bias
from workbench.quantize import dequantize, quantize_weights
from workbench.scalar_types import ScalarType

ACTS = [rd.F16, rd.BF16]
TYPES = ["u4b8", "u4", "u8b128", "u8", "fe4m3fn"]


def _bits16(x, act):
    return np.asarray(x, dtype=np.float32).astype(act).view(np.uint16)


def _register_codes(words, bits):
    """(n, words_per_subblock) words -> (n, 2, 2, 2) codes at [h, r, half], placed by field_register (the maps)."""
    out = np.zeros(words.shape[:1] + (2, 2, 2), dtype=np.int64)
    for j, (h, r, half) in enumerate(rd.field_register(bits)):
        if bits == 4:
            out[:, h, r, half] = (words[:, 0] >> np.uint32(4 * j)) & np.uint32(0xF)
        else:
            for hw in range(2):
                out[:, hw, r, half] = (words[:, hw] >> np.uint32(8 * j)) & np.uint32(0xFF)
    return out


def _cases(bits, rng):
    """Words and zeros that put every code, under every zero, into every field position."""
    if bits == 4:
        # every (code, zero) in every field: code c in all 8 fields of word c, 16 zeros -> 256 cases
        c, z = np.meshgrid(np.arange(16), np.arange(16), indexing="ij")
        c, z = c.ravel(), z.ravel()
        words = (c.astype(np.uint32) * np.uint32(0x11111111))[:, None]
        return words, np.stack([z, (z + 5) % 16], axis=-1)
    c, z = np.meshgrid(np.arange(256), np.arange(256), indexing="ij")
    c, z = c.ravel(), z.ravel()
    b = [c, (c + 85) % 256, 255 - c, (c * 7) % 256]  # every code in every byte position
    w0 = sum(bj.astype(np.uint32) << np.uint32(8 * j) for j, bj in enumerate(b))
    w1 = np.roll(w0, 1000)
    return np.stack([w0, w1], axis=-1), np.stack([z, 255 - z], axis=-1)


@pytest.mark.parametrize("act", ACTS, ids=str)
@pytest.mark.parametrize("weight_type", TYPES)
def test_every_code_and_zero_equals_the_reference(weight_type, act, rng):
    wt = ScalarType.parse(weight_type)
    words, zeros = _cases(wt.bits, rng)
    n = words.shape[0]
    if wt is ScalarType.FE4M3FN:
        true_scales = rng.uniform(0.01, 2.0, (n, 2)).astype(np.float32)
        kernel_scales = (true_scales * np.float32(exponent_bias(act))).astype(act)  # folded, as the host does
    else:
        true_scales = rng.uniform(0.001, 2.0, (n, 2)).astype(act)
        kernel_scales = true_scales
    regs = rd.dequant_subblock(words, wt, act, kernel_scales, zeros)
    codes = _register_codes(words, wt.bits)  # (n, h, r, half)
    col_scales = np.broadcast_to(true_scales[:, :, None, None], codes.shape)
    col_zeros = np.broadcast_to(zeros[:, :, None, None], codes.shape)
    if wt is ScalarType.FE4M3FN:  # E4M3FN 0x7F / 0xFF are NaN; the bit move gives them a finite value (tested below)
        finite = (codes & 0x7F) != 0x7F
    else:
        finite = np.ones(codes.shape, bool)
    ref = dequantize(codes[finite][None, :].astype(np.uint8), col_scales[finite][None, :],
                     col_zeros[finite][None, :] if wt.has_zero_points else None, wt, -1, act_dtype=act)[0]
    got = np.stack([rd.halves(regs, act)[0], rd.halves(regs, act)[1]], axis=-1)[finite]
    assert np.array_equal(got.view(np.uint16), _bits16(ref, act))


@pytest.mark.parametrize("act", ACTS, ids=str)
@pytest.mark.parametrize("weight_type", ["u4", "u8"])
def test_unscaled_registers_are_code_minus_zero_for_every_field_combination(weight_type, act):
    """Every combination of the two codes that share a register (4-bit: all 2^16 values of each 16-bit pair of
    nibbles; 8-bit: all 2^16 byte pairs), unscaled: exactly code - zero in both halves."""
    wt = ScalarType.parse(weight_type)
    v = np.arange(1 << 16, dtype=np.uint32)
    if wt.bits == 4:  # low byte of each half: fields (0, 1) and (4, 5); the same moved up 8 for fields (2, 3), (6, 7)
        spread = (v & np.uint32(0xFF)) | ((v >> np.uint32(8)) << np.uint32(16))
        words = np.stack([spread | (spread << np.uint32(8))], axis=-1)
        zeros = np.stack([v % 16, (v // 16) % 16], axis=-1)
    else:
        spread = (v & np.uint32(0xFF)) | ((v >> np.uint32(8)) << np.uint32(16))  # bytes 0 and 2
        words = np.stack([spread, spread << np.uint32(8)], axis=-1)  # word 1: the same codes in bytes 1 and 3
        zeros = np.stack([v % 256, (v * 3) % 256], axis=-1)
    regs = rd.dequant_subblock(words, wt, act, np.ones((v.size, 2), act), zeros, scaled=False)
    expect = _register_codes(words, wt.bits) - zeros[:, :, None, None]
    lo, hi = rd.halves(regs, act)
    assert np.array_equal(np.stack([lo, hi], axis=-1).astype(np.float32), expect.astype(np.float32))


@pytest.mark.parametrize("act", ACTS, ids=str)
def test_fp8_bit_move_is_value_times_two_to_minus_bias_for_every_byte(act):
    b = np.arange(256, dtype=np.uint32)
    words = np.stack([b | (b << np.uint32(16)), (b << np.uint32(8)) | (b << np.uint32(24))], axis=-1)
    regs = rd.dequant_subblock(words, "fe4m3fn", act, np.ones((256, 2), act), scaled=False)
    moved = rd.halves(regs[:, 0, 0], act)[0].astype(np.float64)
    assert np.array_equal(rd.halves(regs[:, 1, 1], act)[1].astype(np.float64), moved)  # byte 3 of word 1: the same
    value = b.astype(np.uint8).view(rd.ml_dtypes.float8_e4m3fn).astype(np.float64)
    finite = (b & 0x7F) != 0x7F
    assert np.array_equal(moved[finite] * exponent_bias(act), value[finite])
    # NaN codes are not special-cased: 0x7F moves to the finite 1.875 * 2^8 (times 2^-bias): checkpoints hold none
    assert moved[0x7F] * exponent_bias(act) == 480.0 and moved[0xFF] * exponent_bias(act) == -480.0


@pytest.mark.parametrize("act", ACTS, ids=str)
@pytest.mark.parametrize("weight_type,group_size", [("u4b8", 32), ("u4", 64), ("u8b128", -1), ("u8", 32),
                                                    ("fe4m3fn", -1), ("u4b8", 128)])
def test_registers_placed_by_the_fragment_maps_rebuild_every_tile(weight_type, group_size, act, rng):
    size_k, size_n = 128, 128
    q = quantize_weights(rng.standard_normal((size_k, size_n)).astype(np.float32), weight_type, group_size,
                         act_dtype=act, seed=int(rng.integers(1 << 30)))
    qweight = mt.marlin_repack_codes(q.codes, q.weight_type.bits)
    scales = q.scales
    if q.weight_type is ScalarType.FE4M3FN:
        scales = (q.scales * np.float32(exponent_bias(act))).astype(act)
    for kt, nt in itertools.product(range(size_k // 16), range(size_n // 64)):
        tile = rd.dequant_tile_registers(qweight, size_k, size_n, weight_type, act, scales, q.zeros, kt, nt)
        ref = q.w_ref[16 * kt:16 * kt + 16, 64 * nt:64 * nt + 64]
        assert np.array_equal(tile.view(np.uint16), _bits16(ref, act)), (kt, nt)


def test_a_swapped_register_half_is_caught(rng):
    """The tile check can fail: placing register halves by the wrong fragment element breaks it."""
    q = quantize_weights(rng.standard_normal((16, 64)).astype(np.float32), "u4b8", -1)
    qweight = mt.marlin_repack_codes(q.codes, 4)
    good = rd.dequant_tile_registers(qweight, 16, 64, "u4b8", np.float16, q.scales)
    original = rd.b_register_element
    try:
        rd.b_register_element = lambda lane, h, r, half: original(lane, h, r, 1 - np.asarray(half))
        bad = rd.dequant_tile_registers(qweight, 16, 64, "u4b8", np.float16, q.scales)
    finally:
        rd.b_register_element = original
    assert np.array_equal(good, q.w_ref.astype(np.float16)) and not np.array_equal(bad, good)


def test_field_register_is_the_header_table():
    """dequant.cuh's table, field j -> (dk, dn): 0:(0,0) 1:(8,0) 2:(0,8) 3:(8,8) 4:(1,0) 5:(9,0) 6:(1,8) 7:(9,8)."""
    table = [(0, 0), (8, 0), (0, 8), (8, 8), (1, 0), (9, 0), (1, 8), (9, 8)]
    got = [tuple(int(v) for v in rd.b_register_element(0, h, r, half)) for h, r, half in rd.field_register(4)]
    assert got == table
    # 8-bit: byte j holds dk = 0, 8, 1, 9
    assert [int(rd.b_register_element(0, 0, r, half)[0]) for _, r, half in rd.field_register(8)] == [0, 8, 1, 9]


def test_b_register_element_covers_the_subblock_once():
    lane, h, r, half = np.meshgrid(np.arange(32), np.arange(2), np.arange(2), np.arange(2), indexing="ij")
    dk, dn = rd.b_register_element(lane, h, r, half)
    assert np.array_equal(np.sort((16 * dk + dn).ravel()), np.arange(256))


def test_byte_perm_and_lop3_primitives():
    x = np.uint32(0xA1B2C3D4)
    assert int(rd.byte_perm(x, 0x64646464, rd.PRMT_ROWS_K0)) == 0x64B264D4
    assert int(rd.byte_perm(x, 0x64646464, rd.PRMT_ROWS_K8)) == 0x64A164C3
    assert int(rd.and_or(0xFFFFFFFF, rd.LO_MASK, 0x64006400)) == 0x640F640F
    assert rd.halves(rd.and_or(0x00070003, rd.LO_MASK, 0x64006400), np.float16)[0] == 1027.0


def test_errors_name_the_values():
    with pytest.raises(ValueError, match=r"expected \(\.\.\., 2\) for u8b128"):
        rd.dequant_subblock(np.zeros((3, 1), np.uint32), "u8b128", np.float16, np.ones(2, np.float16))
    with pytest.raises(ValueError, match="u4 needs zero points"):
        rd.dequant_subblock(np.zeros((3, 1), np.uint32), "u4", np.float16, np.ones(2, np.float16))
    with pytest.raises(TypeError, match="float32"):
        rd.dequant_subblock(np.zeros((3, 1), np.uint32), "u4b8", np.float32, np.ones(2, np.float32))
    with pytest.raises(ValueError, match="bf16 is not a quantized weight type"):
        rd.dequant_subblock(np.zeros((3, 1), np.uint32), "bf16", np.float16, np.ones(2, np.float16))


def test_steps_record_every_intermediate():
    steps = []
    rd.dequant_subblock(np.array([0x12345678], np.uint32), "u4b8", np.float16, np.ones(2, np.float16), steps=steps)
    names = [name for h, name, _ in steps if h == 0]
    assert names == ["word", "lop3 low mask | 0x6400", "lop3 high mask | 0x6400", "minus (1024 + zero)",
                     "times 1/16 minus (64 + zero)", "b[0][0] = times scale", "b[0][1] = times scale"]
    assert int(steps[1][2]) == 0x64046408  # fields 0 and 4 of 0x12345678: 8 and 4
