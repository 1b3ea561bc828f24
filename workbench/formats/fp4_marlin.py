"""The Marlin layouts of NVFP4, MXFP4 and MXFP8 (docs/formats.md, "Microscaling in Marlin").

**Weights.** E2M1 codes are 4-bit codes: they take the 4-bit Marlin tile (``marlin_tile``) unchanged. A checkpoint's
``[N, K/2]`` bytes, read as little-endian int32 words and transposed, are exactly GPTQ's ``[K/8, N]`` qweight (nibble
j of word (r, n) = element k = 8r + j of row n), which is how vLLM repacks them. The fused gather here reads the bytes
directly: ``fp4_word_sources`` names, for every field of a Marlin word, the element of the row-major code matrix it
holds. MXFP8's E4M3 bytes take the 8-bit route of block-FP8 (``fp8.block_fp8_group128_repack``).

**Scales**, in order (vLLM's ``marlin_utils_fp4.py``):

1. the Marlin scale permutation (``scales.permute_scales``; 64-wide, since every layer has more than one group);
2. ``FP8_SCALE_SHUFFLE``: within every four consecutive scales, the middle two swap. The kernel turns four 8-bit
   scales of one 32-bit word into two pairs of 16-bit values with byte moves that take bytes (0, 2) and (1, 3)
   together — the same reason the 8-bit weight fields are interleaved ``[0, 2, 1, 3]``;
3. NVFP4: the E4M3 scale ``s`` becomes the *S0E5M3* byte: ``fp16(s · 2^7)``, its bits shifted left by one, the high
   byte kept. A non-negative fp16 has sign 0, so the byte is fp16's 5 exponent bits and the top 3 mantissa bits: all
   of E4M3's value (3 mantissa bits), with the exponent re-biased so the kernel widens it with one shift. The sign is
   what is shifted out: **a negative scale is stored as its magnitude** (vLLM warns; so does this module).
   In bf16 vLLM also scales every scale by a power of two ``scale_factor`` so that the smallest non-zero one has
   ``s · 2^7 ≥ 2`` (the byte's top bit set) and divides the global scale by the same factor;
   MX: the scales stay E8M0 codes.
4. NVFP4's global scale (fp32) gets the exponent correction the kernel's E2M1 bit move leaves out, minus the 2^7 of
   step 3: ``× 2^(bias_act − bias_e2m1 − 7)`` = ``× 2^7`` (fp16, bias 15 − 1) or ``× 2^119`` (bf16, 127 − 1).
"""
from __future__ import annotations

import warnings

import numpy as np

from workbench.formats._checks import (TILE_N, check_weight_sizes, require, require_dtype,
                                       require_ndim, require_shape)
from workbench.formats.fp8 import BF16, E4M3, F16, block_fp8_group128_repack, float_to_e4m3, marlin_to_row_major_fp8
from workbench.formats.marlin_tile import marlin_repack_codes, marlin_unpack_codes, marlin_word_field_to_kn
from workbench.formats.microscale import (E8M0, E8M0_BIAS, NVFP4, MicroscaleFormat, _where,
                                          check_e4m3_scales, check_e8m0_codes, first_bad, microscale_format,
                                          pack_fp4, unpack_fp4)
from workbench.formats.scales import permute_scales, unpermute_scales

FP8_SCALE_SHUFFLE = np.array([0, 2, 1, 3])  # step 2: an involution (it swaps the middle two)
FP8_SCALE_SHUFFLE.setflags(write=False)
S0E5M3_SHIFT = 7  # step 3: fp16(s · 2^7)
FP16_MAX = 65504.0
# step 4: log2 of the global scale's factor per activation dtype: 2^(e_act - 1) - 2^(e_e2m1 - 1) - 7
GLOBAL_SCALE_EXPONENT = {F16: (2 ** 4 - 2 ** 1) - S0E5M3_SHIFT, BF16: (2 ** 7 - 2 ** 1) - S0E5M3_SHIFT}
FP4_PACK = 8  # E2M1 codes per int32 word
# K of every microscaled weight: a whole number of its format's groups. NVFP4's group is 16 (two codes a byte, one
# E4M3 scale per 16), MX's 32, so K is always whole 16-row k-tiles: only N can end in a padded tile.
SIZE_K_MULTIPLE = {"nvfp4": 16, "mxfp4": 32, "mxfp8": 32}


