"""The ops' CPU path (``backend="cpu"``): the Marlin repacks as compiled host loops, bit for bit the NumPy reference.

The reference (``workbench.formats``) is written to be read: it unpacks every code to a byte, transposes, widens to
uint32 fields and ORs them back, so each weight byte goes through memory several times. The checkpoint pipeline's CPU
path is bound by that memory traffic, so here each output word is built in registers from the source words that
hold its codes: one read of the source, one write of the output, no temporary bigger than a few kilobytes.

**One shape for every weight source.** Marlin row ``kt`` of a qweight holds k-tile ``kt`` (16 rows of K) as its
N_pad / 64 tiles in column order. For each k-tile and block of columns, the source is first *staged* as the k-tile's
rows in GPTQ packing (pf = 32 / bits rows per word, ``16 / pf`` words per column), in Marlin row order; then one
routine, ``_tile_row``, turns those words into the k-tile's Marlin words::

    source                                 staged words of k-tile kt (16 / pf per column)
    GPTQ qweight      [K/pf, N]            its rows 16kt/pf ...: copied as they are
    + act-order perm                       Marlin row k's code is field perm[k] % pf of row perm[k] // pf
    compressed-tensors [N, K/pf]           GPTQ's qweight transposed: the same, read through the transposed view
    block-FP8 bytes   [N, K]               four bytes of a row are one K-major 8-bit word: 8-bit CT
    AWQ qweight       [K, N/pf]            code (k, n) is field AWQ_UNDO[n % pf] of word (k, n // pf)

**``_tile_row``, 4-bit.** A Marlin word of lane (c, r) of sub-block w holds, field j = 0..7, the codes at
(k, n) = (2r, n) (2r+8, n) (2r, n+8) (2r+8, n+8) (2r+1, n) (2r+9, n) (2r+1, n+8) (2r+9, n+8) with n = 16w + c
(``marlin_tile``: the mma B fragment, the sub-blocks, the field interleave [0,2,4,6,1,3,5,7]). In GPTQ words A, B
(rows 0-7, 8-15 at column n) and C, D (the same at n + 8), byte r holds rows 2r and 2r+1. So the Marlin word is
bytes r of A, B, C, D side by side with their nibbles unzipped, low nibbles to fields 0-3, high ones to 4-7::

    bytes r of A B C D:   A.lo A.hi B.lo B.hi C.lo C.hi D.lo D.hi     (nibbles, lowest first)
    Marlin word:          A.lo B.lo C.lo D.lo A.hi B.hi C.hi D.hi     (two delta swaps, ``_unzip_nibbles``)

**8-bit.** The word of lane (c, r), fragment (w, h) holds (2r, n) (2r+8, n) (2r+1, n) (2r+9, n), n = 16w + 8h + c:
the 16-bit half r % 2 of GPTQ words A = row r // 2 and B = row r // 2 + 2, bytes interleaved (``_interleave_pairs``).

Columns and rows past (K, N) are zero codes, as the reference's padding (docs/formats.md, "Shapes that are not tile
multiples"). Scales and zero points are permutations too (``_permute_columns``, ``_zero_point_words``), moved as
their bits. tests/cpu/test_host_repack.py compares every function here with the reference, bit for bit, over the
formats and shapes that are not tile multiples.

The loops are compiled by Numba with ``cache=True`` (compiled once per machine, loaded from ``__pycache__`` after)
and ``nogil`` (threads convert in parallel). The functions take any strides (the pipeline hands column blocks and
transposed views, no copies) and write into ``out`` when given (a column block of the layer's Marlin tensors).
"""
from __future__ import annotations

import sys

import numpy as np
from numba import njit, types

from workbench.formats import fp8 as _fp8
from workbench.formats import packing as _packing
from workbench.formats._checks import padded_k, padded_n, require, require_dtype, require_shape
from workbench.formats.marlin_tile import FIELD_INTERLEAVE, marlin_qweight_shape
from workbench.formats.scales import SCALE_PERM_64, num_groups, scale_permutation

# Columns staged at a time: the staged words (16/pf x 256 x 4 bytes, 2-4 KB) and the source lines a transposed
# source touches (256 rows x 64 bytes) stay in the core's first-level cache
COLUMN_BLOCK = 256
TILES_PER_LINE = 4  # k-tiles in a 64-byte cache line of a row along K (16 bytes of 8-bit codes, 8 of 4-bit, each)
GPTQ_ROWS, AWQ_COLUMNS = 0, 1  # how a weight source packs its codes (the table in the module docstring)
_NO_PERM = np.empty(0, np.int32)
_FIELDS = {bits: np.ascontiguousarray(order, dtype=np.int64) for bits, order in FIELD_INTERLEAVE.items()}
_AWQ_UNDO = {bits: np.ascontiguousarray(undo, dtype=np.int64) for bits, undo in _packing.AWQ_UNDO.items()}
_P64 = np.ascontiguousarray(SCALE_PERM_64, dtype=np.int64)
_U = np.uint32  # the loops compute in 32-bit words: twice the lanes of a vector register of 64-bit ones


