"""Public ops: vLLM's names and argument order where vLLM has the op, ferrum-kernels' names for its operations
(docs/formats.md, Sources).

Every op takes ``backend=`` (``"auto"``, ``"numpy"``, ``"numba"``, ``"cpu"``: the compiled host loops of
``workbench.host_repack``) and ``stream=`` keywords; ``workbench.backends`` picks the implementation. Before any
work, on every backend, each op applies the same rules, written once in
``workbench.formats._checks`` (ValueError/TypeError naming the offending values); it never mutates its inputs:

* **scalars** (sizes, ``num_bits``, ``group_size``) are Python or NumPy integers, handed on as Python ints;
  floats (even 4.0), bools and strings are refused.
* **arrays** are NumPy or CUDA arrays. A host array that is big-endian, Fortran-ordered or strided is converted
  once, on entry, to a native C-contiguous copy; a list is refused (it has no dtype, and the dtype is part of
  every format). A device array is used in place, so it must be C-contiguous and in native byte order.
* **metadata** (dtype, shape, contiguity) is checked from ``.shape``/``.dtype``/flags, the same for host and device.
* **shapes**: any (size_k, size_n) the input format can hold (K a multiple of the pack factor for GPTQ rows and
  K-major FP8 words, N for AWQ and qzeros columns; a last group or 128-block may be partial). Marlin outputs are the
  Marlin arrays of the weight zero-padded to K_pad = ceil(K/16)*16 rows and N_pad = ceil(N/64)*64 columns
  (scales and zero points: N_pad columns, the padded ones 0); inverses take the true sizes and return exactly the
  checkpoint tensor (docs/formats.md, "Shapes that are not tile multiples").
* **values**: a host ``perm`` must be a permutation of range(K) (judged before any cast), host zero-point codes must
  fit ``num_bits``; host NaN/Inf scales are kept with a RuntimeWarning. Device values are checked on the device by
  the kernels that read them (``kernels_numba``): the same rule and message, raised before the result is returned,
  and no value can make a kernel read out of bounds.

On device arrays (CuPy, PyTorch) an op's checks and launches are kept as a call plan per argument metadata
(``backends.run_planned``): a repeated call with the same shapes, dtypes, strides, devices and scalars costs its
launches and output allocation alone. Outputs come from the caller's framework pool (torch tensors for torch
inputs, CuPy arrays otherwise).
"""
from __future__ import annotations

import functools
from typing import Any, Sequence

import numpy as np

from workbench import backends
from workbench.formats import fp8 as _fp8
from workbench.formats import gptq as _gptq
from workbench.formats import marlin_tile as _tile
from workbench.formats import packing as _packing
from workbench.formats import scales as _scales
from workbench.formats._checks import (check_bits, check_int, check_permutation_values, check_size,
                                       check_weight_sizes, padded_n, require, require_codes_in_range,
                                       require_contiguous, require_pack_multiple,
                                       require_dtype, require_integer_dtype, require_native_byte_order,
                                       require_ndim, require_rows, require_shape, v1_zero_message, warn_nonfinite)
from workbench.scalar_types import ScalarType
from workbench.weight import MarlinWeight

INT_WORDS = (np.int32, np.uint32)
SCALE_DTYPES = (np.float16, _fp8.BF16, np.float32)


# ---------------------------------------------------------------------------------------------------------------
# shared validation: every op runs these before dispatch, so both backends see exactly the same rules
# ---------------------------------------------------------------------------------------------------------------
def _array(x: Any, name: str) -> Any:
    """The one conversion on entry (backends.normalize: device arrays to Numba, host arrays to native C order,
    lists refused), then the metadata every kernel relies on: native byte order (device arrays are not copied)."""
    x = backends.normalize(x, name)
    require_native_byte_order(x, name)
    return x


def _check_words(x: Any, shape: tuple[int, ...], name: str, hint: str) -> None:
    require_dtype(x, INT_WORDS, name)
    require_ndim(x, len(shape), name)
    require_shape(x, shape, name, hint)
    require_contiguous(x, name)


