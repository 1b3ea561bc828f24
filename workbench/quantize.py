"""Reference round-to-nearest quantizer and the reference dequantizer (docs/formats.md, "Reference quantizer").

``dequantize`` is the spec of what a Marlin GEMM multiplies with: for integer weights
``act_dtype((code - zero) * scale)`` — the difference is a small exact integer, so the product has exactly one
rounding, as ``__hmul2`` in the kernel; for FP8 ``act_dtype(bitmove(byte) * act_dtype(scale * 2^bias))`` where the
bit move is exact and the folded scale is the one the kernel reads.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from workbench.formats._checks import require, require_ndim
from workbench.formats.fp8 import E4M3_MAX, e4m3_to_float32, exponent_bias, float_to_e4m3
from workbench.formats.scales import check_group_size, num_groups
from workbench.scalar_types import SUPPORTED_GROUP_SIZES, ScalarType


@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """A quantized K×N weight in logical (checkpoint) layout."""

    codes: np.ndarray  # (K, N) uint8 codes (FP8: raw E4M3 bytes)
    scales: np.ndarray  # (ng, N) act_dtype (FP8: float32 true dequantization scales)
    zeros: np.ndarray | None  # (ng, N) uint8 zero-point codes, u4/u8 only
    g_idx: np.ndarray | None  # (K,) int32 group of each checkpoint row, act-order only
    group_size: int
    weight_type: ScalarType
    act_dtype: np.dtype
    w_ref: np.ndarray  # (K, N) float32: the exact dequantized weight a GEMM multiplies with

    @property
    def size_k(self) -> int:
        return self.codes.shape[0]

    @property
    def size_n(self) -> int:
        return self.codes.shape[1]


def group_of_rows(size_k: int, group_size: int, g_idx: np.ndarray | None) -> np.ndarray:
    """(K,) group index of every checkpoint row."""
    if g_idx is not None:
        return np.asarray(g_idx)
    if group_size == -1:
        return np.zeros(size_k, dtype=np.int64)
    return np.arange(size_k) // group_size


def act_order_g_idx(size_k: int, group_size: int, rng: np.random.Generator) -> np.ndarray:
    """A random act-order g_idx: rows are quantized in a random order, each run of G of that order is a group."""
    order = rng.permutation(size_k)
    g_idx = np.empty(size_k, dtype=np.int32)
    g_idx[order] = np.arange(size_k) // group_size
    return g_idx


def _check_dtype(act_dtype) -> np.dtype:
    exponent_bias(act_dtype)  # raises for anything but float16 / bfloat16
    return np.dtype(act_dtype)


def dequantize(codes, scales, zeros, weight_type, group_size: int, g_idx=None, act_dtype=np.float16,
               rounded: bool = True) -> np.ndarray:
    """Exact reference dequantization, returned as float32 (K, N) holding act_dtype-representable values.

    ``rounded=False``: the same products before that last rounding, as float64 (exact: what a kernel that applies
    the scales to fp32 partial sums multiplies with; FP8 keeps its scale folded and rounded as the kernel gets it).
    (The products are exact in float32 too — at most 8 + 11 significant bits — so the rounded path stays float32.)"""
    wide = np.float32 if rounded else np.float64
    wt = ScalarType.parse(weight_type)
    act = _check_dtype(act_dtype)
    codes = np.asarray(codes)
    size_k = codes.shape[0]
    rows = group_of_rows(size_k, group_size, g_idx)
    scale_rows = np.asarray(scales)[rows].astype(np.float32)  # (K, N)
    if wt is ScalarType.FE4M3FN:
        bias = np.float32(exponent_bias(act))
        folded = (scale_rows * bias).astype(act).astype(np.float32)
        moved = e4m3_to_float32(codes) / bias  # exact: the kernel's bit move
        product = moved.astype(wide, copy=False) * folded
        return product if not rounded else product.astype(act).astype(np.float32)
    if wt.has_zero_points:
        require(zeros is not None, f"{wt} needs zero points")
        zero_rows = np.asarray(zeros)[rows].astype(np.float32)
    else:
        zero_rows = np.float32(wt.bias)
    product = (codes.astype(wide) - zero_rows) * scale_rows
    return product if not rounded else product.astype(act).astype(np.float32)


def quantize_weights(w, weight_type, group_size: int, act_order: bool = False, act_dtype=np.float16,
                     seed: int = 0) -> QuantizedWeight:
    """Round-to-nearest quantization of w (K, N) per group of rows and per column. Any K and N; a group size that
    does not divide K leaves a partial last group (ceil(K / group_size) groups).

    * symmetric (u4b8/u8b128): ``s = max(|max|/qmax, |min|/|qmin|)``, ``code = clamp(round(w/s), qmin, qmax) + bias``;
    * asymmetric (u4/u8): ``s = max(max - min, 1e-5) / (2^b - 1)``, ``z = clamp(round(-min/s))``,
      ``code = clamp(round(w/s) + z)``; (vLLM's test helper uses ``|min|``, which saturates groups whose minimum is
      positive; we use ``-min``.)
    * fe4m3fn: ``s = amax / 448``, ``code = e4m3(w / s)``.

    Scales are rounded to act_dtype first (FP8: kept in float32) and the codes are computed from the rounded scales,
    so ``w_ref`` is exactly what a kernel reconstructs. Rounding is half-to-even.
    """
    wt = ScalarType.parse(weight_type)
    act = _check_dtype(act_dtype)
    w = np.asarray(w)
    require_ndim(w, 2, "w")
    size_k, size_n = w.shape
    require(group_size in SUPPORTED_GROUP_SIZES or group_size == size_k,
            f"group_size = {group_size} is not one of {SUPPORTED_GROUP_SIZES}")
    check_group_size(size_k, group_size)
    require(not (act_order and group_size == -1), "act_order needs a group size (act-order with group_size = -1 is"
                                                  " the same as no act-order)")
    require(not (act_order and wt is ScalarType.FE4M3FN), "act_order is not defined for fe4m3fn weights")
    rng = np.random.default_rng(seed)
    g_idx = act_order_g_idx(size_k, group_size, rng) if act_order else None
    rows = group_of_rows(size_k, group_size, g_idx)
    ng = num_groups(size_k, group_size)
    w32 = w.astype(np.float32)

    # per-(group, column) statistics
    wmax = np.full((ng, size_n), -np.inf, dtype=np.float32)
    wmin = np.full((ng, size_n), np.inf, dtype=np.float32)
    np.maximum.at(wmax, rows, w32)
    np.minimum.at(wmin, rows, w32)

    zeros = None
    if wt is ScalarType.FE4M3FN:
        amax = np.maximum(np.maximum(np.abs(wmax), np.abs(wmin)), np.float32(1e-12))
        scales = (amax / np.float32(E4M3_MAX)).astype(np.float32)
        codes = float_to_e4m3(w32 / scales[rows])
    elif wt.has_zero_points:
        qmax = (1 << wt.bits) - 1
        scales = (np.maximum(wmax - wmin, np.float32(1e-5)) / np.float32(qmax)).astype(act)
        s32 = scales.astype(np.float32)
        zeros = np.clip(np.rint(-wmin / s32), 0, qmax).astype(np.uint8)
        codes = np.clip(np.rint(w32 / s32[rows]) + zeros[rows], 0, qmax).astype(np.uint8)
    else:
        qmax, qmin = (1 << (wt.bits - 1)) - 1, -(1 << (wt.bits - 1))
        s = np.maximum(np.abs(wmax) / qmax, np.abs(wmin) / -qmin)
        scales = np.maximum(s, np.float32(1e-8)).astype(act)
        v = np.clip(np.rint(w32 / scales.astype(np.float32)[rows]), qmin, qmax)
        codes = (v + wt.bias).astype(np.uint8)

    w_ref = dequantize(codes, scales, zeros, wt, group_size, g_idx, act)
    return QuantizedWeight(codes, scales, zeros, g_idx, group_size, wt, act, w_ref)
