"""Microscaling formats: NVFP4, MXFP4 and MXFP8 (docs/formats.md, "Microscaling: NVFP4, MXFP4, MXFP8").

A microscaled weight is small elements, each group of ``G`` consecutive elements along K sharing one scale:

| format | element | G | scale | global scale |
|---|---|---|---|---|
| NVFP4 | E2M1 (4 bits: 1 sign, 2 exponent, 1 mantissa) | 16 | FP8 E4M3 | one fp32 per tensor |
| MXFP4 | E2M1 | 32 | E8M0 (a power of two, 2^(code - 127)) | none |
| MXFP8 | FP8 E4M3 | 32 | E8M0 | none |

Checkpoints store weights row-major ``[N, K]``: FP4 codes two to a byte, element ``k`` of a row in the low nibble
when ``k`` is even; scales ``[N, K/G]``. The value of element (n, k) is ``element * scale[n, k // G]`` (× the global
scale for NVFP4, ModelOpt's ``weight_scale_2``).

This module holds the codes, the reference quantizers and exact dequantizers; the Marlin layouts of these formats
are in ``workbench.formats.fp4_marlin``.
"""
from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from workbench.formats._checks import require, require_dtype, require_ndim
from workbench.formats.fp8 import BF16, E4M3, E4M3_MAX, F16, float_to_e4m3

E2M1 = np.dtype(ml_dtypes.float4_e2m1fn)
E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
E2M1_MAX = 6.0  # largest E2M1 magnitude (code 7)
E8M0_BIAS = 127  # E8M0 code c is 2^(c - 127)
E8M0_NAN = 0xFF  # the one non-number code of E8M0 (it has no zero, no sign, no infinity)

# value of every E2M1 code, from ml_dtypes (codes 0..7 positive, 8..15 the same magnitudes negated; 8 is -0)
E2M1_VALUES = np.arange(16, dtype=np.uint8).view(E2M1).astype(np.float32)
E2M1_VALUES.setflags(write=False)


@dataclass(frozen=True)
class MicroscaleFormat:
    """One microscaling format, as data: what an element and a scale are, and the group they share."""

    name: str
    element: str  # "e2m1" or "e4m3"
    element_bits: int
    group_size: int
    scale: str  # "e4m3" (NVFP4) or "e8m0" (MX)
    has_global_scale: bool
    element_emax: int  # exponent of the element's largest power of two: OCP MX's shared exponent subtracts it
    element_max: float
    act_dtypes: tuple[np.dtype, ...]  # activation dtypes the Marlin kernels run it with (vLLM)


NVFP4 = MicroscaleFormat("nvfp4", "e2m1", 4, 16, "e4m3", True, 2, E2M1_MAX, (F16, BF16))
# E8M0 scales reach 2^127: only bf16 holds every one of them, so vLLM runs the MX formats in bf16 only
MXFP4 = MicroscaleFormat("mxfp4", "e2m1", 4, 32, "e8m0", False, 2, E2M1_MAX, (BF16,))
MXFP8 = MicroscaleFormat("mxfp8", "e4m3", 8, 32, "e8m0", False, 8, E4M3_MAX, (BF16,))
FORMATS = {f.name: f for f in (NVFP4, MXFP4, MXFP8)}


def microscale_format(fmt: "MicroscaleFormat | str") -> MicroscaleFormat:
    if isinstance(fmt, MicroscaleFormat):
        return fmt
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r} is not one of {', '.join(FORMATS)}")
    return FORMATS[fmt]


def check_group_size(fmt: MicroscaleFormat, group_size) -> int:
    """The format's group size is fixed: 16 for NVFP4, 32 for the MX formats."""
    if group_size != fmt.group_size or isinstance(group_size, bool):
        raise ValueError(f"group_size = {group_size!r} is not {fmt.name}'s {fmt.group_size} (the format fixes it)")
    return fmt.group_size


def check_k(fmt: MicroscaleFormat, size_k: int) -> int:
    require(size_k > 0 and size_k % fmt.group_size == 0,
            f"size_k = {size_k} is not a positive multiple of {fmt.name}'s group size {fmt.group_size}")
    return size_k


# ---------------------------------------------------------------------------------------------------------------
# E2M1 codes and their nibble packing
# ---------------------------------------------------------------------------------------------------------------
def first_bad(mask: np.ndarray) -> tuple[tuple[int, ...], int]:
    """(index of the first True in row-major order, how many are True)."""
    index = np.unravel_index(int(np.flatnonzero(mask)[0]), mask.shape)
    return tuple(int(i) for i in index), int(mask.sum())


def _where(index: tuple[int, ...]) -> str:
    return ", ".join(str(i) for i in index)


