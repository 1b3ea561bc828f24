"""The Marlin weight tile as named index maps, and the repack reference built from them (docs/formats.md,
"The Marlin tile").

The K×N weight is cut into 16(k)×64(n) tiles, ordered k-tile-major. One tile is 1024 codes = ``wpt`` words
(128 for 4-bit, 256 for 8-bit). Marlin's 1024-entry permutation merges four separate facts; here each is a map:

1. **Tensor-core fragment ownership** — ``mma_b_fragment(lane, e) -> (dk, dn)``. In ``mma.m16n8k16`` the B operand
   is a 16×8 block; lane ``t`` of the warp holds 4 of its elements: column ``t // 4``, rows ``2(t % 4) + {0, 1}``
   and ``2(t % 4) + 8 + {0, 1}`` (PTX ISA, "Matrix Fragments for mma.m16n8k16", B fragment)::

         n:  0 1 2 3 4 5 6 7          element e of lane t:
       k 0   0 4 8 ...                    dk = 2*(t%4) + (e%2) + 8*(e//2)
         1   0 4 8 ...                    dn = t//4
         2   1 5 9 ...
         ...
         8   0 4 8 ...    (e = 2, 3)

2. **Four 16×16 sub-blocks per tile** — ``subblock_column(warp, half) = 16*warp + 8*half``. Each 16×64 tile is four
   16×16 sub-blocks (the inner loop's ``warp`` index) and each sub-block two 16×8 B fragments (``half``).
   One 4-bit word carries both halves of one sub-block for one lane; an 8-bit word carries one half.

3. **Which word a lane reads** — ``word_in_tile(lane, slot)``: all of a lane's words for the tile are consecutive
   (``4*lane + warp`` for 4-bit, ``8*lane + 2*warp + half`` for 8-bit), so one 16-byte (4-bit) or two 16-byte
   (8-bit) loads bring a lane everything it needs for the whole tile.

4. **The field interleave** — ``FIELD_INTERLEAVE[bits][j]`` = which of the word's natural elements sits in field j.
   Natural order is (half, e); the interleave ``[0,2,4,6,1,3,5,7]`` (4-bit) / ``[0,2,1,3]`` (8-bit) puts the two
   rows (k, k+1) of one column 16 bits apart, so a dequantizer turns *pairs* of codes into a ``half2`` with one
   mask-and-or (``lop3``) and a shift (docs/formats.md, "Nibble interleave").

Composing the four gives the closed form (docs/formats.md, "Closed form and the 1024-entry permutation"), which
``marlin_word_field_to_kn`` evaluates.
"""
from __future__ import annotations

import functools

import numpy as np

from workbench.formats._checks import (TILE_K, TILE_N, check_bits, check_permutation_values, check_tile_sizes,
                                       check_weight_sizes,
                                       padded_k, padded_n, require, require_dtype, require_ndim, require_shape)
from workbench.formats.packing import _check_codes, _pack_last_axis, _unpack_last_axis, pack_factor

# TILE_K = 16 rows (the k extent of one mma.m16n8k16), TILE_N = 64 columns (four 16-wide sub-blocks, one per
# inner-loop step): defined with the shape checks in _checks, which every layer imports
TILE_ELEMS = TILE_K * TILE_N  # 1024
LANES = 32  # one warp

# Map 4: field j of a word holds natural element FIELD_INTERLEAVE[bits][j].
FIELD_INTERLEAVE = {4: np.array([0, 2, 4, 6, 1, 3, 5, 7]), 8: np.array([0, 2, 1, 3])}


def words_per_tile(bits: int) -> int:
    return TILE_ELEMS // pack_factor(bits)


def words_per_lane(bits: int) -> int:
    """Words one lane reads per tile: 4 (4-bit, one per sub-block) or 8 (8-bit, one per 16×8 fragment)."""
    return words_per_tile(bits) // LANES


