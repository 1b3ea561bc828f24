"""GPTQ zero points and act-order (docs/formats.md, "GPTQ qzeros", "Marlin zero points" and "Act-order").

GPTQ ``qzeros [K/G, N/pf]`` are column-packed in identity order. AutoGPTQ's v1 format ("gptq") stores
``zero - 1``; "gptq_v2" stores the zero itself. Consequences of v1: a symmetric 4-bit checkpoint stores 7 in every
field (``0x77777777``); a stored all-ones field (15 / 255) would mean a zero of 16 / 256, which does not fit, and is an
error.

Note on ferrum-kernels (docs/formats.md, "GPTQ qzeros"): its ``repack_gptq_qzeros_to_marlin`` adds 1 to every field
and keeps the checkpoint's column layout. The Marlin kernels read zero points in the P64-permuted, interleaved layout
of ``marlin_zero_points`` (docs/formats.md, "Marlin zero points"), so here the layout-preserving step is
``gptq_v1_qzeros_to_v2`` and ``repack_gptq_qzeros_to_marlin`` continues to the kernel layout. For constant qzeros
(``0x88888888`` -> ``0x99999999``) the two agree.

GPTQ v2 qzeros already hold the zero points: ``marlin_zero_points(unpack_cols(qzeros))`` is their whole conversion.
"""
from __future__ import annotations

import numpy as np

from workbench.formats._checks import (check_bits, require, require_dtype, require_ndim, require_shape,
                                       v1_all_ones_message)
from workbench.formats.packing import pack_cols, pack_factor, unpack_cols
from workbench.formats.scales import check_group_size, num_groups, zero_points_to_marlin


def symmetric_stored_word(bits: int = 4) -> int:
    """The v1 qzeros word of a symmetric checkpoint: every field = 2^(b-1) - 1 (0x77777777 / 0x7F7F7F7F)."""
    pf = pack_factor(bits)
    field = (1 << (bits - 1)) - 1
    return sum(field << (bits * j) for j in range(pf))


def gptq_qzeros_are_symmetric_code7(qzeros: np.ndarray, bits: int = 4) -> bool:
    """True when every v1 stored zero is 2^(b-1) - 1 (zero point 8 / 128): the symmetric u4b8 / u8b128 case.

    An empty tensor is not symmetric (there is nothing to say it is; docs/formats.md, "GPTQ qzeros").
    """
    q = np.asarray(qzeros)
    require_dtype(q, (np.int32, np.uint32), "qzeros")
    return q.size > 0 and bool(np.all(q.view(np.uint32) == np.uint32(symmetric_stored_word(bits))))


def check_qzeros(qzeros, size_k: int, size_n: int, group_size: int, bits: int) -> np.ndarray:
    check_bits(bits)
    check_group_size(size_k, group_size)
    qzeros = np.asarray(qzeros)
    require_dtype(qzeros, (np.int32, np.uint32), "qzeros")
    pf = pack_factor(bits)
    require(size_n % pf == 0, f"size_n = {size_n} must be divisible by {pf} for {bits}-bit qzeros")
    require_shape(qzeros, (num_groups(size_k, group_size), size_n // pf), "qzeros",
                  f"[K/G, N/{pf}] for K = {size_k}, N = {size_n}, group_size = {group_size}")
    return qzeros


def gptq_v1_zero_points(qzeros: np.ndarray, bits: int = 4) -> np.ndarray:
    """v1 qzeros [ng, N/pf] -> actual zero points [ng, N] uint8 (stored + 1).

    Raises ValueError naming group, packed column and lane for a stored all-ones field.
    """
    check_bits(bits)
    qzeros = np.asarray(qzeros)
    require_ndim(qzeros, 2, "qzeros")
    stored = unpack_cols(qzeros, bits)
    bad = np.argwhere(stored == (1 << bits) - 1)
    if bad.size:
        group, col = (int(v) for v in bad[0])
        raise ValueError(v1_all_ones_message(f"group={group}", col, bits, len(bad)))
    return stored + np.uint8(1)


def gptq_v1_qzeros_to_v2(qzeros: np.ndarray, bits: int = 4) -> np.ndarray:
    """Add 1 to every field, keeping the checkpoint's column layout (int32 [ng, N/pf]): ferrum-kernels' whole
    conversion (docs/formats.md, "GPTQ qzeros")."""
    return pack_cols(gptq_v1_zero_points(qzeros, bits), bits)


def repack_gptq_qzeros_to_marlin(qzeros, size_k: int, size_n: int, group_size: int, bits: int = 4) -> np.ndarray:
    """GPTQ v1 qzeros [K/G, N/pf] -> Marlin zero points int32 [K/G, N/pf] (zero = stored + 1, kernel layout)."""
    qzeros = check_qzeros(qzeros, size_k, size_n, group_size, bits)
    return zero_points_to_marlin(gptq_v1_zero_points(qzeros, bits), size_k, size_n, bits)


def sort_g_idx(g_idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Act-order: (g_idx_sorted, perm) with perm = stable argsort(g_idx) (docs/formats.md, "Act-order").

    Any within-group order works as long as weights and activations use the same perm; stable keeps it reproducible.
    """
    g_idx = np.asarray(g_idx)
    require_ndim(g_idx, 1, "g_idx")
    if not np.issubdtype(g_idx.dtype, np.integer):
        raise TypeError(f"g_idx must be an integer array, got dtype {g_idx.dtype}")
    perm = np.argsort(g_idx, kind="stable").astype(np.int32)
    return g_idx[perm].astype(np.int32), perm
