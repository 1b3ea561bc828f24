"""The last step of the path: one lane's Marlin words become the B-operand registers of ``mma.m16n8k16``.

A bit-exact NumPy mirror of ``dequant_subblock`` in ``kernels_cuda/dequant.cuh``: the same masks, magic numbers,
shifts and rounding steps, on ``uint32`` registers, so that every intermediate value can be printed, drawn and
compared with the kernel on a GPU (``tests/gpu/test_register_dequant_gpu.py``).

One lane, one 16(k) × 16(n) sub-block of a 16×64 Marlin tile ("The Marlin 16×64 tile" in docs/formats.md)::

               column n0 = lane // 4          column n0 + 8
    rows k0, k0+1     b[0][0]                     b[1][0]           k0 = 2 (lane % 4)
    rows k0+8, k0+9   b[0][1]                     b[1][1]

``b[h][r]`` is one 32-bit register holding two activation-typed values (low 16 bits: the lower k row). ``b[h]`` is
the B operand ``{b0, b1}`` of the mma for columns ``n0 + 8h``; register ``r`` of it holds fragment elements
``2r`` (low half) and ``2r + 1`` (high half) of ``mma_b_fragment`` (PTX ISA, "Matrix Fragments for mma.m16n8k16").

How a code becomes a number without a conversion instruction (the "magic number" trick): OR-ing a code
``c < 2^m`` into the mantissa of the float ``2^m`` gives exactly ``2^m + c``, and subtracting ``2^m + zero`` leaves
the exact small integer ``c - zero``.

* 4-bit, fp16: ``lop3`` with mask ``0x000f000f`` and magic ``0x6400`` (1024) carries fields 0 and 4 as
  ``1024 + c``; the second mask ``0x00f000f0`` carries fields 1 and 5 as ``1024 + 16 c`` (the nibble sits 4 bits
  up), and one ``hfma2`` by 1/16 with ``-(64 + zero)`` gives ``c - zero``. The column ``n0 + 8`` (fields 2, 3, 6, 7)
  is the same after ``>> 8``.
* 4-bit, bf16: bf16 has 7 mantissa bits, so the magic is ``0x4300`` (128) and both nibbles use the low mask
  (the second after ``>> 4``).
* 8-bit (u8b128, u8): ``prmt`` (``__byte_perm``) puts bytes 0 and 2 (rows k0, k0+1) beside the magic byte
  ``0x64``: the fp16 pair ``(1024 + b0, 1024 + b2)``; bytes 1 and 3 (rows k0+8, k0+9) likewise. In bf16 the
  subtraction happens in fp16 and the exact integer is converted.
* FP8 E4M3: no arithmetic, only bits move: the sign to bit 15, the 7 exponent and mantissa bits below it. The
  exponent is copied as is, so the value is off by 2^8 (fp16) or 2^120 (bf16); that factor is folded into the scales
  on the host ("FP8 scales" in docs/formats.md), so the scale multiply is the only arithmetic here.

Every difference above is exact; the one rounding is the scale multiply ``hmul2``, as in the reference
``workbench.quantize.dequantize``. In NumPy each 16-bit operation is done in float32, where these operands' results
are exact (at most 11 + 11 significant bits), then rounded once to the 16-bit type: the rounding the hardware does.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from workbench.formats.marlin_tile import (FIELD_INTERLEAVE, mma_b_fragment, slot_element_to_fragment,
                                          words_per_lane, words_per_tile)
from workbench.scalar_types import ScalarType

F16 = np.dtype(np.float16)
BF16 = np.dtype(ml_dtypes.bfloat16)

# lop3.b32 d, a, b, c, 0xEA computes (a & b) | c (immLut = (0xF0 & 0xCC) | 0xAA)
LOP3_AND_OR = 0xEA
LO_MASK = 0x000F000F  # the low nibble of each 16-bit half: fields 0 and 4 (after >> 8: fields 2 and 6)
HI_MASK = 0x00F000F0  # the second nibble of each half: fields 1 and 5 (after >> 8: 3 and 7)
MAGIC_F16 = 0x6400  # fp16 1024: its ulp is 1 over 1024..2047, room for 8-bit codes
MAGIC_BF16 = 0x4300  # bf16 128: its ulp is 1 over 128..255, room for 4-bit codes only
ONE_SIXTEENTH_F16 = 0x2C00  # fp16 1/16: undoes the 4-bit shift of a second-nibble code
NEG_64_F16 = 0xD400  # fp16 -64: the second-nibble path subtracts 64 + zero (ulp 1/16 there)
MAGIC_BYTE = 0x64  # high byte of MAGIC_F16, the filler __byte_perm puts above each 8-bit code
# __byte_perm selectors: result byte i = byte (selector >> 4i) & 7 of {x, 0x64646464} (bytes 4..7 = 0x64)
PRMT_ROWS_K0 = 0x4240  # [x.b0, 0x64, x.b2, 0x64]: rows (k0, k0+1)
PRMT_ROWS_K8 = 0x4341  # [x.b1, 0x64, x.b3, 0x64]: rows (k0+8, k0+9)
FP8_SIGN = 0x80008000  # the sign bits of both halves
FP8_BITS = {F16: 0x3F803F80, BF16: 0x07F007F0}  # where the 7 exponent + mantissa bits land
FP8_SHIFT = {F16: 7, BF16: 4}  # left shift that moves bits 0..6 of a byte there (fp16: to 7..13, bf16: to 4..10)
U32 = np.uint32


def _u32(x) -> np.ndarray:
    """As uint32 registers: int32 words by their bits, Python ints modulo 2^32."""
    x = np.asarray(x)
    if x.dtype == np.int32:
        return x.view(U32)
    return x if x.dtype == U32 else (x.astype(np.int64) & 0xFFFFFFFF).astype(U32)


def and_or(a, b, c) -> np.ndarray:
    """``lop3.b32 d, a, b, c, 0xEA``: (a & b) | c on uint32."""
    return (_u32(a) & _u32(b)) | _u32(c)


def byte_perm(x, y, selector: int) -> np.ndarray:
    """``__byte_perm(x, y, s)`` (PTX ``prmt``, default mode): byte i of the result is byte ``(s >> 4i) & 7`` of the
    8-byte value {y:x} (bytes 0..3 from x, 4..7 from y)."""
    x, y = _u32(x), _u32(y)
    out = np.zeros(np.broadcast(x, y).shape, dtype=U32)
    for i in range(4):
        b = (selector >> (4 * i)) & 7
        src = x if b < 4 else y
        out |= ((src >> U32(8 * (b % 4))) & U32(0xFF)) << U32(8 * i)
    return out


def halves(reg, dtype) -> tuple[np.ndarray, np.ndarray]:
    """A 32-bit register as its (low, high) 16-bit values of ``dtype`` (fp16 or bf16), no conversion."""
    reg = _u32(reg)
    lo = (reg & U32(0xFFFF)).astype(np.uint16).view(np.dtype(dtype))
    hi = (reg >> U32(16)).astype(np.uint16).view(np.dtype(dtype))
    return lo, hi


def pair(lo, hi) -> np.ndarray:
    """Two 16-bit values (fp16/bf16 arrays) -> one uint32 register (lo in bits 0..15)."""
    lo = np.asarray(lo)
    hi = np.asarray(hi)
    return lo.view(np.uint16).astype(U32) | (hi.view(np.uint16).astype(U32) << U32(16))


def _pairwise(op, dtype, *regs) -> np.ndarray:
    """Apply ``op`` to both halves of the registers in float32 (exact for these operands), round once to dtype."""
    parts = [halves(r, dtype) for r in regs]
    lo = op(*(p[0].astype(np.float32) for p in parts)).astype(dtype)
    hi = op(*(p[1].astype(np.float32) for p in parts)).astype(dtype)
    return pair(lo, hi)


def hsub2(a, b, dtype) -> np.ndarray:
    return _pairwise(lambda x, y: x - y, dtype, a, b)


def hmul2(a, b, dtype) -> np.ndarray:
    return _pairwise(lambda x, y: x * y, dtype, a, b)


def hfma2(a, b, c, dtype) -> np.ndarray:
    """a * b + c rounded once. (The products here are exact in float32, so float32 multiply-then-add is the fma.)"""
    return _pairwise(lambda x, y, z: x * y + z, dtype, a, b, c)


def splat(bits16) -> np.ndarray:
    """Both halves of a register set to the same 16-bit pattern (``v * 0x10001``)."""
    return _u32(bits16) * U32(0x10001)


def carries_in_bf16(weight_type, act_dtype) -> bool:
    """True when the integer path of (weight type, activation) carries codes in bf16 (4-bit codes, bf16 activations);
    everything else goes through fp16 (8-bit codes need 10 mantissa bits)."""
    return np.dtype(act_dtype) == BF16 and ScalarType.parse(weight_type).bits == 4


def offset_bits(zero, weight_type, act_dtype) -> np.ndarray:
    """16-bit pattern of ``magic + zero`` in the carrier type (the ulp is 1 over the codes' range: a plain OR)."""
    magic = MAGIC_BF16 if carries_in_bf16(weight_type, act_dtype) else MAGIC_F16
    return np.uint16(magic) | np.asarray(zero).astype(np.uint16)


def neg_offset16_bits(zero) -> np.ndarray:
    """fp16 pattern of ``-(64 + zero)``: the constant of the second-nibble ``hfma2`` (ulp 1/16 between 64 and 128)."""
    return np.uint16(NEG_64_F16) | (np.asarray(zero).astype(np.uint16) << np.uint16(4))


def zero_of(weight_type, zeros=None) -> np.ndarray | int:
    """The value subtracted from each code: the zero point (u4, u8) or the type's fixed bias (u4b8: 8, u8b128: 128)."""
    wt = ScalarType.parse(weight_type)
    if wt.has_zero_points:
        if zeros is None:
            raise ValueError(f"{wt} needs zero points")
        return np.asarray(zeros)
    return 0 if wt is ScalarType.FE4M3FN else wt.bias


def words_per_subblock(weight_type) -> int:
    """4-bit: one word covers both column halves of a sub-block; 8-bit: one word per column half."""
    return ScalarType.parse(weight_type).bits // 4


def dequant_subblock(words, weight_type, act_dtype, scales, zeros=None, scaled: bool = True, steps=None):
    """One lane's share of one 16×16 sub-block, as the kernel computes it.

    words: (..., words_per_subblock) uint32 — the lane's word(s) of this sub-block (its slot s of the tile);
    scales: (..., 2) act_dtype — the scale of column n0 + 8h for h = 0, 1 (FP8: the folded scale the kernel reads);
    zeros: (..., 2) int — u4/u8 zero points of those columns (ignored for the symmetric and FP8 types).
    Returns (..., 2, 2) uint32 registers b[h][r]. ``scaled=False`` leaves the scale out (the kernel's late-scaling
    loops). With ``steps`` a list, appends ``(h, name, uint32 register)`` for every intermediate value.
    """
    wt = ScalarType.parse(weight_type)
    act = np.dtype(act_dtype)
    if act not in (F16, BF16):
        raise TypeError(f"act_dtype must be float16 or bfloat16, got {act}")
    if wt not in (ScalarType.U4, ScalarType.U4B8, ScalarType.U8, ScalarType.U8B128, ScalarType.FE4M3FN):
        raise ValueError(f"{wt} is not a quantized weight type")
    words = _u32(words)
    nw = words_per_subblock(wt)
    if words.shape[-1:] != (nw,):
        raise ValueError(f"words has shape {words.shape}, expected (..., {nw}) for {wt}")
    lead = words.shape[:-1]
    scales = np.broadcast_to(np.asarray(scales, dtype=act), lead + (2,))
    zero = np.broadcast_to(zero_of(wt, zeros), lead + (2,)) if wt is not ScalarType.FE4M3FN else None
    record = steps.append if steps is not None else (lambda item: None)
    b = np.zeros(lead + (2, 2), dtype=U32)
    for h in range(2):
        if wt is ScalarType.FE4M3FN:
            x = words[..., h]
            record((h, "word", x))
            sh = FP8_SHIFT[act]
            # bytes (0, 2) -> rows (k0, k0+1); bytes (1, 3) -> rows (k0+8, k0+9)
            v0 = ((x << U32(8)) & U32(FP8_SIGN)) | ((x << U32(sh)) & U32(FP8_BITS[act]))
            v1 = (x & U32(FP8_SIGN)) | ((x >> U32(8 - sh)) & U32(FP8_BITS[act]))
            record((h, "bytes 0, 2 moved", v0))
            record((h, "bytes 1, 3 moved", v1))
        elif wt.bits == 4 and not carries_in_bf16(wt, act):
            x = words[..., 0] >> U32(8 * h)
            record((h, "word >> 8" if h else "word", x))
            lo = and_or(x, LO_MASK, splat(MAGIC_F16))  # 1024 + code (fields 0, 4 / 2, 6)
            hi = and_or(x, HI_MASK, splat(MAGIC_F16))  # 1024 + 16 code (fields 1, 5 / 3, 7)
            record((h, "lop3 low mask | 0x6400", lo))
            record((h, "lop3 high mask | 0x6400", hi))
            off = pair(*(offset_bits(zero[..., h], wt, act).view(F16),) * 2)
            off16 = pair(*(neg_offset16_bits(zero[..., h]).view(F16),) * 2)
            v0 = hsub2(lo, off, F16)
            v1 = hfma2(hi, splat(ONE_SIXTEENTH_F16), off16, F16)
            record((h, "minus (1024 + zero)", v0))
            record((h, "times 1/16 minus (64 + zero)", v1))
        elif wt.bits == 4:
            x = words[..., 0] >> U32(8 * h)
            record((h, "word >> 8" if h else "word", x))
            lo = and_or(x, LO_MASK, splat(MAGIC_BF16))
            hi = and_or(x >> U32(4), LO_MASK, splat(MAGIC_BF16))
            record((h, "lop3 low mask | 0x4300", lo))
            record((h, ">> 4, lop3 low mask | 0x4300", hi))
            off = splat(offset_bits(zero[..., h], wt, act))
            v0 = hsub2(lo, off, BF16)
            v1 = hsub2(hi, off, BF16)
            record((h, "minus (128 + zero)", v0))
            record((h, "minus (128 + zero) ", v1))
        else:
            x = words[..., h]
            record((h, "word", x))
            lo = byte_perm(x, 0x64646464, PRMT_ROWS_K0)  # fp16 (1024 + b0, 1024 + b2)
            hi = byte_perm(x, 0x64646464, PRMT_ROWS_K8)  # fp16 (1024 + b1, 1024 + b3)
            record((h, "prmt bytes 0, 2 under 0x64", lo))
            record((h, "prmt bytes 1, 3 under 0x64", hi))
            off = splat(offset_bits(zero[..., h], wt, act))
            v0 = hsub2(lo, off, F16)
            v1 = hsub2(hi, off, F16)
            if act == BF16:  # exact: integers of at most 9 bits
                v0 = pair(*(p.astype(np.float32).astype(BF16) for p in halves(v0, F16)))
                v1 = pair(*(p.astype(np.float32).astype(BF16) for p in halves(v1, F16)))
            record((h, "minus (1024 + zero)", v0))
            record((h, "minus (1024 + zero) ", v1))
        for r, v in enumerate((v0, v1)):
            if scaled:
                s = scales[..., h]
                v = hmul2(v, pair(s, s), act)
                record((h, f"b[{h}][{r}] = times scale", v))
            b[..., h, r] = v
    return b


# ---------------------------------------------------------------------------------------------------------------
# Where the registers' values sit in the sub-block, and where a lane's words sit in the tile
# ---------------------------------------------------------------------------------------------------------------
def b_register_element(lane, h, r, half):
    """(lane, column half h, register r, 16-bit half) -> (dk, dn) inside a 16×16 sub-block. Vectorized.

    Register b[h][r] half ``half`` is element ``e = 2r + half`` of the lane's 16×8 B fragment of columns 8h.."""
    dk, dn = mma_b_fragment(lane, 2 * np.asarray(r) + np.asarray(half))
    return dk, dn + 8 * np.asarray(h)


def field_register(bits: int):
    """(pf,) tuples: field j of a 4-bit word (or byte j of an 8-bit word) -> (h, r, half) of the register it lands in.

    Derived from the tile maps: field j holds natural element FIELD_INTERLEAVE[bits][j], which is fragment element
    e of column half h (``slot_element_to_fragment``); e is register r = e // 2, half e % 2. For 8-bit, h is the word.
    """
    out = []
    for j, element in enumerate(FIELD_INTERLEAVE[bits]):
        if bits == 4:
            _, h, e = slot_element_to_fragment(0, element, 4)
        else:
            h, e = None, element
        out.append((None if h is None else int(h), int(e) // 2, int(e) % 2))
    return out


def lane_subblock_words(qweight, size_n: int, k_tile: int, n_tile: int, lane: int, subblock: int, bits: int):
    """The word(s) the kernel hands ``dequant_subblock`` for (tile, lane, sub-block): words_per_lane consecutive
    words start at ``lane * words_per_lane`` inside the tile (one 16-byte load for 4-bit, two for 8-bit)."""
    flat = np.asarray(qweight).view(U32).reshape(-1)
    tile = k_tile * (size_n // 64) + n_tile
    start = tile * words_per_tile(bits) + lane * words_per_lane(bits) + subblock * (bits // 4)
    return flat[start:start + bits // 4]


def dequant_tile_registers(qweight, size_k: int, size_n: int, weight_type, act_dtype, scales, zeros=None,
                           k_tile: int = 0, n_tile: int = 0) -> np.ndarray:
    """Run ``dequant_subblock`` for every lane and sub-block of one 16×64 tile and place each register half at the
    (k, n) ``b_register_element`` names: the tile's dequantized weight (16, 64) in act_dtype, as the mma sees it.

    scales, zeros: (ng, N) logical (checkpoint-order) per-column values of the group that holds the tile's rows
    (FP8: folded scales). The tile's 16 rows lie in one group for every supported group size (>= 16).
    """
    wt = ScalarType.parse(weight_type)
    act = np.dtype(act_dtype)
    bits = wt.bits
    lanes = np.arange(32)
    out = np.zeros((16, 64), dtype=act)
    group_rows = np.asarray(scales)
    row = (16 * k_tile) // (size_k // group_rows.shape[0])  # the group of the tile's rows
    for s in range(4):
        words = np.stack([lane_subblock_words(qweight, size_n, k_tile, n_tile, int(t), s, bits) for t in lanes])
        cols = 64 * n_tile + 16 * s + lanes[:, None] // 4 + 8 * np.arange(2)[None, :]  # (32, 2)
        sc = group_rows[row, cols].astype(act)
        zp = None if zeros is None else np.asarray(zeros)[row, cols]
        regs = dequant_subblock(words, wt, act, sc, zp)  # (32, 2, 2)
        for h in range(2):
            for r in range(2):
                lo, hi = halves(regs[:, h, r], act)
                for half, v in enumerate((lo, hi)):
                    dk, dn = b_register_element(lanes, h, r, half)
                    out[dk, 16 * s + dn] = v
    return out