# ---------------------------------------------------------------------------------------------------------------
# Map 1: tensor-core B fragment ownership (16×8 block)
# ---------------------------------------------------------------------------------------------------------------
def mma_b_fragment(lane, e):
    """(lane, element e in 0..3) -> (dk, dn) inside a 16×8 mma.m16n8k16 B fragment. Vectorized."""
    lane = np.asarray(lane)
    e = np.asarray(e)
    return 2 * (lane % 4) + (e % 2) + 8 * (e // 2), lane // 4


def mma_b_fragment_owner(dk, dn):
    """Inverse of mma_b_fragment: (dk in 0..15, dn in 0..7) -> (lane, e)."""
    dk = np.asarray(dk)
    dn = np.asarray(dn)
    return 4 * dn + (dk % 8) // 2, (dk % 2) + 2 * (dk // 8)


# ---------------------------------------------------------------------------------------------------------------
# Map 2: sub-blocks and fragment halves inside a 16×64 tile
# ---------------------------------------------------------------------------------------------------------------
def subblock_column(warp, half):
    """First column of fragment ``half`` (0/1) of sub-block ``warp`` (0..3) inside a tile."""
    return 16 * np.asarray(warp) + 8 * np.asarray(half)


# ---------------------------------------------------------------------------------------------------------------
# Map 3: a lane's word slots, and the natural elements inside a word
# ---------------------------------------------------------------------------------------------------------------
def slot_element_to_fragment(slot, element, bits: int):
    """(slot in 0..words_per_lane-1, natural element of the word) -> (warp, half, e)."""
    slot = np.asarray(slot)
    element = np.asarray(element)
    if check_bits(bits) == 4:  # one word per sub-block: elements (half, e) = divmod(element, 4)
        return slot, element // 4, element % 4
    return slot // 2, slot % 2, element  # one word per 16×8 fragment


def fragment_to_slot_element(warp, half, e, bits: int):
    """Inverse of slot_element_to_fragment."""
    warp, half, e = (np.asarray(v) for v in (warp, half, e))
    if check_bits(bits) == 4:
        return warp, 4 * half + e
    return 2 * warp + half, e


# ---------------------------------------------------------------------------------------------------------------
# Composition: Marlin (word, field) <-> matrix (k, n)
# ---------------------------------------------------------------------------------------------------------------
def marlin_word_field_to_kn(word, field, size_n: int, bits: int):
    """Flat Marlin word index and field -> (k, n) of the code it holds (rows in Marlin order). Vectorized."""
    check_bits(bits)
    word = np.asarray(word, dtype=np.int64)
    field = np.asarray(field, dtype=np.int64)
    tile, wit = np.divmod(word, words_per_tile(bits))
    k_tile, n_tile = np.divmod(tile, padded_n(size_n) // TILE_N)
    lane, slot = np.divmod(wit, words_per_lane(bits))
    warp, half, e = slot_element_to_fragment(slot, FIELD_INTERLEAVE[bits][field], bits)
    dk, dn = mma_b_fragment(lane, e)
    return TILE_K * k_tile + dk, TILE_N * n_tile + subblock_column(warp, half) + dn


def marlin_kn_to_word_field(k, n, size_n: int, bits: int):
    """Inverse of marlin_word_field_to_kn: (k, n) -> (flat word index, field). Vectorized."""
    check_bits(bits)
    k = np.asarray(k, dtype=np.int64)
    n = np.asarray(n, dtype=np.int64)
    k_tile, dk = np.divmod(k, TILE_K)
    n_tile, nn = np.divmod(n, TILE_N)
    warp, rest = np.divmod(nn, 16)
    half, dn = np.divmod(rest, 8)
    lane, e = mma_b_fragment_owner(dk, dn)
    slot, element = fragment_to_slot_element(warp, half, e, bits)
    field = np.argsort(FIELD_INTERLEAVE[bits])[element]
    word = (k_tile * (padded_n(size_n) // TILE_N) + n_tile) * words_per_tile(bits) + lane * words_per_lane(bits) + slot
    return word, field


def describe_position(k: int, n: int, size_n: int, bits: int) -> dict:
    """Every named coordinate of element (k, n) on its way into a Marlin word (for errors and pictures)."""
    word, field = marlin_kn_to_word_field(k, n, size_n, bits)
    k_tile, dk = divmod(int(k), TILE_K)
    n_tile, nn = divmod(int(n), TILE_N)
    warp, rest = divmod(nn, 16)
    half, dn = divmod(rest, 8)
    lane, e = mma_b_fragment_owner(dk, dn)
    return {
        "k": int(k), "n": int(n), "k_tile": k_tile, "n_tile": n_tile,
        "tile": k_tile * (padded_n(size_n) // TILE_N) + n_tile, "subblock": warp, "half": half,
        "lane": int(lane), "fragment_element": int(e), "word": int(word), "field": int(field),
        "row": int(word) // (padded_n(size_n) * TILE_K // pack_factor(bits)),
        "column": int(word) % (padded_n(size_n) * TILE_K // pack_factor(bits)),
    }


@functools.lru_cache(maxsize=None)
def tile_permutation(bits: int) -> np.ndarray:
    """(1024,) int: packed position ``p = word_in_tile*pf + field`` takes tile element ``dk*64 + dn``.

    Derived from the maps above; equals vLLM's ``get_weight_perm`` re-expressed on row-major tiles.
    """
    p = np.arange(TILE_ELEMS)
    wit, field = np.divmod(p, pack_factor(bits))
    k, n = marlin_word_field_to_kn(wit, field, TILE_N, bits)
    perm = k * TILE_N + n
    perm.setflags(write=False)
    return perm


# ---------------------------------------------------------------------------------------------------------------
# Repack reference
# ---------------------------------------------------------------------------------------------------------------
def check_perm(perm, size_k: int) -> np.ndarray | None:
    """None/empty -> None; else a validated int array that is a permutation of range(size_k)."""
    if perm is None:
        return None
    perm = np.asarray(perm)
    if perm.size == 0:
        return None
    require_ndim(perm, 1, "perm")
    if not np.issubdtype(perm.dtype, np.integer):
        raise TypeError(f"perm must be an integer array, got dtype {perm.dtype}")
    require(perm.shape[0] == size_k, f"perm has length {perm.shape[0]}, expected size_k = {size_k}")
    check_permutation_values(perm, size_k)
    return perm


def _check_tile_shape(size_k: int, size_n: int) -> tuple[int, int]:
    """Whole 16×64 tiles (what the pictures of workbench.render draw); the repacks take any size (_check_sizes)."""
    return check_tile_sizes(size_k, size_n)


def _check_sizes(size_k: int, size_n: int) -> tuple[int, int]:
    return check_weight_sizes(size_k, size_n)


def marlin_qweight_shape(size_k: int, size_n: int, bits: int) -> tuple[int, int]:
    """Shape of the Marlin qweight of a (size_k, size_n) weight: (K_pad / 16, N_pad * 16 / pf), the weight
    zero-padded to whole tiles (docs/formats.md, "Shapes that are not tile multiples")."""
    return padded_k(size_k) // TILE_K, padded_n(size_n) * TILE_K // pack_factor(bits)


def pad_to_tiles(codes: np.ndarray) -> np.ndarray:
    """codes (K, N) -> (K_pad, N_pad) with zero codes in the padding (the same array when already whole tiles)."""
    size_k, size_n = codes.shape
    if (size_k, size_n) == (padded_k(size_k), padded_n(size_n)):
        return codes
    out = np.zeros((padded_k(size_k), padded_n(size_n)), dtype=codes.dtype)
    out[:size_k, :size_n] = codes
    return out


# The four maps as array axes. Split k and n of a tile the way the maps split them:
#     k = 16*k_tile + 8*e_hi + 2*row2 + e_lo      (fragment element e = 2*e_hi + e_lo; lane = 4*col + row2)
#     n = 64*n_tile + 16*warp + 8*half + col
# Marlin order is then (k_tile, n_tile, col, row2, warp, half, e_hi, e_lo): one transpose. For 4-bit a word is the
# last three axes (natural element 4*half + e), for 8-bit the last two (natural element e); the field interleave is
# applied while packing. test_marlin_tile checks this equals the map-derived tile_permutation for every element.
_SPLIT_AXES = ("k_tile", "e_hi", "row2", "e_lo", "n_tile", "warp", "half", "col")
_MARLIN_AXES = ("k_tile", "n_tile", "col", "row2", "warp", "half", "e_hi", "e_lo")
_TO_MARLIN = tuple(_SPLIT_AXES.index(a) for a in _MARLIN_AXES)
_FROM_MARLIN = tuple(int(i) for i in np.argsort(_TO_MARLIN))
_ELEMENT_AXES = {4: 3, 8: 2}  # trailing Marlin axes that index the elements of one word


def _split_shape(size_k: int, size_n: int) -> tuple[int, ...]:
    return (padded_k(size_k) // TILE_K, 2, 4, 2, padded_n(size_n) // TILE_N, 4, 2, 8)


def marlin_repack_codes(codes: np.ndarray, bits: int, perm=None) -> np.ndarray:
    """codes (K, N) -> Marlin qweight int32 (K_pad/16, N_pad*16/pf). With ``perm``, Marlin row k is checkpoint row
    perm[k]. Rows and columns past K and N (up to the next 16 / 64) hold zero codes."""
    codes = _check_codes(codes, bits, "codes")
    size_k, size_n = codes.shape
    _check_sizes(size_k, size_n)
    perm = check_perm(perm, size_k)
    if perm is not None:
        codes = codes[perm]
    codes = pad_to_tiles(codes)
    split = codes.reshape(_split_shape(size_k, size_n)).transpose(_TO_MARLIN)  # a view, Marlin axis order
    words = np.zeros(split.shape[:8 - _ELEMENT_AXES[bits]], dtype=np.uint32)
    for field, element in enumerate(FIELD_INTERLEAVE[bits]):
        # natural element -> its index on the trailing element axes ((half, e_hi, e_lo) or (e_hi, e_lo))
        index = np.unravel_index(element, split.shape[8 - _ELEMENT_AXES[bits]:])
        words |= split[(Ellipsis,) + tuple(int(i) for i in index)].astype(np.uint32) << np.uint32(field * bits)
    return words.view(np.int32).reshape(marlin_qweight_shape(size_k, size_n, bits))


def marlin_unpack_padded_codes(qweight: np.ndarray, size_k: int, size_n: int, bits: int) -> np.ndarray:
    """Marlin qweight -> all (K_pad, N_pad) codes in Marlin row order, padding included."""
    check_bits(bits)
    size_k, size_n = _check_sizes(size_k, size_n)
    require_dtype(qweight, (np.int32, np.uint32), "qweight")
    require_shape(qweight, marlin_qweight_shape(size_k, size_n, bits), "qweight",
                  f"K_pad/16, N_pad*16/pf for {bits}-bit, K = {size_k}, N = {size_n}")
    fields = _unpack_last_axis(np.asarray(qweight).reshape(-1), bits)
    natural = np.empty_like(fields)
    natural[:, FIELD_INTERLEAVE[bits]] = fields
    split = natural.reshape(tuple(_split_shape(size_k, size_n)[i] for i in _TO_MARLIN))
    return np.ascontiguousarray(split.transpose(_FROM_MARLIN)).reshape(padded_k(size_k), padded_n(size_n))


def marlin_unpack_codes(qweight: np.ndarray, size_k: int, size_n: int, bits: int) -> np.ndarray:
    """Inverse of marlin_repack_codes (without perm): Marlin qweight -> codes (K, N) in Marlin row order (the
    padding dropped; ``nonzero_padding`` says whether it held anything)."""
    codes = marlin_unpack_padded_codes(qweight, size_k, size_n, bits)
    return np.ascontiguousarray(codes[:size_k, :size_n])


def nonzero_padding(padded: np.ndarray, size_k: int, size_n: int) -> tuple[int, tuple[int, int] | None]:
    """(count, first (row, column)) of nonzero values of a padded (K_pad, N_pad) array outside (size_k, size_n):
    the rule keeps every padded element zero, so a converter's slip shows here."""
    bad = np.asarray(padded) != 0
    bad[:size_k, :size_n] = False
    if not bad.any():
        return 0, None
    first = np.argwhere(bad)[0]
    return int(bad.sum()), (int(first[0]), int(first[1]))
