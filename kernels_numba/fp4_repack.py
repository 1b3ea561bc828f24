"""The microscaled formats' transforms (NVFP4, MXFP4, MXFP8) as Numba-CUDA kernels.

Specified in docs/formats.md, "Microscaling in Marlin"; NumPy references in ``workbench.formats.fp4_marlin``.
Every kernel is one element-wise grid-stride launch over all experts at once (a leading expert axis is just more
work items); each thread computes one output word or byte from the index maps, a gather::

    weights   Marlin word w of a 16x64 tile (128 words, 4 per lane): lane, warp = divmod(w % 128, 4)
              r = 16 k_tile + 2 (lane % 4),   n0 = 64 n_tile + 16 warp + lane // 4
              bytes (n0, r), (n0, r+8), (n0+8, r), (n0+8, r+8) of the [N, K/2] checkpoint: their low nibbles are
              fields 0..3, their high nibbles (element k + 1) fields 4..7
    scales    Marlin byte d of [ng, N]: p = d with bits 0 and 1 swapped (the [0, 2, 1, 3] shuffle),
              then logical = p - p % W + P[p % W] (P64, or P32 for one group), (g, n) = divmod(logical, N),
              source = weight_scale[n, g]

The NVFP4 scale byte is computed with integer moves, not through fp16: an E4M3 magnitude ``(e, m)`` with scale
factor ``2^s`` becomes S0E5M3 ``(e + 15 + s, m)`` for a normal code and, for a subnormal ``m / 8 · 2^-6``, the
normalised ``(p + 13 + s, (m << (3 - p)) & 7)`` with ``p = floor(log2 m)`` — the bits ``fp16(value · 2^7 · 2^s)``
has in positions 14..7. Bad values (NaN codes, an fp16 overflow) are marked in an error slot by their lowest index
and reported by the host wrapper with the NumPy reference's message; negative NVFP4 scales are counted and warned
about the same way.
"""
from __future__ import annotations

import functools
import warnings

import numpy as np
from numba import cuda, int64, uint8, uint32

from kernels_numba._launch import Arrays, copy_to_host_checked, is_device_array
from workbench.formats import fp4_marlin as fm
from workbench.formats import microscale as ms
from workbench.formats._checks import check_tile_sizes, require
from workbench.formats.scales import SCALE_PERM_32, SCALE_PERM_64

THREADS = 256
MAX_BLOCKS = 132 * 16  # grid-stride cap, as kernels_numba.scales
NO_ERROR = np.iinfo(np.int64).max
WORDS_PER_TILE = 128  # 4-bit tile: 1024 codes / 8