def _array(dtype, ndim: int, readonly: bool = False):
    return types.Array(dtype, ndim, "C" if ndim == 1 else "A", readonly=readonly)


# The entry points are compiled when this module is imported (from the cache after the first time), for any strides
# (layout "A"), so that the pipeline's server process, which imports the conversion before it forks its workers,
# hands them compiled code. Inputs read-only (a memory-mapped tensor is); outputs a column block of a layer's.
_SIGNATURES = {
    "repack": types.void(_array(types.uint32, 2, True), types.int64, _array(types.int32, 1, True),
                         _array(types.int64, 1, True), types.int64, types.int64, types.int64,
                         _array(types.uint32, 2)),
    "permute": [types.void(_array(t, 2, True), types.int64, _array(types.int64, 1, True), types.int64, _array(t, 2))
                for t in (types.uint16, types.uint32)],
    "zero_points": types.void(_array(types.uint8, 2, True), _array(types.int64, 1, True),
                              _array(types.int64, 1, True), types.int64, types.int64, _array(types.uint32, 2)),
}
_LITTLE_ENDIAN = sys.byteorder == "little"  # block-FP8 bytes are read as 32-bit words (byte j = bits 8j)


# ---------------------------------------------------------------------------------------------------------------
# one k-tile's Marlin words from its staged GPTQ words
# ---------------------------------------------------------------------------------------------------------------
@njit(cache=True, nogil=True)
def _unzip_nibbles(x):
    """Nibbles (a0 a1 b0 b1 c0 c1 d0 d1) -> (a0 b0 c0 d0 a1 b1 c1 d1), lowest first: swap nibbles 1<->2 and 5<->6,
    then bytes 1<->2."""
    t = ((x >> _U(4)) ^ x) & _U(0x00F000F0)
    x = x ^ t ^ (t << _U(4))
    t = ((x >> _U(8)) ^ x) & _U(0x0000FF00)
    return x ^ t ^ (t << _U(8))


@njit(cache=True, nogil=True)
def _interleave_pairs(a, b):
    """16-bit pairs (a0 a1), (b0 b1) -> bytes (a0 b0 a1 b1), lowest first."""
    return (a & _U(0xFF)) | ((b & _U(0xFF)) << _U(8)) | ((a >> _U(8)) << _U(16)) | ((b >> _U(8)) << _U(24))


@njit(cache=True, nogil=True)
def _at(row, n, width):
    """Word n of a staged row, 0 past the true columns (the padding's zero codes)."""
    return _U(row[n]) if n < width else _U(0)


