"""Bit fields in 32-bit words: how checkpoints pack 4- and 8-bit codes.

A word holds ``pf = 32 // bits`` codes; *field j* is bits ``[j*bits, (j+1)*bits)``, lowest bits first.

    GPTQ qweight  [K/pf, N]  packs along K (rows):     field j of word (r, n)  = code(r*pf + j, n)
    column packing [R, N/pf] packs along N:            field j of word (r, c)  = code(r, c*pf + j)
    AWQ            [R, N/pf] packs along N, interleaved: field j of word (r, c) = code(r, c*pf + AWQ_ORDER[j])

AWQ's order ``[0, 2, 4, 6, 1, 3, 5, 7]`` (4-bit) / ``[0, 2, 1, 3]`` (8-bit) is the same interleave Marlin uses inside
a word, so AutoAWQ's dequantizer can pull element pairs with one shift (docs/formats.md, "AWQ packing").
"""
from __future__ import annotations

import numpy as np

from workbench.formats._checks import check_bits, require, require_dtype, require_ndim

# field j of an AWQ word holds column c*pf + AWQ_ORDER[j]
AWQ_ORDER = {4: np.array([0, 2, 4, 6, 1, 3, 5, 7]), 8: np.array([0, 2, 1, 3])}
# position i of the logical columns comes from field AWQ_UNDO[i]   (AWQ_UNDO = argsort(AWQ_ORDER))
AWQ_UNDO = {bits: np.argsort(order) for bits, order in AWQ_ORDER.items()}


def pack_factor(bits: int) -> int:
    return 32 // check_bits(bits)


def _check_codes(codes: np.ndarray, bits: int, name: str) -> np.ndarray:
    codes = np.asarray(codes)
    require_ndim(codes, 2, name)
    if not np.issubdtype(codes.dtype, np.integer):
        raise TypeError(f"{name} must hold integer codes, got dtype {codes.dtype}")
    if codes.size and (codes.min() < 0 or codes.max() >= (1 << bits)):
        raise ValueError(
            f"{name} holds values in [{codes.min()}, {codes.max()}], outside the {bits}-bit code range [0, {(1 << bits) - 1}]"
        )
    return codes


def _pack_last_axis(fields: np.ndarray, bits: int) -> np.ndarray:
    """fields: (..., pf) codes -> (...) int32 words, field j at bit j*bits. One pass per field (fast for any strides)."""
    words = np.zeros(fields.shape[:-1], dtype=np.uint32)
    for j in range(fields.shape[-1]):
        words |= fields[..., j].astype(np.uint32) << np.uint32(j * bits)
    return words.view(np.int32)


def _unpack_last_axis(words: np.ndarray, bits: int) -> np.ndarray:
    """(...) words -> (..., pf) uint8 codes."""
    pf = 32 // bits
    u = np.asarray(words).view(np.uint32)
    fields = np.empty(u.shape + (pf,), dtype=np.uint8)
    for j in range(pf):
        fields[..., j] = (u >> np.uint32(j * bits)) & np.uint32((1 << bits) - 1)
    return fields


def pack_rows(codes: np.ndarray, bits: int) -> np.ndarray:
    """GPTQ qweight: codes (K, N) -> int32 (K/pf, N), packed along K."""
    pf = pack_factor(bits)
    codes = _check_codes(codes, bits, "codes")
    k, n = codes.shape
    require(k % pf == 0, f"K = {k} is not divisible by the pack factor {pf} ({bits}-bit)")
    fields = codes.reshape(k // pf, pf, n).transpose(0, 2, 1)  # (K/pf, N, pf)
    return _pack_last_axis(fields, bits)


def unpack_rows(q: np.ndarray, bits: int) -> np.ndarray:
    """Inverse of pack_rows: int32 (K/pf, N) -> uint8 codes (K, N)."""
    pf = pack_factor(bits)
    q = np.asarray(q)
    require_ndim(q, 2, "qweight")
    require_dtype(q, (np.int32, np.uint32), "qweight")
    r, n = q.shape
    codes = np.empty((r, pf, n), dtype=np.uint8)
    words = np.ascontiguousarray(q).view(np.uint32)
    for j in range(pf):  # field j of every word is row r*pf + j: write whole contiguous rows at a time
        np.bitwise_and(words >> np.uint32(j * bits), np.uint32((1 << bits) - 1), out=codes[:, j, :], casting="unsafe")
    return codes.reshape(r * pf, n)


def pack_cols(codes: np.ndarray, bits: int) -> np.ndarray:
    """Column packing (GPTQ qzeros, Marlin zero points): codes (R, N) -> int32 (R, N/pf)."""
    pf = pack_factor(bits)
    codes = _check_codes(codes, bits, "codes")
    r, n = codes.shape
    require(n % pf == 0, f"N = {n} is not divisible by the pack factor {pf} ({bits}-bit)")
    return _pack_last_axis(codes.reshape(r, n // pf, pf), bits)


def unpack_cols(q: np.ndarray, bits: int) -> np.ndarray:
    """Inverse of pack_cols: int32 (R, N/pf) -> uint8 codes (R, N)."""
    pf = pack_factor(bits)
    q = np.asarray(q)
    require_ndim(q, 2, "packed columns")
    require_dtype(q, (np.int32, np.uint32), "packed columns")
    r, c = q.shape
    return _unpack_last_axis(q, bits).reshape(r, c * pf)


def awq_pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """AutoAWQ packing: codes (R, N) -> int32 (R, N/pf), columns interleaved inside each word."""
    pf = pack_factor(bits)
    codes = _check_codes(codes, bits, "codes")
    r, n = codes.shape
    require(n % pf == 0, f"N = {n} is not divisible by the pack factor {pf} ({bits}-bit)")
    fields = codes.reshape(r, n // pf, pf)[:, :, AWQ_ORDER[bits]]
    return _pack_last_axis(fields, bits)


def awq_unpack(q: np.ndarray, bits: int) -> np.ndarray:
    """Inverse of awq_pack: int32 (R, N/pf) -> uint8 codes (R, N) in logical column order."""
    pf = pack_factor(bits)
    fields = unpack_cols(q, bits).reshape(q.shape[0], -1, pf)
    return fields[:, :, AWQ_UNDO[bits]].reshape(q.shape[0], -1)
