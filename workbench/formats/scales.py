"""Marlin scale permutations and zero points (docs/formats.md, "Scale permutation" and "Marlin zero points").

Both permutations act on the flattened ``[ng, N]`` tensor in independent chunks, ``out[d] = in[P[d]]``:

* ``SCALE_PERM_64`` — the transpose of an 8×8 block. Grouped scales are applied to B fragments before every MMA;
  a lane reads 8 consecutive halves at ``8*(lane//4)`` and after P64 those are columns ``lane//4 + 8j`` (j = 0..7):
  exactly the columns it owns in the four 16-wide sub-blocks of a tile.
* ``SCALE_PERM_32`` — the transpose of a 4×4 block of column *pairs*. Channelwise scales are applied once to the
  fp32 accumulators in the epilogue, where a lane owns column pairs ``2(lane%4) + {0,1}`` of each 8-column block.

P64 is used iff ``group_size != -1 and group_size < K`` (more than one group); otherwise P32.

Shapes that are not tile multiples (docs/formats.md, "Shapes that are not tile multiples"): there are
``ceil(K / group_size)`` groups, the last one covering the remaining rows; the Marlin tensors have N_pad =
ceil(N / 64) * 64 columns, the padded ones zero (scale 0, zero point 0), permuted with the rest.
Zero points always use P64 (they are applied on every MMA, in B-fragment layout), then the same field interleave as
the weights, then column packing.
"""
from __future__ import annotations

import numpy as np

from workbench.formats._checks import (check_bits, check_int, check_size, padded_n, require, require_ndim,
                                       require_shape)
from workbench.formats.marlin_tile import FIELD_INTERLEAVE
from workbench.formats.packing import pack_cols, pack_factor, unpack_cols

_d64 = np.arange(64)
SCALE_PERM_64 = _d64 // 8 + 8 * (_d64 % 8)  # transpose of an 8×8 block
_d32 = np.arange(32)
SCALE_PERM_32 = 2 * (_d32 // 8) + np.array([0, 1, 8, 9, 16, 17, 24, 25])[_d32 % 8]  # 4×4 block of pairs
for _p in (SCALE_PERM_64, SCALE_PERM_32):
    _p.setflags(write=False)


def uses_grouped_permutation(size_k: int, group_size: int) -> bool:
    """True when scales need P64 (several groups along K), False for P32 (one group: channelwise)."""
    return group_size != -1 and group_size < size_k


def num_groups(size_k: int, group_size: int) -> int:
    """ceil(K / group_size): a K that group_size does not divide ends in a partial group."""
    return 1 if group_size == -1 else -(-size_k // group_size)


def check_group_size(size_k: int, group_size: int) -> int:
    """-> group_size as an int: -1 (channelwise) or positive (a divisor of size_k, or the last group partial)."""
    group_size = check_int(group_size, "group_size")
    require(group_size == -1 or group_size > 0, f"group_size = {group_size} must be -1 (channelwise) or positive")
    return group_size


def pad_columns(x: np.ndarray, size_n: int) -> np.ndarray:
    """[R, N] -> [R, N_pad] with zero columns appended (the same array when N is a multiple of 64)."""
    x = np.asarray(x)
    if padded_n(size_n) == size_n:
        return x
    out = np.zeros((x.shape[0], padded_n(size_n)), dtype=x.dtype)
    out[:, :size_n] = x
    return out


def _apply_chunk_perm(flat_rows: np.ndarray, perm: np.ndarray) -> np.ndarray:
    shape = flat_rows.shape
    return np.ascontiguousarray(flat_rows.reshape(-1, perm.size)[:, perm]).reshape(shape)


def scale_permutation(size_k: int, group_size: int) -> np.ndarray:
    return SCALE_PERM_64 if uses_grouped_permutation(size_k, group_size) else SCALE_PERM_32


def _check_scales(s, size_k: int, size_n: int, group_size: int, columns: int, name: str = "s") -> np.ndarray:
    s = np.asarray(s)
    check_group_size(size_k, group_size)
    check_size(size_n, "size_n")
    require_ndim(s, 2, name)
    require_shape(s, (num_groups(size_k, group_size), columns), name, f"[num_groups, {'N_pad' if columns != size_n else 'size_n'}] "
                  f"for size_k = {size_k}, size_n = {size_n}, group_size = {group_size}")
    return s


def permute_scales(s: np.ndarray, size_k: int, size_n: int, group_size: int) -> np.ndarray:
    """Checkpoint scales [ng, N] -> Marlin order [ng, N_pad] (same dtype; padded columns 0)."""
    s = _check_scales(s, size_k, size_n, group_size, size_n)
    return _apply_chunk_perm(pad_columns(s, size_n), scale_permutation(size_k, group_size))


def unpermute_scales(s: np.ndarray, size_k: int, size_n: int, group_size: int) -> np.ndarray:
    """Inverse of permute_scales: Marlin [ng, N_pad] -> [ng, N]."""
    s = _check_scales(s, size_k, size_n, group_size, padded_n(size_n))
    return np.ascontiguousarray(_apply_chunk_perm(s, np.argsort(scale_permutation(size_k, group_size)))[:, :size_n])


def zero_points_to_marlin(zp: np.ndarray, size_k: int, size_n: int, num_bits: int) -> np.ndarray:
    """Zero-point codes [ng, N] (uint8) -> Marlin packed zero points int32 [ng, N_pad/pf] (padded codes 0)."""
    check_bits(num_bits)
    zp = np.asarray(zp)
    require_ndim(zp, 2, "zp")
    check_size(size_n, "size_n")
    require(zp.shape[1] == size_n, f"zp has shape {zp.shape}, expected {size_n} columns (size_n)")
    pf = pack_factor(num_bits)
    permuted = _apply_chunk_perm(pad_columns(zp, size_n), SCALE_PERM_64)
    interleaved = _apply_chunk_perm(permuted, FIELD_INTERLEAVE[num_bits])
    return pack_cols(interleaved, num_bits).reshape(zp.shape[0], padded_n(size_n) // pf)


def marlin_zero_points_to_padded_codes(zp_packed: np.ndarray, size_n: int, num_bits: int) -> np.ndarray:
    """Marlin zero points int32 [ng, N_pad/pf] -> every code [ng, N_pad], padding included."""
    check_bits(num_bits)
    check_size(size_n, "size_n")
    require_shape(zp_packed, (np.asarray(zp_packed).shape[0], padded_n(size_n) // pack_factor(num_bits)),
                  "zp_packed", f"[num_groups, N_pad / {pack_factor(num_bits)}] for size_n = {size_n}")
    codes = unpack_cols(zp_packed, num_bits)
    codes = _apply_chunk_perm(codes, np.argsort(FIELD_INTERLEAVE[num_bits]))
    return _apply_chunk_perm(codes, np.argsort(SCALE_PERM_64))


def marlin_zero_points_to_codes(zp_packed: np.ndarray, size_n: int, num_bits: int) -> np.ndarray:
    """Inverse of zero_points_to_marlin: int32 [ng, N_pad/pf] -> codes [ng, N]."""
    return np.ascontiguousarray(marlin_zero_points_to_padded_codes(zp_packed, size_n, num_bits)[:, :size_n])