def check_e2m1_codes(codes, name: str = "codes") -> np.ndarray:
    codes = np.asarray(codes)
    if codes.dtype == E2M1:
        return codes.view(np.uint8)
    require_dtype(codes, (np.uint8,), name)
    bad = codes > 15
    if bad.any():
        at, count = first_bad(bad)
        raise ValueError(f"{name}[{_where(at)}] = {int(codes[at])} is not an E2M1 code (0..15; {count} such)")
    return codes


def e2m1_to_float32(codes) -> np.ndarray:
    """E2M1 codes (uint8 0..15, or float4_e2m1fn) -> their float32 values."""
    return E2M1_VALUES[check_e2m1_codes(codes)]


def float_to_e2m1(x) -> np.ndarray:
    """float -> E2M1 codes (uint8): round to nearest, ties to even; magnitudes above 6 saturate to ±6."""
    x = np.asarray(x, dtype=np.float32)
    require(bool(np.isfinite(x).all()), "float_to_e2m1: input holds NaN or Inf (E2M1 has neither)")
    return np.clip(x, -E2M1_MAX, E2M1_MAX).astype(E2M1).view(np.uint8)


def pack_fp4(codes) -> np.ndarray:
    """E2M1 codes [..., K] -> bytes [..., K/2]: element 2j in the low nibble of byte j, 2j + 1 in the high nibble."""
    codes = check_e2m1_codes(codes)
    require(codes.shape[-1] % 2 == 0, f"codes have {codes.shape[-1]} elements along K; two share a byte, so K must"
            " be even")
    return (codes[..., 0::2] | (codes[..., 1::2] << np.uint8(4))).astype(np.uint8)


def unpack_fp4(packed) -> np.ndarray:
    """Inverse of pack_fp4: bytes [..., K/2] -> codes [..., K]."""
    packed = np.asarray(packed)
    require_dtype(packed, (np.uint8,), "packed FP4 bytes")
    out = np.empty(packed.shape[:-1] + (2 * packed.shape[-1],), np.uint8)
    out[..., 0::2] = packed & np.uint8(0xF)
    out[..., 1::2] = packed >> np.uint8(4)
    return out


# ---------------------------------------------------------------------------------------------------------------
# scales: E8M0 and E4M3
# ---------------------------------------------------------------------------------------------------------------
def check_e8m0_codes(codes, name: str = "scales") -> np.ndarray:
    """E8M0 scale codes (uint8 or float8_e8m0fnu) -> uint8, refusing the NaN code 0xFF by position and count."""
    codes = np.asarray(codes)
    require_dtype(codes, (np.uint8, E8M0), name)
    codes = codes.view(np.uint8)
    bad = codes == E8M0_NAN
    if bad.any():
        at, count = first_bad(bad)
        raise ValueError(f"{name}[{_where(at)}] = 0xFF is E8M0's NaN code, not a scale ({count} such code(s)); a "
                         "group with a NaN scale has no value")
    return codes


def e8m0_to_float(codes, name: str = "scales") -> np.ndarray:
    """E8M0 codes -> float64 2^(code - 127), exact (float32 cannot hold 2^-127 as a normal, float64 can)."""
    return np.ldexp(1.0, check_e8m0_codes(codes, name).astype(np.int32) - E8M0_BIAS)


def check_e4m3_scales(scales, name: str = "weight_scale") -> np.ndarray:
    """NVFP4 block scales (E4M3 bytes as uint8 or float8_e4m3fn) -> uint8, refusing NaN (0x7F / 0xFF)."""
    scales = np.asarray(scales)
    require_dtype(scales, (np.uint8, E4M3), name)
    raw = scales.view(np.uint8)
    bad = (raw & 0x7F) == 0x7F
    if bad.any():
        at, count = first_bad(bad)
        raise ValueError(f"{name}[{_where(at)}] = {int(raw[at]):#04x} is E4M3's NaN ({count} such)")
    return raw


def e4m3_value(scales, name: str = "weight_scale") -> np.ndarray:
    return check_e4m3_scales(scales, name).view(E4M3).astype(np.float64)


# ---------------------------------------------------------------------------------------------------------------
# reference quantizers and exact dequantizers; weights are [N, K] (rows = output features), as checkpoints hold them
# ---------------------------------------------------------------------------------------------------------------
def _check_weight(w, fmt: MicroscaleFormat) -> np.ndarray:
    w = np.asarray(w, dtype=np.float32)
    require_ndim(w, 2, "w")
    check_k(fmt, w.shape[1])
    require(bool(np.isfinite(w).all()), "w holds NaN or Inf; a microscaled format cannot represent it")
    return w