def _check_perm(perm: Any, size_k: int) -> Any:
    """None / empty -> None. A host perm is checked by value (any integer width, before any cast: a value offset by
    2^32 must not wrap into range) and handed on as int32; a device perm must be int32 already, and its values are
    checked on the device by the kernels that read it (kernels_numba.marlin_repack.check_perm_on_device)."""
    if perm is None or getattr(perm, "size", 1) == 0:
        return None
    perm = _array(perm, "perm")
    require_ndim(perm, 1, "perm")
    require_integer_dtype(perm, "perm", "integer row indices")
    require(perm.shape[0] == size_k, f"Unexpected perm.size(-1) = {perm.shape[0]}, where size_k = {size_k}")
    if backends.is_device_array(perm):
        require_dtype(perm, (np.int32,), "perm")
        require_contiguous(perm, "perm")
        return perm
    check_permutation_values(perm, size_k)
    return perm.astype(np.int32)  # every value is in [0, size_k): exact


def _check_codes(zp: Any, num_bits: int, name: str) -> None:
    """Zero-point codes: integers that fit num_bits. Host values are checked here; device codes (uint8) by the
    zero-point kernel, which reports the first offender with the same message."""
    require_integer_dtype(zp, name)
    if not backends.is_device_array(zp):
        require_codes_in_range(zp, num_bits, name)


def _marlin_shape(size_k: int, size_n: int, bits: int) -> tuple[int, int]:
    return _tile.marlin_qweight_shape(size_k, size_n, bits)


def _gptq_sizes(size_k, size_n, num_bits) -> tuple[int, int, int, int]:
    """(size_k, size_n, num_bits, pf) of a weight whose checkpoint form packs pf rows per word (GPTQ, FP8 raw)."""
    num_bits = check_bits(num_bits)
    size_k, size_n = check_weight_sizes(size_k, size_n)
    pf = _packing.pack_factor(num_bits)
    require_pack_multiple(size_k, pf, "size_k", f"GPTQ packs {pf} rows of {num_bits}-bit codes per word")
    return size_k, size_n, num_bits, pf


def _awq_sizes(size_k, size_n, num_bits) -> tuple[int, int, int, int]:
    """(size_k, size_n, num_bits, pf) of a weight whose checkpoint form packs pf columns per word (AWQ)."""
    num_bits = check_bits(num_bits)
    size_k, size_n = check_weight_sizes(size_k, size_n)
    pf = _packing.pack_factor(num_bits)
    require_pack_multiple(size_n, pf, "size_n", f"AWQ packs {pf} columns of {num_bits}-bit codes per word")
    return size_k, size_n, num_bits, pf


def _planned(op):
    """An op whose device calls go through a call plan (``backends.run_planned``): after the first call with some
    argument metadata, the checks' verdict and the launches are reused, so a call costs the launches alone."""
    @functools.wraps(op)
    def call(*args, backend: str = "auto", stream=None, **kwargs):
        if backend in ("numpy", "cpu"):  # host arrays: nothing to plan
            return op(*args, backend=backend, stream=stream, **kwargs)
        return backends.run_planned(op, args, kwargs, backend, stream)

    return call