def _check_k_multiple(size_k, size_n, multiple: int, why: str) -> tuple[int, int]:
    size_k, size_n = check_weight_sizes(size_k, size_n)
    require(size_k % multiple == 0, f"size_k = {size_k} is not a multiple of {multiple} ({why})")
    return size_k, size_n


def check_microscale_sizes(size_k, size_n, fmt) -> tuple[int, int]:
    """(K, N) of a microscaled weight: N any positive size (the Marlin arrays are N_pad = ceil(N / 64) * 64 wide,
    the padded columns zero codes and zero scale bytes; docs/formats.md, "Shapes that are not tile multiples"), K a
    positive multiple of the format's group (NVFP4 16, MXFP4 / MXFP8 32), which the format itself requires."""
    f = microscale_format(fmt)
    return _check_k_multiple(size_k, size_n, SIZE_K_MULTIPLE[f.name],
                             f"{f.name} has one scale per {f.group_size} elements along K")


def check_weight_k_tiles(size_k, size_n) -> tuple[int, int]:
    """(K, N) of a microscaled weight alone (FP4 codes of either format, MXFP8 bytes): K a multiple of 16, whole
    k-tiles, which every microscaled K is (NVFP4's group); the scale ops check the format's own group (MX: 32)."""
    return _check_k_multiple(size_k, size_n, 16, "microscaled weights: NVFP4 has one scale per 16 elements along K,"
                             " MXFP4 and MXFP8 one per 32")