@njit(cache=True, nogil=True)
def _tile_row_4bit(staged, width, out_row):
    """staged (2, >= width) 4-bit GPTQ words of one k-tile -> its Marlin words out_row (padded_n(width) * 2)."""
    a_row, b_row = staged[0], staged[1]
    for tile in range(out_row.shape[0] // 128):
        for w in range(4):
            for c in range(8):
                n = 64 * tile + 16 * w + c
                a, b = _at(a_row, n, width), _at(b_row, n, width)
                cc, d = _at(a_row, n + 8, width), _at(b_row, n + 8, width)
                for r in range(4):
                    s = _U(8 * r)
                    x = ((a >> s) & _U(0xFF)) | (((b >> s) & _U(0xFF)) << _U(8)) | \
                        (((cc >> s) & _U(0xFF)) << _U(16)) | (((d >> s) & _U(0xFF)) << _U(24))
                    out_row[128 * tile + 4 * (4 * c + r) + w] = _unzip_nibbles(x)


@njit(cache=True, nogil=True)
def _tile_row_8bit(staged, width, out_row):
    """staged (4, >= width) 8-bit GPTQ words of one k-tile -> its Marlin words out_row (padded_n(width) * 4)."""
    for tile in range(out_row.shape[0] // 256):
        for w in range(4):
            for h in range(2):
                for c in range(8):
                    n = 64 * tile + 16 * w + 8 * h + c
                    slot = 256 * tile + 2 * w + h
                    for i in range(2):  # lanes r = 2i (the words' low halves) and 2i + 1 (high halves)
                        a, b = _at(staged[i], n, width), _at(staged[i + 2], n, width)
                        out_row[slot + 8 * (4 * c + 2 * i)] = _interleave_pairs(a & _U(0xFFFF), b & _U(0xFFFF))
                        out_row[slot + 8 * (4 * c + 2 * i + 1)] = _interleave_pairs(a >> _U(16), b >> _U(16))


# ---------------------------------------------------------------------------------------------------------------
# staging: the k-tile's rows as GPTQ words, from each source layout
# ---------------------------------------------------------------------------------------------------------------
@njit(cache=True, nogil=True)
def _stage_words(q, first, n0, width, buf):
    """GPTQ words as they are: ``buf.shape[0]`` rows from row ``first`` (zero past the last row: a K that is not a
    multiple of 16)."""
    rows = min(buf.shape[0], q.shape[0] - first)
    if rows < buf.shape[0]:
        buf[:, :width] = 0
    for n in range(width):  # a column's words together: one cache line of a transposed source
        for i in range(rows):
            buf[i, n] = q[first + i, n0 + n]


@njit(cache=True, nogil=True)
def _stage_permuted(q, perm, bits, kt, n0, width, buf):
    """Act-order: Marlin row k = checkpoint row perm[k], each code moved into its field of the staged words."""
    pf, mask = 32 // bits, (1 << bits) - 1
    buf[:, :width] = 0
    for dk in range(16):
        k = 16 * kt + dk
        if k >= perm.shape[0]:
            break
        src = q[perm[k] // pf]
        shift, to = bits * (perm[k] % pf), bits * (dk % pf)
        dst = buf[dk // pf]
        for n in range(width):
            dst[n] |= ((np.int64(src[n0 + n]) >> shift) & mask) << to


@njit(cache=True, nogil=True)
def _stage_awq(q, undo, bits, size_k, kt, n0, width, buf):
    """AWQ: code (k, n) is field undo[n % pf] of word (k, n // pf)."""
    pf, mask = 32 // bits, (1 << bits) - 1
    buf[:, :width] = 0
    for dk in range(16):
        k = 16 * kt + dk
        if k >= size_k:
            break
        src, to, dst = q[k], bits * (dk % pf), buf[dk // pf]
        for c in range(width // pf):
            word = np.int64(src[n0 // pf + c])
            for o in range(pf):
                dst[pf * c + o] |= ((word >> (bits * undo[o])) & mask) << to


@njit(cache=True, nogil=True)
def _tile_row(staged, width, bits, out_row):
    """staged (16/pf, >= width) GPTQ words of one k-tile -> its Marlin words out_row."""
    if bits == 4:
        _tile_row_4bit(staged, width, out_row)
    else:
        _tile_row_8bit(staged, width, out_row)


@njit(_SIGNATURES["repack"], cache=True, nogil=True)
def _repack_tiles(q, layout, perm, undo, bits, size_k, size_n, out):
    """Any weight source (``layout``, ``perm``: the module docstring's table) -> Marlin words ``out``."""
    rows = bits // 2  # staged words per column of a k-tile: 16 rows / pf
    in_place = layout == GPTQ_ROWS and perm.shape[0] == 0 and q.strides[1] == q.itemsize  # rows along N
    # a source with K along its rows (compressed-tensors, block-FP8) is staged TILES_PER_LINE k-tiles at a time: the
    # 64 bytes of a cache line of each row, read once
    group = 1 if layout == AWQ_COLUMNS or perm.shape[0] or in_place else TILES_PER_LINE
    buf = np.empty((group * rows, COLUMN_BLOCK), np.uint32)
    for n0 in range(0, size_n, COLUMN_BLOCK):
        width = min(COLUMN_BLOCK, size_n - n0)
        cols = out[:, n0 * rows: (n0 + 64 * ((width + 63) // 64)) * rows]  # Marlin columns n * 16 / pf
        for kt0 in range(0, out.shape[0], group):
            if in_place and (kt0 + 1) * rows <= q.shape[0]:
                _tile_row(q[kt0 * rows: (kt0 + 1) * rows, n0: n0 + width], width, bits, cols[kt0])
                continue
            if layout == AWQ_COLUMNS:
                _stage_awq(q, undo, bits, size_k, kt0, n0, width, buf)
            elif perm.shape[0]:
                _stage_permuted(q, perm, bits, kt0, n0, width, buf)
            else:
                _stage_words(q, kt0 * rows, n0, width, buf)
            for kt in range(kt0, min(kt0 + group, out.shape[0])):
                _tile_row(buf[(kt - kt0) * rows: (kt - kt0 + 1) * rows], width, bits, cols[kt])


# ---------------------------------------------------------------------------------------------------------------
# scales and zero points: permutations within chunks of columns, moved as bits
# ---------------------------------------------------------------------------------------------------------------
@njit(_SIGNATURES["permute"], cache=True, nogil=True)
def _permute_columns(src, per_source_column, chunk_perm, size_n, out):
    """out[g, c + d] = src[g, (c + P[d]) // per_source_column] for each chunk c of P.size columns; 0 past size_n."""
    m = chunk_perm.shape[0]
    for g in range(out.shape[0]):
        for c in range(0, out.shape[1], m):
            for d in range(m):
                col = c + chunk_perm[d]
                out[g, c + d] = src[g, col // per_source_column] if col < size_n else 0


@njit(_SIGNATURES["zero_points"], cache=True, nogil=True)
def _zero_point_words(codes, fields, perm64, bits, size_n, out):
    """Codes [ng, N] -> Marlin zero points: field j of word (g, c) is the code at column P64 of pf*c + fields[j]."""
    pf = 32 // bits
    for g in range(out.shape[0]):
        for c in range(out.shape[1]):
            acc = np.int64(0)
            for j in range(pf):
                x = pf * c + fields[j]
                col = 64 * (x // 64) + perm64[x % 64]
                if col < size_n:
                    acc |= np.int64(codes[g, col]) << (bits * j)
            out[g, c] = acc


# ---------------------------------------------------------------------------------------------------------------
# the ops' signatures (inputs checked by workbench.ops; here only what these loops rely on), plus out=
# ---------------------------------------------------------------------------------------------------------------
def _words(x, name: str) -> np.ndarray:
    """int32 / uint32 words as uint32, aligned (a tensor at an odd offset of a file is copied; a view otherwise)."""
    require_dtype(x, (np.int32, np.uint32), name)
    return np.require(x, requirements="A").view(np.uint32)


def _output(out, shape: tuple[int, ...], dtype, name: str) -> np.ndarray:
    """``out`` (checked: shape and dtype, any strides) or a fresh array."""
    if out is None:
        return np.empty(shape, dtype)
    require_shape(out, shape, name)
    require_dtype(out, (dtype,), name)
    return out


def _bits(x: np.ndarray) -> np.ndarray:
    """The unsigned integer view of same-sized elements (a permutation moves bits, whatever they mean)."""
    return x.view(f"u{x.dtype.itemsize}")


def _repack(q: np.ndarray, layout: int, perm, bits: int, size_k: int, size_n: int, out) -> np.ndarray:
    out = _output(out, marlin_qweight_shape(size_k, size_n, bits), np.int32, "out")
    perm = _NO_PERM if perm is None else np.ascontiguousarray(perm, dtype=np.int32)
    _repack_tiles(q, layout, perm, _AWQ_UNDO[bits], bits, size_k, size_n, out.view(np.uint32))
    return out


def gptq_marlin_repack(b_q_weight, perm, size_k: int, size_n: int, num_bits: int, out=None) -> np.ndarray:
    """GPTQ qweight [K/pf, N] (any strides: compressed-tensors' [N, K/pf] transposed is one) -> Marlin
    [K_pad/16, N_pad*16/pf]; with ``perm`` (int, a permutation of range(K)) Marlin row k is checkpoint row perm[k]."""
    q = _words(b_q_weight, "b_q_weight")
    require_shape(q, (size_k * num_bits // 32, size_n), "b_q_weight", "[K/pf, N]")
    return _repack(q, GPTQ_ROWS, perm, num_bits, size_k, size_n, out)


def awq_marlin_repack(b_q_weight, size_k: int, size_n: int, num_bits: int, out=None) -> np.ndarray:
    """AWQ qweight [K, N/pf] (interleaved along N) -> Marlin [K_pad/16, N_pad*16/pf]."""
    q = _words(b_q_weight, "b_q_weight")
    require_shape(q, (size_k, size_n * num_bits // 32), "b_q_weight", "[K, N/pf]")
    return _repack(q, AWQ_COLUMNS, None, num_bits, size_k, size_n, out)


def fp8_marlin_repack_raw_bits(raw_bits_k_major, size_k: int, size_n: int, out=None) -> np.ndarray:
    """K-major raw E4M3 words [K/4, N] -> Marlin W8A16 tiles: the 8-bit GPTQ repack."""
    return gptq_marlin_repack(raw_bits_k_major, None, size_k, size_n, 8, out)


def block_fp8_group128_repack(row_major, size_k: int, size_n: int, out=None) -> np.ndarray:
    """Row-major E4M3 [N, K] (uint8 or float8_e4m3fn; rows contiguous) -> Marlin [K_pad/16, 4*N_pad]: its rows'
    bytes, read as 32-bit words, are 8-bit compressed-tensors' [N, K/4], i.e. the GPTQ qweight transposed."""
    w = _fp8.as_fp8_bytes(row_major, "row_major")
    require_shape(w, (size_n, size_k), "row_major", "[N, K]")
    if not _LITTLE_ENDIAN:  # (no such host is known to run this; the reference then, copied into out)
        result = _fp8.block_fp8_group128_repack(w, size_k, size_n)
        if out is None:
            return result
        out[...] = result
        return out
    if w.strides[1] != 1 or w.strides[0] % 4 or w.ctypes.data % 4:
        w = np.array(w, order="C")  # a fresh copy: contiguous rows of K bytes, aligned
    return gptq_marlin_repack(w.view(np.uint32).T, None, size_k, size_n, 8, out)


def marlin_permute_scales(s, size_k: int, size_n: int, group_size: int, out=None) -> np.ndarray:
    """Scales [ng, N] -> Marlin order [ng, N_pad] (the same dtype; padded columns 0)."""
    s = np.asarray(s)
    require_shape(s, (num_groups(size_k, group_size), size_n), "s", "[num_groups, size_n]")
    out = _output(out, (s.shape[0], padded_n(size_n)), s.dtype, "out")
    perm = np.ascontiguousarray(scale_permutation(size_k, group_size), dtype=np.int64)
    _permute_columns(_bits(s), 1, perm, size_n, _bits(out))
    return out


def block_fp8_group128_scales(inverse_scales, size_k: int, size_n: int, act_dtype=_fp8.F16,
                              out=None) -> np.ndarray:
    """Block-FP8 inverse scales [ceil(N/128), ceil(K/128)] -> Marlin scales [ceil(K/128), N_pad] in act_dtype.

    The reference rounds ``act_dtype(float32(inv) * 2^bias)`` once per (group, column) after expanding each block
    scale over its 128 columns; every column of a block holds the same value, so rounding the block scales first
    gives the same bits, and the expansion is folded into the permutation's gather."""
    inv = np.asarray(inverse_scales)
    require_dtype(inv, (_fp8.BF16, np.float32), "inverse_scales")
    require_shape(inv, _fp8.block_scale_shape(size_k, size_n), "inverse_scales", "[ceil(N/128), ceil(K/128)]")
    act = np.dtype(act_dtype)
    with np.errstate(over="ignore"):
        folded = (inv.astype(np.float32) * np.float32(_fp8.exponent_bias(act))).astype(act)  # [N/128, K/128]
    groups = -(-size_k // _fp8.BLOCK)
    out = _output(out, (groups, padded_n(size_n)), act, "out")
    perm = np.ascontiguousarray(scale_permutation(size_k, _fp8.BLOCK), dtype=np.int64)
    _permute_columns(_bits(folded).T, _fp8.BLOCK, perm, size_n, _bits(out))
    return out


def marlin_zero_points(zp, size_k: int, size_n: int, num_bits: int, out=None) -> np.ndarray:
    """Zero-point codes [ng, N] (each in [0, 2^bits)) -> Marlin zero points int32 [ng, N_pad/pf]."""
    zp = np.asarray(zp)
    require(zp.ndim == 2 and zp.shape[1] == size_n, f"zp has shape {zp.shape}, expected [num_groups, {size_n}]")
    out = _output(out, (zp.shape[0], padded_n(size_n) * num_bits // 32), np.int32, "out")
    codes = zp if zp.dtype == np.uint8 else zp.astype(np.uint8)  # (the ops checked every code fits num_bits)
    _zero_point_words(codes, _FIELDS[num_bits], _P64, num_bits, size_n, out.view(np.uint32))
    return out


def awq_to_marlin_zero_points(q_zp_packed, size_k: int, size_n: int, num_bits: int, out=None) -> np.ndarray:
    """AWQ qzeros int32 [ng, N/pf] (interleaved) -> Marlin zero points int32 [ng, N_pad/pf]."""
    codes = _packing.awq_unpack(np.asarray(q_zp_packed), num_bits)  # [ng, N]: 1/128 of the weights' bytes at g128
    return marlin_zero_points(codes, size_k, size_n, num_bits, out)


# op name -> function here, for workbench.backends (backend="cpu"); every other op runs its NumPy reference there
OPS = {f.__name__: f for f in (gptq_marlin_repack, awq_marlin_repack, fp8_marlin_repack_raw_bits,
                               block_fp8_group128_repack, marlin_permute_scales, block_fp8_group128_scales,
                               marlin_zero_points, awq_to_marlin_zero_points)}