# ---------------------------------------------------------------------------------------------------------------
# weights
# ---------------------------------------------------------------------------------------------------------------
@_planned
def gptq_marlin_repack(b_q_weight, perm, size_k: int, size_n: int, num_bits: int, *, backend: str = "auto",
                       stream=None):
    """GPTQ qweight int32 [K/pf, N] -> Marlin int32 [K_pad/16, N_pad*16/pf]; with perm, Marlin row k = checkpoint
    row perm[k]."""
    b_q_weight = _array(b_q_weight, "b_q_weight")
    size_k, size_n, num_bits, pf = _gptq_sizes(size_k, size_n, num_bits)
    _check_words(b_q_weight, (size_k // pf, size_n), "b_q_weight", f"size_k / pack_factor = {size_k} / {pf}, size_n")
    perm = _check_perm(perm, size_k)

    def reference(q, p, k, n, bits):
        return _tile.marlin_repack_codes(_packing.unpack_rows(q, bits), bits, p)

    return backends.dispatch("gptq_marlin_repack", backend, stream, reference, b_q_weight, perm, size_k, size_n,
                             num_bits)


@_planned
def awq_marlin_repack(b_q_weight, size_k: int, size_n: int, num_bits: int, *, backend: str = "auto", stream=None):
    """AWQ qweight int32 [K, N/pf] (interleaved along N) -> Marlin int32 [K_pad/16, N_pad*16/pf]."""
    b_q_weight = _array(b_q_weight, "b_q_weight")
    size_k, size_n, num_bits, pf = _awq_sizes(size_k, size_n, num_bits)
    _check_words(b_q_weight, (size_k, size_n // pf), "b_q_weight", f"size_k, size_n / pack_factor = {size_n} / {pf}")

    def reference(q, k, n, bits):
        return _tile.marlin_repack_codes(_packing.awq_unpack(q, bits), bits)

    return backends.dispatch("awq_marlin_repack", backend, stream, reference, b_q_weight, size_k, size_n, num_bits)


@_planned
def fp8_marlin_repack_raw_bits(raw_bits_k_major, size_k: int, size_n: int, *, backend: str = "auto", stream=None):
    """K-major raw E4M3 words [K/4, N] (int32 or uint32) -> Marlin W8A16 tiles int32 [K_pad/16, 4*N_pad]."""
    raw_bits_k_major = _array(raw_bits_k_major, "raw_bits_k_major")
    size_k, size_n, _, _ = _gptq_sizes(size_k, size_n, 8)
    _check_words(raw_bits_k_major, (size_k // 4, size_n), "raw_bits_k_major", "[K/4, N]")
    return backends.dispatch("fp8_marlin_repack_raw_bits", backend, stream, _fp8.fp8_marlin_repack_raw_bits,
                             raw_bits_k_major, size_k, size_n)


@_planned
def block_fp8_group128_repack(row_major, size_k: int, size_n: int, *, backend: str = "auto", stream=None):
    """Row-major E4M3 [N, K] (uint8 or float8_e4m3fn) -> Marlin int32 [K_pad/16, 4*N_pad], transpose fused into
    tiling."""
    row_major = _array(row_major, "row_major")
    size_k, size_n = _fp8.check_block_fp8_shapes(size_k, size_n)
    require_dtype(row_major, (np.uint8, _fp8.E4M3), "row_major")
    require_shape(row_major, (size_n, size_k), "row_major", "[N, K]")
    require_contiguous(row_major, "row_major")
    return backends.dispatch("block_fp8_group128_repack", backend, stream, _fp8.block_fp8_group128_repack,
                             row_major, size_k, size_n)


# ---------------------------------------------------------------------------------------------------------------
# scales and zero points
# ---------------------------------------------------------------------------------------------------------------
def _check_scale_tensor(s, size_k: int, size_n: int, group_size: int, name: str = "s",
                        marlin: bool = False) -> tuple[int, int, int]:
    """-> (size_k, size_n, group_size) as ints, after the checks of a scale tensor [ng, N] (``marlin``: the
    Marlin form [ng, N_pad])."""
    size_k = check_size(size_k, "size_k")
    group_size = _scales.check_group_size(size_k, group_size)
    size_n = check_size(size_n, "size_n")
    ng = _scales.num_groups(size_k, group_size)
    require_ndim(s, 2, name)
    cols, what = (padded_n(size_n), "N_pad = ceil(size_n / 64) * 64") if marlin else (size_n, "size_n")
    require_shape(s, (ng, cols), name, f"[num_groups = {ng}, {what}] for size_k = {size_k}, size_n = {size_n}, "
                  f"group_size = {group_size}")
    require_contiguous(s, name)
    return size_k, size_n, group_size


def _check_zp_sizes(size_k: int, size_n: int, num_bits: int) -> tuple[int, int, int]:
    """(size_k, size_n, num_bits) of a zero-point op as ints: K is not used by the transform but must be a size."""
    return check_size(size_k, "size_k"), check_size(size_n, "size_n"), check_bits(num_bits)


def _check_scale_dtype(s, name: str = "s") -> None:
    """Scales the GEMM reads: float16, bfloat16 or float32 (on the device also their raw 16-bit words: CuPy has no
    bfloat16)."""
    require_dtype(s, SCALE_DTYPES + ((np.uint16,) if backends.is_device_array(s) else ()), name)


@_planned
def marlin_permute_scales(s, size_k: int, size_n: int, group_size: int, *, backend: str = "auto", stream=None):
    """Scales [ng, N] (float16, bfloat16 or float32) -> Marlin order [ng, N_pad] (padded columns 0): 64-wide
    permutation when grouped (ng > 1), 32-wide otherwise."""
    s = _array(s, "s")
    _check_scale_dtype(s)
    size_k, size_n, group_size = _check_scale_tensor(s, size_k, size_n, group_size)
    warn_nonfinite(s, "s")
    return backends.dispatch("marlin_permute_scales", backend, stream, _scales.permute_scales, s, size_k, size_n,
                             group_size)


@_planned
def marlin_zero_points(zp, size_k: int, size_n: int, num_bits: int, *, backend: str = "auto", stream=None):
    """Zero-point codes [ng, N] (any integer dtype, each in [0, 2^bits)) -> Marlin zero points int32
    [ng, N_pad/pf] (padded codes 0)."""
    zp = _array(zp, "zp")
    size_k, size_n, num_bits = _check_zp_sizes(size_k, size_n, num_bits)
    require_ndim(zp, 2, "zp")
    require(zp.shape[1] == size_n, f"zp has shape {tuple(zp.shape)}, expected {size_n} columns (size_n)")
    require_rows(zp, "zp")
    require_contiguous(zp, "zp")
    _check_codes(zp, num_bits, "zp")
    return backends.dispatch("marlin_zero_points", backend, stream, _scales.zero_points_to_marlin, zp, size_k, size_n,
                             num_bits)


def _check_packed_zeros(q, size_k: int, size_n: int, num_bits: int, name: str,
                        marlin: bool) -> tuple[Any, int, int, int]:
    """Column-packed zero points -> (array, size_k, size_n, num_bits): the Marlin form [ng, N_pad/pf]
    (``marlin``), or AWQ's [ng, N/pf], whose N fills whole words."""
    q = _array(q, name)
    size_k, size_n, num_bits = _check_zp_sizes(size_k, size_n, num_bits)
    pf = _packing.pack_factor(num_bits)
    require_ndim(q, 2, name)
    if marlin:
        _check_words(q, (q.shape[0], padded_n(size_n) // pf), name, f"[num_groups, N_pad / {pf}] for size_n = "
                     f"{size_n}")
    else:
        require_pack_multiple(size_n, pf, "size_n", f"AWQ packs {pf} zero points per word")
        _check_words(q, (q.shape[0], size_n // pf), name, f"[num_groups, size_n / {pf}]")
    require_rows(q, name)
    return q, size_k, size_n, num_bits


@_planned
def awq_to_marlin_zero_points(q_zp_packed, size_k: int, size_n: int, num_bits: int, *, backend: str = "auto",
                              stream=None):
    """AWQ qzeros int32 [ng, N/pf] (interleaved) -> Marlin zero points int32 [ng, N_pad/pf]."""
    q_zp_packed, size_k, size_n, num_bits = _check_packed_zeros(q_zp_packed, size_k, size_n, num_bits, "q_zp_packed",
                                                                False)

    def reference(q, k, n, bits):
        return _scales.zero_points_to_marlin(_packing.awq_unpack(q, bits), k, n, bits)

    return backends.dispatch("awq_to_marlin_zero_points", backend, stream, reference, q_zp_packed, size_k, size_n,
                             num_bits)


@_planned
def repack_gptq_qzeros_to_marlin(qzeros, size_k: int, size_n: int, group_size: int, num_bits: int = 4, *,
                                 backend: str = "auto", stream=None):
    """GPTQ v1 qzeros [ceil(K/G), N/pf] (stored zero - 1) -> Marlin zero points [ceil(K/G), N_pad/pf]; a stored
    all-ones field is an error."""
    qzeros = _array(qzeros, "qzeros")
    num_bits = check_bits(num_bits)
    size_k = check_size(size_k, "size_k")
    group_size = _scales.check_group_size(size_k, group_size)
    size_n = check_size(size_n, "size_n")
    pf = _packing.pack_factor(num_bits)
    require_pack_multiple(size_n, pf, "size_n", f"GPTQ qzeros pack {pf} zero points per word")
    ng = _scales.num_groups(size_k, group_size)
    _check_words(qzeros, (ng, size_n // pf), "qzeros", f"[K/G, N/{pf}] for K = {size_k}, N = {size_n}, "
                 f"group_size = {group_size}")
    return backends.dispatch("repack_gptq_qzeros_to_marlin", backend, stream, _gptq.repack_gptq_qzeros_to_marlin,
                             qzeros, size_k, size_n, group_size, num_bits)


def gptq_qzeros_are_symmetric_code7(qzeros, num_bits: int = 4, *, backend: str = "auto", stream=None) -> bool:
    """True when every v1 stored zero is 7 (4-bit; 127 for 8-bit): symmetric GPTQ, no zero points needed."""
    qzeros = _array(qzeros, "qzeros")
    num_bits = check_bits(num_bits)
    require_dtype(qzeros, INT_WORDS, "qzeros")
    require_contiguous(qzeros, "qzeros")
    return bool(backends.dispatch("gptq_qzeros_are_symmetric_code7", backend, stream,
                                  _gptq.gptq_qzeros_are_symmetric_code7, qzeros, num_bits))


@_planned
def block_fp8_group128_scales(inverse_scales, size_k: int, size_n: int, act_dtype=np.float16, *,
                              backend: str = "auto", stream=None):
    """Block-FP8 inverse scales [ceil(N/128), ceil(K/128)] (bf16 or float32) -> Marlin scales [ceil(K/128), N_pad]
    in act_dtype (padded columns 0).

    fp16: ``f16(inv * 256)``; bf16: ``bf16(inv * 2^120)``; 32-wide permutation for K = 128, 64-wide otherwise.
    On the device, where CuPy has no bfloat16, bf16 inverse scales may come as their uint16 bit patterns.
    """
    inverse_scales = _array(inverse_scales, "inverse_scales")
    size_k, size_n = _fp8.check_block_fp8_shapes(size_k, size_n)
    _fp8.exponent_bias(act_dtype)
    allowed = (_fp8.BF16, np.float32) + ((np.uint16,) if backends.is_device_array(inverse_scales) else ())
    require_dtype(inverse_scales, allowed, "inverse_scales")
    require_shape(inverse_scales, _fp8.block_scale_shape(size_k, size_n), "inverse_scales",
                  f"[ceil(N/128), ceil(K/128)] for K = {size_k}, N = {size_n}")
    require_contiguous(inverse_scales, "inverse_scales")
    warn_nonfinite(inverse_scales, "inverse_scales")
    return backends.dispatch("block_fp8_group128_scales", backend, stream, _fp8.block_fp8_group128_scales,
                             inverse_scales, size_k, size_n, np.dtype(act_dtype))


# ---------------------------------------------------------------------------------------------------------------
# inverses (Marlin -> checkpoint layout), for debugging and verification
# ---------------------------------------------------------------------------------------------------------------
def _check_marlin_q(marlin_q, size_k: int, size_n: int, num_bits: int, sizes=None) -> tuple[Any, int, int, int]:
    """Marlin tiles [K_pad/16, N_pad*16/pf] -> (array, size_k, size_n, num_bits) after the shared checks;
    ``sizes``: the target format's size rule (_gptq_sizes / _awq_sizes; default: any positive sizes)."""
    marlin_q = _array(marlin_q, "marlin_q")
    if sizes is None:
        num_bits = check_bits(num_bits)
        size_k, size_n = check_weight_sizes(size_k, size_n)
    else:
        size_k, size_n, num_bits, _ = sizes(size_k, size_n, num_bits)
    _check_words(marlin_q, _marlin_shape(size_k, size_n, num_bits), "marlin_q",
                 f"[K_pad/16, N_pad*16/pf], {num_bits}-bit, K = {size_k}, N = {size_n}")
    return marlin_q, size_k, size_n, num_bits


def _codes_in_checkpoint_order(marlin_q, size_k: int, size_n: int, num_bits: int, perm) -> np.ndarray:
    """Marlin tiles (checked) -> codes [K, N], rows put back through a checked int32 perm (or none)."""
    codes = _tile.marlin_unpack_codes(marlin_q, size_k, size_n, num_bits)
    if perm is None:
        return codes
    out = np.empty_like(codes)
    out[perm] = codes
    return out


def marlin_to_codes(marlin_q, size_k: int, size_n: int, num_bits: int, perm=None):
    """Marlin tiles -> codes [K, N] in checkpoint row order (undoing perm when given). NumPy only (for pictures
    and element-level debugging)."""
    marlin_q, size_k, size_n, num_bits = _check_marlin_q(marlin_q, size_k, size_n, num_bits)
    perm = _check_perm(perm, size_k)
    if backends.is_device_array(marlin_q) or backends.is_device_array(perm):
        raise TypeError("marlin_to_codes runs in NumPy only; pass NumPy arrays")
    return _codes_in_checkpoint_order(marlin_q, size_k, size_n, num_bits, perm)


@_planned
def marlin_to_gptq_qweight(marlin_q, perm, size_k: int, size_n: int, num_bits: int, *, backend: str = "auto",
                           stream=None):
    """Inverse of gptq_marlin_repack: Marlin tiles -> GPTQ qweight int32 [K/pf, N] in checkpoint row order."""
    marlin_q, size_k, size_n, num_bits = _check_marlin_q(marlin_q, size_k, size_n, num_bits, _gptq_sizes)
    perm = _check_perm(perm, size_k)

    def reference(q, p, k, n, bits):
        return _packing.pack_rows(_codes_in_checkpoint_order(q, k, n, bits, p), bits)

    return backends.dispatch("marlin_to_gptq_qweight", backend, stream, reference, marlin_q, perm, size_k, size_n,
                             num_bits)


def _inverse(op_name: str, reference, marlin_q, size_k: int, size_n: int, num_bits: int, backend: str, stream,
             pass_bits: bool, sizes):
    marlin_q, size_k, size_n, num_bits = _check_marlin_q(marlin_q, size_k, size_n, num_bits, sizes)
    extra = (num_bits,) if pass_bits else ()
    return backends.dispatch(op_name, backend, stream, reference, marlin_q, size_k, size_n, *extra)


@_planned
def marlin_to_awq_qweight(marlin_q, size_k: int, size_n: int, num_bits: int, *, backend: str = "auto", stream=None):
    """Inverse of awq_marlin_repack: Marlin tiles -> AWQ qweight int32 [K, N/pf]."""
    return _inverse("marlin_to_awq_qweight",
                    lambda q, k, n, bits: _packing.awq_pack(_tile.marlin_unpack_codes(q, k, n, bits), bits),
                    marlin_q, size_k, size_n, num_bits, backend, stream, True, _awq_sizes)


@_planned
def marlin_to_fp8_raw_bits(marlin_q, size_k: int, size_n: int, *, backend: str = "auto", stream=None):
    """Inverse of fp8_marlin_repack_raw_bits: Marlin tiles -> K-major raw words int32 [K/4, N]."""
    return _inverse("marlin_to_fp8_raw_bits",
                    lambda q, k, n: _packing.pack_rows(_tile.marlin_unpack_codes(q, k, n, 8), 8),
                    marlin_q, size_k, size_n, 8, backend, stream, False, _gptq_sizes)


@_planned
def marlin_to_block_fp8(marlin_q, size_k: int, size_n: int, *, backend: str = "auto", stream=None):
    """Inverse of block_fp8_group128_repack: Marlin tiles -> row-major E4M3 bytes uint8 [N, K]."""
    return _inverse("marlin_to_block_fp8", _fp8.marlin_to_row_major_fp8, marlin_q, size_k, size_n, 8, backend,
                    stream, False, _block_fp8_sizes)


def _block_fp8_sizes(size_k, size_n, num_bits):
    size_k, size_n = _fp8.check_block_fp8_shapes(size_k, size_n)
    return size_k, size_n, 8, 4


@_planned
def marlin_unpermute_scales(s, size_k: int, size_n: int, group_size: int, *, backend: str = "auto", stream=None):
    """Inverse of marlin_permute_scales: Marlin [ng, N_pad] -> [ng, N]."""
    s = _array(s, "s")
    _check_scale_dtype(s)
    size_k, size_n, group_size = _check_scale_tensor(s, size_k, size_n, group_size, marlin=True)
    warn_nonfinite(s, "s")
    return backends.dispatch("marlin_unpermute_scales", backend, stream, _scales.unpermute_scales, s, size_k, size_n,
                             group_size)


@_planned
def marlin_zero_points_to_codes(zp_packed, size_k: int, size_n: int, num_bits: int, *, backend: str = "auto",
                                stream=None):
    """Inverse of marlin_zero_points: int32 [ng, N_pad/pf] -> codes uint8 [ng, N]."""
    zp_packed, size_k, size_n, num_bits = _check_packed_zeros(zp_packed, size_k, size_n, num_bits, "zp_packed", True)
    return backends.dispatch("marlin_zero_points_to_codes", backend, stream,
                             lambda z, k, n, bits: _scales.marlin_zero_points_to_codes(z, n, bits),
                             zp_packed, size_k, size_n, num_bits)


@_planned
def marlin_to_awq_zero_points(zp_packed, size_k: int, size_n: int, num_bits: int, *, backend: str = "auto",
                              stream=None):
    """Inverse of awq_to_marlin_zero_points: Marlin [ng, N_pad/pf] -> AWQ [ng, N/pf]."""
    zp_packed, size_k, size_n, num_bits = _check_packed_zeros(zp_packed, size_k, size_n, num_bits, "zp_packed", True)
    require_pack_multiple(size_n, _packing.pack_factor(num_bits), "size_n", "AWQ packs whole words of zero points")

    def reference(z, k, n, bits):
        return _packing.awq_pack(_scales.marlin_zero_points_to_codes(z, n, bits), bits)

    return backends.dispatch("marlin_to_awq_zero_points", backend, stream, reference, zp_packed, size_k, size_n,
                             num_bits)


@_planned
def marlin_to_gptq_qzeros(zp_packed, size_k: int, size_n: int, group_size: int, num_bits: int = 4, *,
                          backend: str = "auto", stream=None):
    """Inverse of repack_gptq_qzeros_to_marlin: Marlin zero points -> v1 qzeros (stored zero - 1) [ng, N/pf]."""
    zp_packed, size_k, size_n, num_bits = _check_packed_zeros(zp_packed, size_k, size_n, num_bits, "zp_packed", True)
    require_pack_multiple(size_n, _packing.pack_factor(num_bits), "size_n", "GPTQ qzeros pack whole words")
    group_size = _scales.check_group_size(size_k, group_size)

    def reference(z, k, n, g, bits):
        zeros = _scales.marlin_zero_points_to_codes(z, n, bits)
        bad = np.argwhere(zeros == 0)
        if bad.size:
            raise ValueError(v1_zero_message(f"group={int(bad[0][0])}", int(bad[0][1]), len(bad)))
        return _packing.pack_cols(zeros - np.uint8(1), bits)

    return backends.dispatch("marlin_to_gptq_qzeros", backend, stream, reference, zp_packed, size_k, size_n,
                             group_size, num_bits)


def marlin_to_block_fp8_scales(marlin_scales, size_k: int, size_n: int, act_dtype=np.float16):
    """Inverse of block_fp8_group128_scales: Marlin [ceil(K/128), N_pad] -> float32 [ceil(N/128), ceil(K/128)].

    Exact whenever the forward rounding to act_dtype was exact (e.g. bf16 inputs into bf16, or fp16-representable
    values); otherwise it returns the rounded scale the kernel uses.
    """
    marlin_scales = _array(marlin_scales, "marlin_scales")
    size_k, size_n = _fp8.check_block_fp8_shapes(size_k, size_n)
    if backends.is_device_array(marlin_scales):
        raise TypeError("marlin_to_block_fp8_scales runs in NumPy only; pass NumPy arrays")
    folded = _scales.unpermute_scales(marlin_scales, size_k, size_n, _fp8.BLOCK).astype(np.float32)
    return np.ascontiguousarray((folded[:, ::_fp8.BLOCK] / np.float32(_fp8.exponent_bias(act_dtype))).T)


# ---------------------------------------------------------------------------------------------------------------
# stacked MoE experts (seed: load_stacked_gptq_vllm_marlin)
# ---------------------------------------------------------------------------------------------------------------
def stack_gptq_experts_to_marlin(qweights: Sequence[Any], scales: Sequence[Any], qzeros: Sequence[Any], bits: int,
                                 group_size: int, size_k: int, n_per_expert: int, act_dtype=np.float16, *,
                                 backend: str = "auto", stream=None) -> MarlinWeight:
    """E experts' GPTQ tensors -> one stacked MarlinWeight (expert e at offset e·stride of every buffer).

    ``qweights[e]`` int32 [K/pf, N], ``scales[e]`` [K/G, N] (any float dtype, rounded to act_dtype),
    ``qzeros[e]`` int32 [K/G, N/pf] v1. Zero points are stacked only when some expert is asymmetric
    (otherwise the weight type is the symmetric ``u4b8``/``u8b128``).
    """
    size_k, n_per_expert, bits, _ = _gptq_sizes(size_k, n_per_expert, bits)
    group_size = _scales.check_group_size(size_k, group_size)
    if not isinstance(qweights, (list, tuple)):  # one stacked array [E, ...] per tensor
        qweights, scales, qzeros = (_array(x, name) for x, name in ((qweights, "qweights"), (scales, "scales"),
                                                                    (qzeros, "qzeros")))
    else:
        qweights, scales, qzeros = ([_array(x, f"{name}[{e}]") for e, x in enumerate(xs)]
                                    for xs, name in ((qweights, "qweights"), (scales, "scales"), (qzeros, "qzeros")))
    num_experts = len(qweights)
    require(num_experts > 0 and len(scales) == num_experts and len(qzeros) == num_experts,
            f"stacked experts: shape mismatch qweights={len(qweights)} scales={len(scales)} qzeros={len(qzeros)}")
    pf = _packing.pack_factor(bits)
    ng = _scales.num_groups(size_k, group_size)
    for e in range(num_experts):
        _check_words(qweights[e], (size_k // pf, n_per_expert), f"qweights[{e}]", "[K/pf, N]")
        _check_scale_tensor(scales[e], size_k, n_per_expert, group_size, f"scales[{e}]")
        warn_nonfinite(scales[e], f"scales[{e}]")
        _check_words(qzeros[e], (ng, n_per_expert // pf), f"qzeros[{e}]", f"[K/G, N/{pf}]")
    act = np.dtype(act_dtype)
    _fp8.exponent_bias(act)
    on_device = any(backends.is_device_array(x) for xs in (qweights, scales, qzeros)
                    for x in (xs if isinstance(xs, (list, tuple)) else [xs]))
    if backend == "numba" or (backend == "auto" and on_device):
        # all experts in one launch per tensor; host lists are staged one expert at a time
        return backends.stack_gptq_experts_to_marlin(qweights, scales, qzeros, bits, group_size, size_k, n_per_expert,
                                                     act, stream=stream)
    if backend not in backends.BACKENDS:
        raise ValueError(f"backend = {backend!r} is not one of {backends.BACKENDS}")

    qweight = np.empty((num_experts,) + _marlin_shape(size_k, n_per_expert, bits), dtype=np.int32)
    scale_stack = np.empty((num_experts, ng, padded_n(n_per_expert)), dtype=act)
    for e in range(num_experts):
        qweight[e] = gptq_marlin_repack(qweights[e], None, size_k, n_per_expert, bits, backend=backend, stream=stream)
        scale_stack[e] = _scales.permute_scales(np.asarray(scales[e]).astype(act), size_k, n_per_expert, group_size)
    asymmetric = any(not _gptq.gptq_qzeros_are_symmetric_code7(qz, bits) for qz in qzeros)
    zeros = None
    if asymmetric:
        zeros = np.stack([_gptq.repack_gptq_qzeros_to_marlin(qz, size_k, n_per_expert, group_size, bits)
                          for qz in qzeros])
    wt = {(4, False): ScalarType.U4B8, (4, True): ScalarType.U4, (8, False): ScalarType.U8B128,
          (8, True): ScalarType.U8}[(bits, asymmetric)]
    return MarlinWeight(qweight, scale_stack, zeros, None, None, size_k, n_per_expert, group_size, wt, act,
                        num_experts=num_experts)
from workbench.ops_fp4 import *  # noqa: E402,F401,F403  (the microscaled formats' ops: workbench/ops_fp4.py)