# ---------------------------------------------------------------------------------------------------------------
# weights
# ---------------------------------------------------------------------------------------------------------------
def _check_fp4_shape(packed, size_k: int, size_n: int, name: str = "weight_packed") -> np.ndarray:
    packed = np.asarray(packed)
    require_dtype(packed, (np.uint8,), name)
    require_shape(packed, (size_n, size_k // 2), name, f"[N, K/2] for K = {size_k}, N = {size_n}: two E2M1 codes a"
                  " byte")
    return packed


def gptq_view_of_fp4(packed) -> np.ndarray:
    """Checkpoint bytes [N, K/2] -> GPTQ-layout qweight int32 [K/8, N] (vLLM: ``weight.view(int32).T``)."""
    packed = np.ascontiguousarray(packed, dtype=np.uint8)
    require_ndim(packed, 2, "weight_packed")
    require(packed.shape[1] % 4 == 0, f"weight_packed has {packed.shape[1]} bytes per row; four make a word")
    return np.ascontiguousarray(packed.view("<i4").astype(np.int32).T)


def fp4_marlin_repack(packed, size_k: int, size_n: int) -> np.ndarray:
    """E2M1 bytes [N, K/2] (row-major, low nibble first) -> Marlin tiles int32 [K/16, 2 N_pad] (padded codes 0)."""
    size_k, size_n = check_weight_k_tiles(size_k, size_n)
    packed = _check_fp4_shape(packed, size_k, size_n)
    return marlin_repack_codes(np.ascontiguousarray(unpack_fp4(packed).T), 4)


def marlin_to_fp4(qweight, size_k: int, size_n: int) -> np.ndarray:
    """Inverse of fp4_marlin_repack: Marlin tiles [K/16, 2 N_pad] -> E2M1 bytes [N, K/2] (the padding dropped)."""
    size_k, size_n = check_weight_k_tiles(size_k, size_n)
    return pack_fp4(np.ascontiguousarray(marlin_unpack_codes(qweight, size_k, size_n, 4).T))


def fp4_word_sources(word, size_k: int, size_n: int) -> np.ndarray:
    """Marlin word index -> the 8 flat indices into the row-major code matrix [N, K] it holds, field 0 first.

    Vectorized over ``word``; returns shape (..., 8). From the tile's maps: for lane-row ``r = 2 (lane % 4)`` of
    k-tile t and column ``n0`` of the word's sub-block, fields 0..7 hold (k, n) = (r, n0), (r+8, n0), (r, n0+8),
    (r+8, n0+8) and then the same four at k + 1 — so the element pairs (k, k+1) of fields (j, j+4) are the two
    nibbles of one checkpoint byte.
    """
    word = np.asarray(word, dtype=np.int64)[..., None]
    k, n = marlin_word_field_to_kn(word, np.arange(FP4_PACK), size_n, 4)
    return n * size_k + k


def mxfp8_marlin_repack(weight, size_k: int, size_n: int) -> np.ndarray:
    """MXFP8 E4M3 bytes [N, K] -> Marlin tiles int32 [K/16, 4 N_pad]: the block-FP8 8-bit route (transpose fused)."""
    check_weight_k_tiles(size_k, size_n)
    return block_fp8_group128_repack(weight, size_k, size_n)


def marlin_to_mxfp8(qweight, size_k: int, size_n: int) -> np.ndarray:
    """Inverse of mxfp8_marlin_repack: Marlin tiles [K/16, 4 N_pad] -> E4M3 bytes [N, K] (the padding dropped)."""
    check_weight_k_tiles(size_k, size_n)
    return marlin_to_row_major_fp8(qweight, size_k, size_n)


# ---------------------------------------------------------------------------------------------------------------
# scales: step 2, the shuffle
# ---------------------------------------------------------------------------------------------------------------
def shuffle_scales(s) -> np.ndarray:
    """Step 2 on a [..., N] tensor (N a multiple of 4): out[4c + j] = in[4c + FP8_SCALE_SHUFFLE[j]]. Its own inverse."""
    s = np.asarray(s)
    require(s.shape[-1] % 4 == 0, f"scales have {s.shape[-1]} columns; the shuffle works on groups of 4")
    return np.ascontiguousarray(s.reshape(-1, 4)[:, FP8_SCALE_SHUFFLE].reshape(s.shape))


def _check_marlin_scales(s, name: str) -> np.ndarray:
    s = np.asarray(s)
    require_ndim(s, 2, name)
    require(s.shape[1] % TILE_N == 0, f"{name} has shape {s.shape}: {s.shape[1]} columns is not a multiple of "
            f"{TILE_N} (Marlin scales are N_pad = ceil(N / {TILE_N}) * {TILE_N} wide)")
    return s


def _act_dtype(a_dtype, fmt: MicroscaleFormat) -> np.dtype:
    dt = np.dtype(a_dtype)
    if dt not in fmt.act_dtypes:
        names = " or ".join(str(d) for d in fmt.act_dtypes)
        raise TypeError(f"{fmt.name} runs with {names} activations in Marlin, not {dt}")
    return dt


# ---------------------------------------------------------------------------------------------------------------
# NVFP4 scales: step 3
# ---------------------------------------------------------------------------------------------------------------
def e4m3_exact_values(s, name: str) -> np.ndarray:
    """Scales in any float dtype (or E4M3 bytes) -> float32, each required to be an E4M3 value exactly."""
    s = np.asarray(s)
    if s.dtype in (np.dtype(np.uint8), E4M3):
        return check_e4m3_scales(s, name).view(E4M3).astype(np.float32)
    require_dtype(s, (np.float16, BF16, np.float32), name)
    v = s.astype(np.float32)
    require(bool(np.isfinite(v).all()), f"{name} holds NaN or Inf (E4M3 scales are finite)")
    bad = float_to_e4m3(v).view(E4M3).astype(np.float32) != v
    if bad.any():
        at, count = first_bad(bad)
        raise ValueError(f"{name}[{_where(at)}] = {float(v[at])!r} is not an E4M3 value ({count} such); NVFP4 scales"
                         " are E4M3, and the S0E5M3 byte keeps only E4M3's 3 mantissa bits")
    return v


def warn_negative_scales(v: np.ndarray, name: str) -> None:
    neg = np.signbit(v) & (v != 0)
    if neg.any():
        at, count = first_bad(neg)
        warnings.warn(f"{name}[{_where(at)}] = {float(v[at])!r} is negative ({count} such): the S0E5M3 byte has no "
                      "sign bit, so the kernel will use its magnitude and those groups dequantize with the wrong sign",
                      RuntimeWarning, stacklevel=3)


def nvfp4_scale_factor(scales, a_dtype) -> float:
    """vLLM's rescale: 1 for fp16; for bf16 the smallest power of two p with ``min(s > 0) · 2^7 · p ≥ 2``.

    ``scales`` may be any set of a layer's (or all its experts') E4M3 scale values: only their minimum matters.
    """
    dt = _act_dtype(a_dtype, NVFP4)
    if dt == F16:
        return 1.0
    v = e4m3_exact_values(scales, "scales").astype(np.float64) * 2.0 ** S0E5M3_SHIFT
    positive = v[v > 0]
    if positive.size == 0 or positive.min() >= 2:
        return 1.0
    return float(2.0 ** np.ceil(np.log2(2.0 / positive.min())))


def _check_scale_factor(scale_factor) -> float:
    sf = float(scale_factor)
    mantissa, _ = np.frexp(sf)
    require(sf >= 1 and mantissa == 0.5, f"scale_factor = {scale_factor!r} is not a power of two >= 1")
    return sf


def nvfp4_marlin_process_scales(marlin_scales, scale_factor=None, a_dtype=None) -> tuple[np.ndarray, float]:
    """Permuted NVFP4 scales [ng, N] (E4M3 values in float16/bfloat16/float32, or E4M3 bytes) -> (S0E5M3 bytes
    uint8 [ng, N], scale_factor): steps 2 and 3.

    ``a_dtype`` (default: the scales' dtype when it is fp16 or bf16, else fp16) picks vLLM's rescale; pass
    ``scale_factor`` to share one over several experts (compute it with ``nvfp4_scale_factor``). The bytes are not
    E4M3 values: vLLM hands them back viewed as float8_e4m3fn; here they stay uint8. Negative scales warn and are
    stored as their magnitude; a scale whose ``s · scale_factor · 2^7`` exceeds fp16 is refused.
    """
    s = _check_marlin_scales(marlin_scales, "marlin_scales")
    if a_dtype is None:
        a_dtype = s.dtype if s.dtype in (np.dtype(np.float16), BF16) else F16
    v = e4m3_exact_values(s, "marlin_scales")
    warn_negative_scales(v, "marlin_scales")
    sf = nvfp4_scale_factor(v, a_dtype) if scale_factor is None else _check_scale_factor(scale_factor)
    folded = np.abs(v.astype(np.float64)) * sf * 2.0 ** S0E5M3_SHIFT
    over = folded > FP16_MAX
    if over.any():  # vLLM would store fp16's infinity here, which no byte decodes back from
        at, count = first_bad(over)
        raise ValueError(f"marlin_scales[{_where(at)}] = {float(v[at])!r}: · scale_factor {sf:g} · 2^7 = "
                         f"{folded[at]:g} exceeds fp16's {FP16_MAX:g} ({count} such); the S0E5M3 byte cannot hold "
                         "it (a bf16 layer whose scales span more than fp16's range after vLLM's rescale)")
    # exact: E4M3 values times powers of two, in range
    half_bits = shuffle_scales(folded).astype(np.float16).view(np.uint16)
    return ((half_bits << np.uint16(1)) >> np.uint16(8)).astype(np.uint8), sf


def s0e5m3_to_float(raw) -> np.ndarray:
    """S0E5M3 bytes -> float64 ``s · scale_factor`` (the byte is fp16's bits 14..7: put back, then ÷ 2^7)."""
    raw = np.asarray(raw)
    require_dtype(raw, (np.uint8, E4M3), "S0E5M3 bytes")
    half = (raw.view(np.uint8).astype(np.uint16) << np.uint16(7)).view(np.float16)
    with np.errstate(invalid="ignore"):  # bytes 0xF9.. are fp16 NaN: they stay NaN (no forward step writes them)
        return half.astype(np.float64) / 2.0 ** S0E5M3_SHIFT


def nvfp4_marlin_unprocess_scales(raw, scale_factor: float = 1.0) -> np.ndarray:
    """Inverse of nvfp4_marlin_process_scales: S0E5M3 bytes [ng, N] -> permuted E4M3 scale bytes [ng, N]."""
    sf = _check_scale_factor(scale_factor)
    raw = _check_marlin_scales(raw, "marlin_scales")
    return float_to_e4m3(shuffle_scales(s0e5m3_to_float(raw) / sf).astype(np.float32))


def nvfp4_marlin_process_global_scale(global_scale, a_dtype) -> np.ndarray:
    """Global scale (fp32; ModelOpt's ``weight_scale_2``) -> fp32 × 2^7 (fp16) or × 2^119 (bf16): step 4.

    The result stays fp32 (vLLM's kernel reads the global scale through a ``const float*``); divide it by the scale
    factor of step 3 before use (``nvfp4_marlin_global_scale`` does both).
    """
    dt = _act_dtype(a_dtype, NVFP4)
    g = np.asarray(global_scale, dtype=np.float32)
    require(bool(np.isfinite(g).all()) and bool((g > 0).all()),
            f"global_scale = {g.ravel()[:4].tolist()} must be finite and positive")
    with np.errstate(over="raise"):
        return (g * np.float32(2.0 ** GLOBAL_SCALE_EXPONENT[dt])).astype(np.float32)


# ---------------------------------------------------------------------------------------------------------------
# MX scales: steps 2 only (the codes stay E8M0)
# ---------------------------------------------------------------------------------------------------------------
def e8m0_codes_of(s, name: str) -> np.ndarray:
    """E8M0 codes (uint8 / float8_e8m0fnu) or bf16/float32 values that must be powers of two in E8M0's range."""
    s = np.asarray(s)
    if s.dtype in (np.dtype(np.uint8), E8M0):
        return check_e8m0_codes(s, name)
    require_dtype(s, (BF16, np.float32), name)
    v = s.astype(np.float64)
    mantissa, exponent = np.frexp(v)
    code = exponent - 1 + E8M0_BIAS
    bad = ~((mantissa == 0.5) & (code >= 0) & (code < 0xFF))
    if bad.any():
        at, count = first_bad(bad)
        raise ValueError(f"{name}[{_where(at)}] = {float(v[at])!r} is not an E8M0 value (a power of two in 2^-127 .. "
                         f"2^127; {count} such)")
    return code.astype(np.uint8)


def mx_marlin_process_scales(marlin_scales, input_dtype=None) -> np.ndarray:
    """Permuted MX scales [ng, N] -> shuffled E8M0 codes uint8 [ng, N] (vLLM's ``mxfp4_marlin_process_scales`` and
    ``mxfp8_marlin_process_scales`` for 16-bit activations)."""
    s = _check_marlin_scales(marlin_scales, "marlin_scales")
    if input_dtype is not None and np.dtype(input_dtype).itemsize != 2:
        raise TypeError(f"input_dtype = {np.dtype(input_dtype)}: only 16-bit activations are supported here")
    return shuffle_scales(e8m0_codes_of(s, "marlin_scales"))


# ---------------------------------------------------------------------------------------------------------------
# whole routes, checkpoint scales [N, K/G] <-> Marlin, and their inverses
# ---------------------------------------------------------------------------------------------------------------
def _check_checkpoint_scales(scales, fmt: MicroscaleFormat, size_k: int, size_n: int) -> np.ndarray:
    size_k, size_n = check_microscale_sizes(size_k, size_n, fmt.name)
    scales = np.asarray(scales)
    require_shape(scales, (size_n, size_k // fmt.group_size), "weight_scale",
                  f"[N, K/{fmt.group_size}] for K = {size_k}, N = {size_n}")
    return scales


def nvfp4_marlin_scales(weight_scale, size_k: int, size_n: int, a_dtype, scale_factor=None):
    """Checkpoint E4M3 scales [N, K/16] -> (S0E5M3 bytes [K/16, N_pad] in Marlin order, scale_factor): steps 1-3.
    The padded columns are zero bytes (scale 0; their codes are 0 too, so they dequantize to 0)."""
    scales = _check_checkpoint_scales(weight_scale, NVFP4, size_k, size_n)
    v = e4m3_exact_values(scales, "weight_scale")
    permuted = permute_scales(np.ascontiguousarray(v.T), size_k, size_n, NVFP4.group_size)
    return nvfp4_marlin_process_scales(permuted, scale_factor, a_dtype)


def nvfp4_marlin_global_scale(global_scale, a_dtype, scale_factor: float = 1.0) -> np.float32:
    """Step 4 and vLLM's division by the scale factor, as one fp32 scalar."""
    g = nvfp4_marlin_process_global_scale(global_scale, a_dtype)
    require(g.size == 1, f"global_scale has {g.size} values; one layer (or one expert) has one")
    return np.float32(g.reshape(()) / np.float32(_check_scale_factor(scale_factor)))


def marlin_to_nvfp4_scales(raw, size_k: int, size_n: int, scale_factor: float = 1.0) -> np.ndarray:
    """Inverse of nvfp4_marlin_scales: Marlin S0E5M3 bytes [K/16, N_pad] -> E4M3 scale bytes [N, K/16]."""
    size_k, size_n = check_microscale_sizes(size_k, size_n, NVFP4)
    permuted = nvfp4_marlin_unprocess_scales(raw, scale_factor)
    return np.ascontiguousarray(unpermute_scales(permuted, size_k, size_n, NVFP4.group_size).T)


def mx_marlin_scales(weight_scale, size_k: int, size_n: int, fmt="mxfp4") -> np.ndarray:
    """Checkpoint E8M0 codes [N, K/32] -> shuffled E8M0 codes [K/32, N_pad] in Marlin order: steps 1-2.

    The padded columns are code 0, which is not zero but 2^-127: finite, so a padded column is 0 x 2^-127 = 0 (its
    E2M1 / E4M3 codes are 0); the GEMM never writes those columns of C anyway.

    vLLM goes through bf16 values (``.to(bf16)``, permute, ``.to(e8m0)``): bf16 holds every E8M0 value exactly, so
    permuting the codes themselves gives the same bytes.
    """
    fmt = microscale_format(fmt)
    require(fmt.scale == "e8m0", f"mx_marlin_scales: {fmt.name} has no E8M0 scales")
    scales = _check_checkpoint_scales(weight_scale, fmt, size_k, size_n)
    codes = check_e8m0_codes(scales, "weight_scale")
    return shuffle_scales(permute_scales(np.ascontiguousarray(codes.T), size_k, size_n, fmt.group_size))


def marlin_to_mx_scales(codes, size_k: int, size_n: int, fmt="mxfp4") -> np.ndarray:
    """Inverse of mx_marlin_scales: Marlin E8M0 codes [K/32, N_pad] -> checkpoint codes [N, K/32]."""
    fmt = microscale_format(fmt)
    size_k, size_n = check_microscale_sizes(size_k, size_n, fmt.name)
    codes = np.asarray(codes).view(np.uint8)
    return np.ascontiguousarray(unpermute_scales(shuffle_scales(codes), size_k, size_n, fmt.group_size).T)


WEIGHT_ROUTES = {"nvfp4": (fp4_marlin_repack, marlin_to_fp4), "mxfp4": (fp4_marlin_repack, marlin_to_fp4),
                 "mxfp8": (mxfp8_marlin_repack, marlin_to_mxfp8)}