def _block_amax(w: np.ndarray, group: int) -> np.ndarray:
    return np.abs(w.reshape(w.shape[0], -1, group)).max(axis=-1)


def _elements(x: np.ndarray, fmt: MicroscaleFormat) -> np.ndarray:
    return float_to_e2m1(x) if fmt.element == "e2m1" else float_to_e4m3(x)


def _element_values(codes: np.ndarray, fmt: MicroscaleFormat) -> np.ndarray:
    if fmt.element == "e2m1":
        return e2m1_to_float32(codes).astype(np.float64)
    return np.asarray(codes).view(np.uint8).view(E4M3).astype(np.float64)


def quantize_nvfp4(w) -> tuple[np.ndarray, np.ndarray, np.float32]:
    """[N, K] float -> (packed E2M1 bytes [N, K/2], E4M3 scale bytes [N, K/16], global scale fp32).

    The global scale is ModelOpt's ``weight_scale_2`` (compressed-tensors stores its reciprocal):
    ``amax(|w|) / (6 · 448)``, so the largest block scale lands on E4M3's 448. Block scale ``e4m3(amax_block / 6 /
    global)``, element ``e2m1(w / (scale · global))``, each rounded to nearest even; an all-zero tensor gets global 1.
    """
    w = _check_weight(w, NVFP4)
    amax = np.float32(np.abs(w).max())
    global_scale = np.float32(amax / np.float32(E2M1_MAX * E4M3_MAX)) if amax > 0 else np.float32(1.0)
    scales = float_to_e4m3(_block_amax(w, 16) / np.float32(E2M1_MAX) / global_scale)
    denom = np.repeat(scales.view(E4M3).astype(np.float32) * global_scale, 16, axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        scaled = np.where(denom > 0, w / denom, np.float32(0))
    return pack_fp4(float_to_e2m1(scaled)), scales, global_scale


def dequantize_nvfp4(packed, scales, global_scale) -> np.ndarray:
    """Exact NVFP4 values [N, K] as float64 (E2M1 × E4M3 × fp32 has at most 2 + 4 + 24 significant bits)."""
    codes = unpack_fp4(packed)
    s = e4m3_value(scales)
    require(s.shape == (codes.shape[0], codes.shape[1] // 16),
            f"scales have shape {s.shape}, expected {(codes.shape[0], codes.shape[1] // 16)} = [N, K/16]")
    return e2m1_to_float32(codes).astype(np.float64) * np.repeat(s, 16, axis=1) * np.float64(np.float32(global_scale))


def quantize_mx(w, fmt: "MicroscaleFormat | str") -> tuple[np.ndarray, np.ndarray]:
    """[N, K] float -> (elements, E8M0 codes [N, K/32]) for MXFP4 (elements packed [N, K/2]) or MXFP8 (E4M3 bytes
    [N, K]).

    OCP MX v1.0's rule: shared exponent ``X = floor(log2(amax_block)) - emax_element`` (emax 2 for E2M1, 8 for
    E4M3), clamped to E8M0's [-127, 127] (an all-zero block gets -127); elements ``round(w / 2^X)``, saturating.
    """
    fmt = microscale_format(fmt)
    require(fmt.scale == "e8m0", f"quantize_mx: {fmt.name} is not an MX format")
    w = _check_weight(w, fmt)
    amax = _block_amax(w, 32)
    _, exponent = np.frexp(amax)  # amax = m · 2^e, m in [0.5, 1): floor(log2 amax) = e - 1, exact
    shared = np.where(amax > 0, exponent - 1 - fmt.element_emax, -E8M0_BIAS)
    shared = np.clip(shared, -E8M0_BIAS, E8M0_BIAS)
    codes = (shared + E8M0_BIAS).astype(np.uint8)
    scaled = np.ldexp(w.astype(np.float64), -np.repeat(shared, 32, axis=1))
    elements = _elements(np.clip(scaled, -fmt.element_max, fmt.element_max), fmt)
    return (pack_fp4(elements) if fmt.element_bits == 4 else elements), codes


def dequantize_mx(elements, scale_codes, fmt: "MicroscaleFormat | str") -> np.ndarray:
    """Exact MX values [N, K] as float64 (a power of two times an element: exact over E8M0's whole range)."""
    fmt = microscale_format(fmt)
    codes = unpack_fp4(elements) if fmt.element_bits == 4 else np.asarray(elements).view(np.uint8)
    s = e8m0_to_float(scale_codes)
    require(s.shape == (codes.shape[0], codes.shape[1] // 32),
            f"scales have shape {s.shape}, expected {(codes.shape[0], codes.shape[1] // 32)} = [N, K/32]")
    return _element_values(codes, fmt) * np.repeat(s, 32, axis=1)
