"""FP8 E4M3 weight-only (W8A16) formats (docs/formats.md, "FP8 E4M3 weight-only" and "Block FP8").

E4M3 bytes are 8-bit codes: the Marlin tile layout is the 8-bit one. What is special is the scale.

**Why the scales carry 2^8 (fp16) or 2^120 (bf16).** The kernel turns an E4M3 byte into a half by moving bits: sign to
bit 15, the 7 exponent+mantissa bits to bits 13..7 (bf16: 10..4). The exponent field is copied as is, but E4M3's
exponent bias is 7 while fp16's is 15 (bf16: 127), so the result is the true value times 2^-8 (2^-120) — normals
and subnormals alike. Instead of a multiply per element, the correction is folded once into the scales.

**Block FP8** (DeepSeek-style ``weight_block_size = [128, 128]``): ``weight`` is row-major ``[N, K]`` E4M3 and
``weight_scale_inv [ceil(N/128), ceil(K/128)]`` (bf16 or float32) is the dequantization scale of each 128×128
block; blocks at the N and K edges may be partial. The Marlin scales have one group per 128 rows of K (the last one
partial) and N_pad = ceil(N/64)*64 columns, the padded ones 0 (docs/formats.md, "Shapes that are not tile
multiples").
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from workbench.formats._checks import (check_size, padded_n, require, require_dtype, require_ndim,
                                       require_pack_multiple, require_shape)
from workbench.formats.marlin_tile import TILE_K, TILE_N, marlin_repack_codes, marlin_unpack_codes
from workbench.formats.packing import pack_rows, unpack_rows
from workbench.formats.scales import SCALE_PERM_32, SCALE_PERM_64, permute_scales

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
E4M3_MAX = 448.0  # largest finite E4M3FN value
BLOCK = 128  # block-FP8 block edge (weight_block_size = [128, 128])

# factor the kernel's bit-move loses: 2^(bias(target) - bias(e4m3)) = 2^(2^(e_t - 1) - 2^(4 - 1))
FP8_EXPONENT_BIAS = {F16: 2.0**8, BF16: 2.0**120}


def exponent_bias(act_dtype) -> float:
    dt = np.dtype(act_dtype)
    if dt not in FP8_EXPONENT_BIAS:
        raise TypeError(f"activation dtype must be float16 or bfloat16, got {dt}")
    return FP8_EXPONENT_BIAS[dt]


def e4m3_to_float32(raw: np.ndarray) -> np.ndarray:
    """E4M3FN bytes (uint8) -> float32 values (0x7F / 0xFF are NaN)."""
    raw = np.asarray(raw)
    require_dtype(raw, (np.uint8, E4M3), "raw E4M3 bytes")
    return np.ascontiguousarray(raw).view(E4M3).astype(np.float32)


def float_to_e4m3(x: np.ndarray) -> np.ndarray:
    """float -> E4M3FN bytes (uint8), round to nearest even, saturating at ±448 (no NaN from overflow)."""
    clipped = np.clip(np.asarray(x, dtype=np.float32), -E4M3_MAX, E4M3_MAX)
    return clipped.astype(E4M3).view(np.uint8)


def kernel_bit_move_f16(raw: np.ndarray) -> np.ndarray:
    """What the kernel computes before scaling: fp16 bits ``(b & 0x80) << 8 | (b & 0x7F) << 7`` (= value * 2^-8)."""
    b = np.asarray(raw, dtype=np.uint16)
    return (((b & 0x80) << 8) | ((b & 0x7F) << 7)).astype(np.uint16).view(np.float16)


def as_fp8_bytes(w, name: str = "weight") -> np.ndarray:
    w = np.asarray(w)
    require_dtype(w, (np.uint8, E4M3), name)
    return w.view(np.uint8)


def pack_fp8_to_int32(row_major: np.ndarray) -> np.ndarray:
    """Row-major E4M3 [N, K] -> K-major raw words int32 [K/4, N] (byte j of word (r, n) = w[n, 4r + j])."""
    w = as_fp8_bytes(row_major)
    require_ndim(w, 2, "weight")
    return pack_rows(np.ascontiguousarray(w.T), 8)


def fp8_marlin_repack_raw_bits(raw_bits_k_major: np.ndarray, size_k: int, size_n: int) -> np.ndarray:
    """K-major raw E4M3 words [K/4, N] -> Marlin W8A16 tiles int32 [K_pad/16, 4*N_pad]: the 8-bit GPTQ repack."""
    return marlin_repack_codes(unpack_rows(raw_bits_k_major, 8), 8)


def block_fp8_group128_repack(row_major: np.ndarray, size_k: int, size_n: int) -> np.ndarray:
    """Row-major E4M3 [N, K] -> Marlin tiles int32 [K_pad/16, 4*N_pad], the transpose fused into the tiling.

    Gate and up projections are fused by concatenating their [N, K] matrices along N before this call.
    """
    w = as_fp8_bytes(row_major)
    return marlin_repack_codes(np.ascontiguousarray(w.T), 8)


def block_fp8_word_sources(word, size_k: int, size_n: int) -> np.ndarray:
    """Direct gather: Marlin word -> the 4 flat indices of ``row_major.ravel()`` it holds (low byte first).

    Vectorized over ``word``; returns shape (..., 4); -1 for a byte of the zero padding (k >= K or n >= N). This
    is the formula a kernel evaluates per output word (docs/formats.md, "FP8 E4M3 weight-only").
    """
    word = np.asarray(word, dtype=np.int64)
    tile, word_in_tile = np.divmod(word, 256)
    k_tile, n_tile = np.divmod(tile, padded_n(size_n) // TILE_N)
    lane, slot = np.divmod(word_in_tile, 8)
    warp, half = np.divmod(slot, 2)
    n = n_tile * 64 + warp * 16 + lane // 4 + half * 8
    k = k_tile * TILE_K + (lane % 4) * 2
    ks = np.stack([k, k + 8, k + 1, k + 9], axis=-1)
    n = n[..., None]
    return np.where((ks < size_k) & (n < size_n), n * size_k + ks, -1)


def block_fp8_scale_sources(destination, size_k: int, size_n: int) -> np.ndarray:
    """Scale gather: Marlin scale index over [ceil(K/128), N_pad] -> flat index into inverse_scales
    [ceil(N/128), ceil(K/128)], or -1 for a padded column (its scale is 0).

    The formula a kernel evaluates per destination scale (docs/formats.md, "Block FP8").
    """
    destination = np.asarray(destination, dtype=np.int64)
    groups = -(-size_k // BLOCK)
    perm = SCALE_PERM_32 if groups == 1 else SCALE_PERM_64
    lane = destination % perm.size
    logical = destination - lane + perm[lane]
    group, out = np.divmod(logical, padded_n(size_n))
    return np.where(out < size_n, (out // BLOCK) * groups + group, -1)


def check_block_fp8_shapes(size_k: int, size_n: int) -> tuple[int, int]:
    """-> (size_k, size_n) as ints: positive, K a multiple of 4 (the 8-bit pack factor: the FP8 Marlin path moves
    K-major words of 4 bytes, as fp8_marlin_repack_raw_bits' [K/4, N] input does); the 128-blocks may be partial at
    both edges."""
    size_k, size_n = check_size(size_k, "size_k"), check_size(size_n, "size_n")
    require_pack_multiple(size_k, 4, "size_k", "FP8 bytes are moved as K-major 32-bit words")
    return size_k, size_n


def block_scale_shape(size_k: int, size_n: int) -> tuple[int, int]:
    """[ceil(N/128), ceil(K/128)]: one inverse scale per (possibly partial) 128×128 block."""
    return -(-size_n // BLOCK), -(-size_k // BLOCK)


def expand_block_scales(inverse_scales: np.ndarray, size_k: int, size_n: int) -> np.ndarray:
    """[ceil(N/128), ceil(K/128)] block scales -> float32 [ceil(K/128), N] per-(group, column) scales."""
    inv = np.asarray(inverse_scales)
    require_dtype(inv, (BF16, np.float32), "inverse_scales")
    require_shape(inv, block_scale_shape(size_k, size_n), "inverse_scales",
                  f"[ceil(N/128), ceil(K/128)] for K = {size_k}, N = {size_n}")
    return np.repeat(inv.astype(np.float32).T, BLOCK, axis=1)[:, :size_n]


def marlin_fp8_scales(scales: np.ndarray, size_k: int, size_n: int, group_size: int, act_dtype=F16) -> np.ndarray:
    """True FP8 dequant scales [ng, N] (float) -> Marlin scales in act_dtype, permuted, exponent bias folded in.

    Computed as ``act_dtype(scale * 2^bias)`` from float32, one rounding (docs/formats.md, "Block FP8", rounding
    order).
    """
    bias = exponent_bias(act_dtype)
    with np.errstate(over="ignore"):
        folded = (np.asarray(scales, dtype=np.float32) * np.float32(bias)).astype(np.dtype(act_dtype))
    return permute_scales(folded, size_k, size_n, group_size)


def block_fp8_group128_scales(inverse_scales: np.ndarray, size_k: int, size_n: int, act_dtype=F16) -> np.ndarray:
    """Block-FP8 inverse scales [ceil(N/128), ceil(K/128)] (bf16 or float32) -> Marlin scales [ceil(K/128), N_pad]
    (×256 for fp16; padded columns 0)."""
    check_block_fp8_shapes(size_k, size_n)
    return marlin_fp8_scales(expand_block_scales(inverse_scales, size_k, size_n), size_k, size_n, BLOCK, act_dtype)


def marlin_to_row_major_fp8(qweight: np.ndarray, size_k: int, size_n: int) -> np.ndarray:
    """Inverse of block_fp8_group128_repack: Marlin tiles -> row-major E4M3 bytes [N, K]."""
    return np.ascontiguousarray(marlin_unpack_codes(qweight, size_k, size_n, 8).T)