def _blocks(total: int) -> int:
    return max(1, min(MAX_BLOCKS, -(-total // THREADS)))


# ---------------------------------------------------------------------------------------------------------------
# device helpers
# ---------------------------------------------------------------------------------------------------------------
@cuda.jit(device=True, inline=True)
def scale_source(d, ng, size_n):
    """Marlin scale byte d of one expert -> (g, n) of its checkpoint scale weight_scale[n, g], and p (the byte's
    position before the shuffle, where the references name errors)."""
    j = d & 3
    p = d - j + (((j & 1) << 1) | (j >> 1))  # the shuffle: swap the middle two of every four
    if ng > 1:
        lane = p & 63
        logical = p - lane + (lane >> 3) + ((lane & 7) << 3)  # P64: transpose of an 8x8 block
    else:
        lane = p & 31
        logical = p - lane + ((lane >> 3) << 1) + (lane & 1) + (((lane >> 1) & 3) << 3)  # P32
    g = logical // size_n
    return g, logical - g * size_n, p


@cuda.jit(device=True, inline=True)
def fp4_word_source(w, n_tiles):
    """Marlin FP4 word w of one expert (128 words a 16x64 tile, lane = word / 4 and warp = word % 4 within it) ->
    (n0, col): its four bytes are bytes col (element k) and col + 4 (k + 8) of rows n0 and n0 + 8 of the [N, K/2]
    source, each byte two elements of one row."""
    tile = w >> 7
    wit = w & 127
    k_tile = tile // n_tiles
    n_tile = tile - k_tile * n_tiles
    lane = wit >> 2
    warp = wit & 3
    return 64 * n_tile + 16 * warp + (lane >> 2), (16 * k_tile + 2 * (lane & 3)) >> 1


@cuda.jit(device=True, inline=True)
def s0e5m3_of_e4m3(magnitude, s):
    """E4M3 magnitude byte (0..0x7E) and scale factor 2^s -> the S0E5M3 byte (as an int; > 0xFF: fp16 overflow)."""
    if magnitude == 0:
        return 0
    e = magnitude >> 3
    m = magnitude & 7
    if e > 0:
        exp = e + 15 + s
        if exp >= 31:
            return 0x100
        return (exp << 3) | m
    p = 0 if m == 1 else (1 if m < 4 else 2)
    return ((p + 13 + s) << 3) | ((m << (3 - p)) & 7)


@cuda.jit(device=True, inline=True)
def e4m3_of_s0e5m3(b, s):
    """S0E5M3 byte and scale factor 2^s -> the E4M3 byte of ``value / 2^s`` (round to nearest even, saturating at
    448, as the reference's float_to_e4m3)."""
    exp = b >> 3
    m = b & 7
    if exp == 31:
        return 0x7E if m == 0 else 0x7F  # fp16 inf saturates, NaN stays NaN
    if exp == 0:
        return 0  # an fp16 subnormal: far below E4M3's smallest subnormal
    e4 = exp - 15 - s
    if e4 > 15 or (e4 == 15 and m == 7):
        return 0x7E
    if e4 >= 1:
        return (e4 << 3) | m
    shift = 1 - e4
    if shift > 5:
        return 0
    full = 8 + m
    q = full >> shift
    rem = full & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    if rem > half or (rem == half and (q & 1) == 1):
        q += 1
    return q


# ---------------------------------------------------------------------------------------------------------------
# weights
# ---------------------------------------------------------------------------------------------------------------
def fp4_repack_source():
    def fp4_repack(src, out, size_n):
        """src uint8 [E, N, K/2]; out uint32 [E, K/16 * 2N] Marlin words."""
        per_expert = out.shape[1]
        n_tiles = size_n >> 6
        start = cuda.grid(1)
        stride = cuda.gridsize(1)
        for t in range(start, out.shape[0] * per_expert, stride):
            e = t // per_expert
            w = t - e * per_expert
            n0, col = fp4_word_source(w, n_tiles)
            b0 = uint32(src[e, n0, col])
            b1 = uint32(src[e, n0, col + 4])  # elements k + 8, k + 9
            b2 = uint32(src[e, n0 + 8, col])
            b3 = uint32(src[e, n0 + 8, col + 4])
            low = (b0 & uint32(15)) | ((b1 & uint32(15)) << uint32(4)) | ((b2 & uint32(15)) << uint32(8)) | \
                ((b3 & uint32(15)) << uint32(12))
            high = (b0 >> uint32(4)) | ((b1 >> uint32(4)) << uint32(4)) | ((b2 >> uint32(4)) << uint32(8)) | \
                ((b3 >> uint32(4)) << uint32(12))
            out[e, w] = low | (high << uint32(16))

    return fp4_repack


def fp4_unpack_source():
    def fp4_unpack(q, out, size_n):
        """q uint32 [E, K/16 * 2N]; out uint8 [E, N, K/2]: each word scatters its four bytes."""
        per_expert = q.shape[1]
        n_tiles = size_n >> 6
        start = cuda.grid(1)
        stride = cuda.gridsize(1)
        for t in range(start, q.shape[0] * per_expert, stride):
            e = t // per_expert
            w = t - e * per_expert
            n0, col = fp4_word_source(w, n_tiles)
            word = uint32(q[e, w])
            for j in range(4):
                lo = (word >> uint32(4 * j)) & uint32(15)
                hi = (word >> uint32(16 + 4 * j)) & uint32(15)
                out[e, n0 + 8 * (j >> 1), col + 4 * (j & 1)] = uint8(lo | (hi << uint32(4)))

    return fp4_unpack


# ---------------------------------------------------------------------------------------------------------------
# scales
# ---------------------------------------------------------------------------------------------------------------
def nvfp4_scales_source(gather: bool):
    """gather: from checkpoint scales [E, N, ng] (the whole route); else from permuted bytes [E, ng * N] (vLLM's
    process step only)."""

    def nvfp4_scales(src, out, ng, size_n, s, error):
        """out uint8 [E, ng * N]; error int64[6] = (NaN: lowest index, count; overflow: lowest p, count; negative:
        lowest p, count): NaN by its index in the source, the others by their pre-shuffle Marlin position, as the
        reference names them."""
        per_expert = out.shape[1]
        start = cuda.grid(1)
        stride = cuda.gridsize(1)
        for t in range(start, out.shape[0] * per_expert, stride):
            e = t // per_expert
            d = t - e * per_expert
            g, n, p = scale_source(d, ng, size_n)
            if gather:
                raw = int64(src[e, n, g])
                where = (e * size_n + n) * ng + g
            else:
                raw = int64(src[e, p])
                where = e * per_expert + p
            magnitude = raw & 0x7F
            if magnitude == 0x7F:
                cuda.atomic.min(error, 0, where)
                cuda.atomic.add(error, 1, 1)
                out[e, d] = uint8(0)
                continue
            if raw != magnitude and magnitude != 0:
                cuda.atomic.min(error, 4, e * per_expert + p)
                cuda.atomic.add(error, 5, 1)
            b = s0e5m3_of_e4m3(magnitude, s)
            if b > 0xFF:
                cuda.atomic.min(error, 2, e * per_expert + p)
                cuda.atomic.add(error, 3, 1)
                b = 0
            out[e, d] = uint8(b)

    return nvfp4_scales


def nvfp4_unscales_source():
    def nvfp4_unscales(raw, out, ng, size_n, s):
        """raw uint8 [E, ng * N] S0E5M3; out uint8 [E, N, ng] E4M3 (checkpoint order)."""
        per_expert = raw.shape[1]
        start = cuda.grid(1)
        stride = cuda.gridsize(1)
        for t in range(start, raw.shape[0] * per_expert, stride):
            e = t // per_expert
            d = t - e * per_expert
            g, n, p = scale_source(d, ng, size_n)
            out[e, n, g] = uint8(e4m3_of_s0e5m3(int64(raw[e, d]), s))

    return nvfp4_unscales


def mx_scales_source(gather: bool):
    def mx_scales(src, out, ng, size_n, error):
        """out uint8 [E, ng * N] E8M0 codes; error int64[2] = (lowest index of a NaN code 0xFF, count)."""
        per_expert = out.shape[1]
        start = cuda.grid(1)
        stride = cuda.gridsize(1)
        for t in range(start, out.shape[0] * per_expert, stride):
            e = t // per_expert
            d = t - e * per_expert
            g, n, p = scale_source(d, ng, size_n)
            if gather:
                code = src[e, n, g]
                where = (e * size_n + n) * ng + g
            else:
                code = src[e, p]
                where = e * per_expert + p
            if code == 0xFF:
                cuda.atomic.min(error, 0, where)
                cuda.atomic.add(error, 1, 1)
            out[e, d] = code

    return mx_scales


def mx_unscales_source():
    def mx_unscales(raw, out, ng, size_n):
        """raw uint8 [E, ng * N]; out uint8 [E, N, ng]: the inverse gather."""
        per_expert = raw.shape[1]
        start = cuda.grid(1)
        stride = cuda.gridsize(1)
        for t in range(start, raw.shape[0] * per_expert, stride):
            e = t // per_expert
            d = t - e * per_expert
            g, n, p = scale_source(d, ng, size_n)
            out[e, n, g] = raw[e, d]

    return mx_unscales


def smallest_scale_source():
    def smallest_scale(src, out):
        """src uint8 flat E4M3 bytes; out int64[1]: the smallest magnitude byte among non-zero, non-NaN positive
        scales (vLLM's minimum over positive scales), 0x7F when there is none."""
        start = cuda.grid(1)
        stride = cuda.gridsize(1)
        for i in range(start, src.size, stride):
            b = int64(src[i])
            if b != 0 and b < 0x7F:
                cuda.atomic.min(out, 0, b)

    return smallest_scale


@functools.lru_cache(maxsize=None)
def _kernel(name: str, *flags):
    sources = {"fp4_repack": fp4_repack_source, "fp4_unpack": fp4_unpack_source, "nvfp4_scales": nvfp4_scales_source,
               "nvfp4_unscales": nvfp4_unscales_source, "mx_scales": mx_scales_source,
               "mx_unscales": mx_unscales_source, "smallest_scale": smallest_scale_source}
    return cuda.jit(sources[name](*flags))


# ---------------------------------------------------------------------------------------------------------------
# host wrappers: check -> allocate -> launch (-> report)
# ---------------------------------------------------------------------------------------------------------------
def _bytes(arrays: Arrays, x, name: str, tail: tuple[int, ...]):
    """A uint8-like array [tail] or [E, tail] -> (device uint8 [E, tail], stacked?)."""
    if not is_device_array(x):
        x = np.asarray(x)
        require(x.dtype.itemsize == 1, f"{name} must hold bytes (uint8, float8), got {x.dtype}")
        x = x.view(np.uint8)
    d = arrays.take(x, name)
    require(np.dtype(d.dtype).itemsize == 1, f"{name} must hold bytes (uint8, float8), got {d.dtype}")
    d = d.view(np.uint8)
    shape = tuple(d.shape)
    if shape[-len(tail):] != tail or len(shape) not in (len(tail), len(tail) + 1):
        raise ValueError(f"{name} has shape {shape}, expected {tail} or (experts,) + {tail}")
    stacked = len(shape) == len(tail) + 1
    return d.reshape(((shape[0] if stacked else 1),) + tail), stacked


def _words(arrays: Arrays, x, name: str, rows: int, cols: int):
    d = arrays.take(x, name)
    require(np.dtype(d.dtype).itemsize == 4, f"{name} must hold int32 words, got {d.dtype}")
    d = d.view(np.uint32)
    shape = tuple(d.shape)
    if shape[-2:] != (rows, cols) or len(shape) not in (2, 3):
        raise ValueError(f"{name} has shape {shape}, expected ({rows}, {cols}) or (experts, {rows}, {cols})")
    stacked = len(shape) == 3
    return d.reshape(((shape[0] if stacked else 1), rows * cols)), stacked


def _give(arrays: Arrays, out, shape, stacked: bool, dtype=None):
    return arrays.give(out.reshape((out.shape[0],) + shape if stacked else shape), dtype)


def fp4_marlin_repack(weight_packed, size_k: int, size_n: int, *, stream=None):
    """E2M1 bytes uint8 [N, K/2] (or [E, N, K/2]) -> Marlin int32 [K/16, 2N]."""
    size_k, size_n = check_tile_sizes(size_k, size_n)
    arrays = Arrays(stream)
    src, stacked = _bytes(arrays, weight_packed, "weight_packed", (size_n, size_k // 2))
    out = arrays.empty((src.shape[0], size_k // 16 * 2 * size_n), np.uint32)
    _kernel("fp4_repack")[_blocks(out.size), THREADS, arrays.stream](src, out, size_n)
    return _give(arrays, out, (size_k // 16, 2 * size_n), stacked, np.int32)


def marlin_to_fp4(marlin_q, size_k: int, size_n: int, *, stream=None):
    """Inverse of fp4_marlin_repack: Marlin int32 [K/16, 2N] (or [E, ...]) -> E2M1 bytes uint8 [N, K/2]."""
    size_k, size_n = check_tile_sizes(size_k, size_n)
    arrays = Arrays(stream)
    q, stacked = _words(arrays, marlin_q, "marlin_q", size_k // 16, 2 * size_n)
    out = arrays.empty((q.shape[0], size_n, size_k // 2), np.uint8)
    _kernel("fp4_unpack")[_blocks(q.size), THREADS, arrays.stream](q, out, size_n)
    return _give(arrays, out, (size_n, size_k // 2), stacked)


def _error_slot(arrays: Arrays, slots: int):
    return arrays.take(np.array([NO_ERROR, 0] * slots, dtype=np.int64), "error")


def _log2(scale_factor: float) -> int:
    sf = fm._check_scale_factor(scale_factor)
    return int(np.frexp(sf)[1] - 1)


def _value_at(d, flat: int) -> int:
    return int(copy_to_host_checked(d.reshape((d.size,))[flat:flat + 1], cuda.default_stream())[0])


def _report_nvfp4(arrays: Arrays, error, src, sf: float, stacked: bool, shape: tuple[int, ...], name: str,
                  marlin_shape: tuple[int, int], gather: bool) -> None:
    """Raise or warn what the NVFP4 scale kernel marked, with the reference's messages."""
    host = copy_to_host_checked(error, arrays.stream)
    lead = (src.shape[0],) if stacked else ()

    def at(flat: int, dims: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(int(i) for i in np.unravel_index(flat, lead + dims))

    def value(p_flat: int) -> float:  # the scale behind pre-shuffle Marlin position p (of all experts)
        e, p = divmod(p_flat, marlin_shape[0] * marlin_shape[1])
        if gather:
            ng, size_n = marlin_shape
            perm = SCALE_PERM_64 if ng > 1 else SCALE_PERM_32
            lane = p % perm.size
            g, n = divmod(p - lane + int(perm[lane]), size_n)
            p_flat = (e * size_n + n) * ng + g
        return float(np.array([_value_at(src, p_flat)], np.uint8).view(ms.E4M3).astype(np.float32)[0])

    if host[0] != NO_ERROR:
        raise ValueError(f"{name}[{ms._where(at(int(host[0]), shape))}] = {_value_at(src, int(host[0])):#04x} is "
                         f"E4M3's NaN ({int(host[1])} such)")
    if host[2] != NO_ERROR:
        v = value(int(host[2]))
        raise ValueError(f"marlin_scales[{ms._where(at(int(host[2]), marlin_shape))}] = {v!r}: · scale_factor {sf:g}"
                         f" · 2^7 = {abs(v) * sf * 2.0 ** fm.S0E5M3_SHIFT:g} exceeds fp16's {fm.FP16_MAX:g}"
                         f" ({int(host[3])} such); the S0E5M3 byte cannot hold it (a bf16 layer whose scales span"
                         " more than fp16's range after vLLM's rescale)")
    if host[4] != NO_ERROR:
        warnings.warn(f"marlin_scales[{ms._where(at(int(host[4]), marlin_shape))}] = {value(int(host[4]))!r} is "
                      f"negative ({int(host[5])} such): the S0E5M3 byte has no sign bit, so the kernel will use its "
                      "magnitude and those groups dequantize with the wrong sign", RuntimeWarning, stacklevel=3)


def _scale_factor_on_device(arrays: Arrays, src, a_dtype) -> float:
    if np.dtype(a_dtype) == ms.F16:
        return 1.0
    out = arrays.take(np.array([0x7F], np.int64), "smallest")
    flat = src.reshape((src.size,))
    _kernel("smallest_scale")[_blocks(src.size), THREADS, arrays.stream](flat, out)
    smallest = int(copy_to_host_checked(out, arrays.stream)[0])
    return 1.0 if smallest == 0x7F else fm.nvfp4_scale_factor(np.array([[smallest]], np.uint8), a_dtype)


def nvfp4_marlin_scales(weight_scale, size_k: int, size_n: int, a_dtype=np.float16, scale_factor=None, *,
                        stream=None):
    """Checkpoint E4M3 scales [N, K/16] (or [E, N, K/16]) -> (S0E5M3 bytes uint8 [K/16, N], scale_factor)."""
    size_k, size_n = check_tile_sizes(size_k, size_n)
    ng = size_k // 16
    arrays = Arrays(stream)
    src, stacked = _bytes(arrays, weight_scale, "weight_scale", (size_n, ng))
    sf = _scale_factor_on_device(arrays, src, a_dtype) if scale_factor is None else fm._check_scale_factor(
        scale_factor)
    out = arrays.empty((src.shape[0], ng * size_n), np.uint8)
    error = _error_slot(arrays, 3)
    _kernel("nvfp4_scales", True)[_blocks(out.size), THREADS, arrays.stream](src, out, ng, size_n, _log2(sf), error)
    _report_nvfp4(arrays, error, src, sf, stacked, (size_n, ng), "weight_scale", (ng, size_n), True)
    return _give(arrays, out, (ng, size_n), stacked), sf


def nvfp4_marlin_process_scales(marlin_scales, scale_factor=None, a_dtype=None, *, stream=None):
    """Permuted NVFP4 scales [ng, N] -> (S0E5M3 bytes, scale_factor). Device input: E4M3 bytes; host input may be
    any float dtype holding E4M3 values (checked and turned into bytes on the host first)."""
    if not is_device_array(marlin_scales):
        marlin_scales = ms.float_to_e4m3(fm.e4m3_exact_values(marlin_scales, "marlin_scales")) if np.asarray(
            marlin_scales).dtype not in (np.dtype(np.uint8), ms.E4M3) else np.asarray(marlin_scales)
    elif np.dtype(marlin_scales.dtype).itemsize != 1:
        raise TypeError(f"marlin_scales on the device must be E4M3 bytes (uint8), got {marlin_scales.dtype}")
    a_dtype = ms.F16 if a_dtype is None else np.dtype(a_dtype)
    arrays = Arrays(stream)
    shape = tuple(marlin_scales.shape)
    require(len(shape) == 2, f"marlin_scales must be 2-D, got shape {shape}")
    src, _ = _bytes(arrays, marlin_scales, "marlin_scales", shape)
    src = src.reshape((1, shape[0] * shape[1]))
    sf = _scale_factor_on_device(arrays, src, a_dtype) if scale_factor is None else fm._check_scale_factor(
        scale_factor)
    out = arrays.empty((1, shape[0] * shape[1]), np.uint8)
    error = _error_slot(arrays, 3)
    _kernel("nvfp4_scales", False)[_blocks(out.size), THREADS, arrays.stream](src, out, 1, shape[1], _log2(sf), error)
    _report_nvfp4(arrays, error, src, sf, False, shape, "marlin_scales", shape, False)
    return arrays.give(out.reshape(shape)), sf


def marlin_to_nvfp4_scales(marlin_scales, size_k: int, size_n: int, scale_factor: float = 1.0, *, stream=None):
    """Inverse of nvfp4_marlin_scales: S0E5M3 bytes [K/16, N] (or [E, ...]) -> E4M3 bytes uint8 [N, K/16]."""
    size_k, size_n = check_tile_sizes(size_k, size_n)
    ng = size_k // 16
    arrays = Arrays(stream)
    raw, stacked = _bytes(arrays, marlin_scales, "marlin_scales", (ng, size_n))
    raw = raw.reshape((raw.shape[0], ng * size_n))
    out = arrays.empty((raw.shape[0], size_n, ng), np.uint8)
    _kernel("nvfp4_unscales")[_blocks(raw.size), THREADS, arrays.stream](raw, out, ng, size_n, _log2(scale_factor))
    return _give(arrays, out, (size_n, ng), stacked)


def _report_nan_code(arrays: Arrays, error, stacked: bool, experts: int, shape, name: str) -> None:
    host = copy_to_host_checked(error, arrays.stream)
    if host[0] != NO_ERROR:
        at = tuple(int(i) for i in np.unravel_index(int(host[0]), ((experts,) if stacked else ()) + shape))
        raise ValueError(f"{name}[{ms._where(at)}] = 0xFF is E8M0's NaN code, not a scale ({int(host[1])} such "
                         "code(s)); a group with a NaN scale has no value")


def mx_marlin_scales(weight_scale, size_k: int, size_n: int, fmt: str = "mxfp4", *, stream=None):
    """Checkpoint E8M0 codes [N, K/32] (or [E, ...]) -> Marlin E8M0 codes uint8 [K/32, N]."""
    size_k, size_n = check_tile_sizes(size_k, size_n)
    ng = size_k // ms.microscale_format(fmt).group_size
    arrays = Arrays(stream)
    src, stacked = _bytes(arrays, weight_scale, "weight_scale", (size_n, ng))
    out = arrays.empty((src.shape[0], ng * size_n), np.uint8)
    error = _error_slot(arrays, 1)
    _kernel("mx_scales", True)[_blocks(out.size), THREADS, arrays.stream](src, out, ng, size_n, error)
    _report_nan_code(arrays, error, stacked, src.shape[0], (size_n, ng), "weight_scale")
    return _give(arrays, out, (ng, size_n), stacked)


def mx_marlin_process_scales(marlin_scales, *, stream=None):
    """Permuted MX scales [ng, N] -> shuffled E8M0 codes. Device input: codes (uint8); host input may be bf16 or
    float32 powers of two (turned into codes on the host first)."""
    if not is_device_array(marlin_scales):
        marlin_scales = fm.e8m0_codes_of(np.asarray(marlin_scales), "marlin_scales") if np.asarray(
            marlin_scales).dtype not in (np.dtype(np.uint8), ms.E8M0) else np.asarray(marlin_scales)
    arrays = Arrays(stream)
    shape = tuple(marlin_scales.shape)
    require(len(shape) == 2, f"marlin_scales must be 2-D, got shape {shape}")
    src, _ = _bytes(arrays, marlin_scales, "marlin_scales", shape)
    src = src.reshape((1, shape[0] * shape[1]))
    out = arrays.empty((1, shape[0] * shape[1]), np.uint8)
    error = _error_slot(arrays, 1)
    _kernel("mx_scales", False)[_blocks(out.size), THREADS, arrays.stream](src, out, 1, shape[1], error)
    _report_nan_code(arrays, error, False, 1, shape, "marlin_scales")
    return arrays.give(out.reshape(shape))


def marlin_to_mx_scales(marlin_scales, size_k: int, size_n: int, fmt: str = "mxfp4", *, stream=None):
    """Inverse of mx_marlin_scales: Marlin codes [K/32, N] (or [E, ...]) -> checkpoint codes uint8 [N, K/32]."""
    size_k, size_n = check_tile_sizes(size_k, size_n)
    ng = size_k // ms.microscale_format(fmt).group_size
    arrays = Arrays(stream)
    raw, stacked = _bytes(arrays, marlin_scales, "marlin_scales", (ng, size_n))
    raw = raw.reshape((raw.shape[0], ng * size_n))
    out = arrays.empty((raw.shape[0], size_n, ng), np.uint8)
    _kernel("mx_unscales")[_blocks(raw.size), THREADS, arrays.stream](raw, out, ng, size_n)
    return _give(arrays, out, (size_n, ng), stacked)


def compile_targets():
    """(name, python function, argument types) of every kernel variant here, for the offline compile check."""
    from numba import types

    def arr(dt, nd):
        return types.Array(dt, nd, "C")

    u8, u32, i64 = types.uint8, types.uint32, types.int64
    yield "fp4_repack", fp4_repack_source(), (arr(u8, 3), arr(u32, 2), i64)
    yield "fp4_unpack", fp4_unpack_source(), (arr(u32, 2), arr(u8, 3), i64)
    yield "nvfp4_scales[gather]", nvfp4_scales_source(True), (arr(u8, 3), arr(u8, 2), i64, i64, i64, arr(i64, 1))
    yield "nvfp4_scales[process]", nvfp4_scales_source(False), (arr(u8, 2), arr(u8, 2), i64, i64, i64, arr(i64, 1))
    yield "nvfp4_unscales", nvfp4_unscales_source(), (arr(u8, 2), arr(u8, 3), i64, i64, i64)
    yield "mx_scales[gather]", mx_scales_source(True), (arr(u8, 3), arr(u8, 2), i64, i64, arr(i64, 1))
    yield "mx_scales[process]", mx_scales_source(False), (arr(u8, 2), arr(u8, 2), i64, i64, arr(i64, 1))
    yield "mx_unscales", mx_unscales_source(), (arr(u8, 2), arr(u8, 3), i64, i64)
    yield "smallest_scale", smallest_scale_source(), (arr(u8, 1), arr(i64, 1))
