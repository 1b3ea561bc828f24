"""Public ops of the microscaled formats (NVFP4, MXFP4, MXFP8): vLLM's names where vLLM has the function
(``marlin_utils_fp4.py``, ``marlin_utils_fp8.py``; docs/formats.md, "Microscaling in Marlin"), the same rules as
``workbench.ops`` (checked scalars and arrays, errors naming the offending values, inputs never mutated), and
``backend=`` / ``stream=`` dispatch to the NumPy references or the Numba kernels (``kernels_numba.fp4_repack``).

| op | from | to |
|---|---|---|
| ``fp4_marlin_repack`` / ``marlin_to_fp4`` | E2M1 bytes [N, K/2] | Marlin int32 [K/16, 2 N_pad] |
| ``mxfp8_marlin_repack`` / ``marlin_to_mxfp8`` | E4M3 bytes [N, K] | Marlin int32 [K/16, 4 N_pad] |
| ``nvfp4_marlin_process_scales`` | permuted E4M3 scales [ng, N_pad] | S0E5M3 bytes, scale_factor |
| ``mxfp4_marlin_process_scales``, ``mxfp8_marlin_process_scales`` | permuted E8M0 scales [ng, N_pad] | shuffled codes |
| ``nvfp4_marlin_process_global_scale`` | fp32 global scale | fp32 × 2^7 (fp16) / × 2^119 (bf16) |
| ``nvfp4_marlin_scales`` / ``marlin_to_nvfp4_scales`` | checkpoint E4M3 [N, K/16] | Marlin S0E5M3 [K/16, N_pad] |
| ``mx_marlin_scales`` / ``marlin_to_mx_scales`` | checkpoint E8M0 [N, K/32] | Marlin E8M0 [K/32, N_pad] |
| ``nvfp4_marlin_global_scale`` | fp32 global scale, scale_factor | the one fp32 the kernel reads |

Shapes (docs/formats.md, "Shapes that are not tile multiples"): N is any positive size, the Marlin arrays N_pad =
ceil(N / 64) * 64 wide with zero codes and zero scale bytes in the padded columns; K is a multiple of the format's
group (NVFP4 16, MXFP4 / MXFP8 32), checked by the scale ops (``fp4_marlin.check_microscale_sizes``), so it is always
whole 16-row k-tiles, which is what the weight ops check (``check_weight_k_tiles``). The inverses take the true sizes
and return the unpadded tensors.
"""
from __future__ import annotations

import numpy as np

from workbench import backends
from workbench.formats import fp4_marlin as _fm
from workbench.formats import microscale as _ms
from workbench.formats._checks import (padded_n, require, require_contiguous, require_dtype,
                                       require_native_byte_order, require_ndim, require_shape)

# the Numba kernels of these ops; registered with the dispatcher's table here so that this module stays the one
# place that knows them (backends.KERNELS maps an op name to (kernels_numba module, function))
FP4_KERNELS = {
    "fp4_marlin_repack": ("fp4_repack", "fp4_marlin_repack"),
    "marlin_to_fp4": ("fp4_repack", "marlin_to_fp4"),
    "mxfp8_marlin_repack": ("fp4_repack", "mxfp8_marlin_repack"),
    "marlin_to_mxfp8": ("marlin_repack", "marlin_to_block_fp8_row_major"),
    "nvfp4_marlin_scales": ("fp4_repack", "nvfp4_marlin_scales"),
    "marlin_to_nvfp4_scales": ("fp4_repack", "marlin_to_nvfp4_scales"),
    "mx_marlin_scales": ("fp4_repack", "mx_marlin_scales"),
    "marlin_to_mx_scales": ("fp4_repack", "marlin_to_mx_scales"),
    "nvfp4_marlin_process_scales": ("fp4_repack", "nvfp4_marlin_process_scales"),
    "mx_marlin_process_scales": ("fp4_repack", "mx_marlin_process_scales"),
}
backends.KERNELS.update(FP4_KERNELS)

BYTES = (np.uint8,)
__all__ = ["fp4_marlin_repack", "marlin_to_fp4", "mxfp8_marlin_repack", "marlin_to_mxfp8",
           "nvfp4_marlin_process_scales", "mxfp4_marlin_process_scales", "mxfp8_marlin_process_scales",
           "nvfp4_marlin_process_global_scale", "nvfp4_scale_factor", "nvfp4_marlin_scales", "marlin_to_nvfp4_scales", "mx_marlin_scales",
           "marlin_to_mx_scales", "nvfp4_marlin_global_scale"]


def _array(x, name: str):
    x = backends.normalize(x, name)
    require_native_byte_order(x, name)
    return x


def _on_device(*xs) -> bool:
    return any(backends.is_device_array(x) for x in xs)


def _check_bytes(x, shape, name: str, hint: str, dtypes=BYTES) -> None:
    require_dtype(x, dtypes, name)
    require_ndim(x, len(shape), name)
    require_shape(x, shape, name, hint)
    require_contiguous(x, name)


def _fmt(fmt) -> _ms.MicroscaleFormat:
    return _ms.microscale_format(fmt)


def _sizes(fmt: _ms.MicroscaleFormat, size_k, size_n) -> tuple[int, int]:
    return _fm.check_microscale_sizes(size_k, size_n, fmt)


# ---------------------------------------------------------------------------------------------------------------
# weights
# ---------------------------------------------------------------------------------------------------------------
def fp4_marlin_repack(weight_packed, size_k: int, size_n: int, *, backend: str = "auto", stream=None):
    """E2M1 bytes uint8 [N, K/2] (NVFP4 or MXFP4; element 2j in the low nibble) -> Marlin int32 [K/16, 2 N_pad].

    Bit-identical to vLLM's route ``gptq_marlin_repack(weight.view(int32).T, ...)``, with the transpose fused, where
    N is a multiple of 64 (vLLM's repack refuses any other N); otherwise the padded columns are zero codes.
    """
    weight_packed = _array(weight_packed, "weight_packed")
    size_k, size_n = _fm.check_weight_k_tiles(size_k, size_n)
    _check_bytes(weight_packed, (size_n, size_k // 2), "weight_packed", f"[N, K/2] for K = {size_k}, N = {size_n}")
    return backends.dispatch("fp4_marlin_repack", backend, stream, _fm.fp4_marlin_repack, weight_packed, size_k,
                             size_n)


def marlin_to_fp4(marlin_q, size_k: int, size_n: int, *, backend: str = "auto", stream=None):
    """Inverse of fp4_marlin_repack: Marlin int32 [K/16, 2 N_pad] -> E2M1 bytes uint8 [N, K/2]."""
    marlin_q = _array(marlin_q, "marlin_q")
    size_k, size_n = _fm.check_weight_k_tiles(size_k, size_n)
    _check_bytes(marlin_q, (size_k // 16, 2 * padded_n(size_n)), "marlin_q", "[K/16, 2 N_pad], 4-bit",
                 (np.int32, np.uint32))
    return backends.dispatch("marlin_to_fp4", backend, stream, _fm.marlin_to_fp4, marlin_q, size_k, size_n)


def mxfp8_marlin_repack(weight, size_k: int, size_n: int, *, backend: str = "auto", stream=None):
    """MXFP8 E4M3 bytes [N, K] (uint8 or float8_e4m3fn) -> Marlin int32 [K/16, 4 N_pad] (the 8-bit transposed
    route)."""
    weight = _array(weight, "weight")
    size_k, size_n = _fm.check_weight_k_tiles(size_k, size_n)
    _check_bytes(weight, (size_n, size_k), "weight", "[N, K]", (np.uint8, _ms.E4M3))
    return backends.dispatch("mxfp8_marlin_repack", backend, stream, _fm.mxfp8_marlin_repack, weight, size_k, size_n)


def marlin_to_mxfp8(marlin_q, size_k: int, size_n: int, *, backend: str = "auto", stream=None):
    """Inverse of mxfp8_marlin_repack: Marlin int32 [K/16, 4 N_pad] -> E4M3 bytes uint8 [N, K]."""
    marlin_q = _array(marlin_q, "marlin_q")
    size_k, size_n = _fm.check_weight_k_tiles(size_k, size_n)
    _check_bytes(marlin_q, (size_k // 16, 4 * padded_n(size_n)), "marlin_q", "[K/16, 4 N_pad], 8-bit",
                 (np.int32, np.uint32))
    return backends.dispatch("marlin_to_mxfp8", backend, stream, _fm.marlin_to_mxfp8, marlin_q, size_k, size_n)


# ---------------------------------------------------------------------------------------------------------------
# vLLM's scale steps
# ---------------------------------------------------------------------------------------------------------------
def _check_marlin_scale_tensor(s, name: str, dtypes) -> None:
    require_dtype(s, dtypes, name)
    require_ndim(s, 2, name)
    require(s.shape[0] > 0 and s.shape[1] > 0 and s.shape[1] % 64 == 0,
            f"{name} has shape {tuple(s.shape)}; expected [num_groups > 0, N_pad] with N_pad a multiple of 64 (the "
            "Marlin scale tensor of any N is ceil(N / 64) * 64 wide)")
    require_contiguous(s, name)


NVFP4_SCALE_DTYPES = (np.float16, _ms.BF16, np.float32, np.uint8, _ms.E4M3)
MX_SCALE_DTYPES = (_ms.BF16, np.float32, np.uint8, _ms.E8M0)


def nvfp4_marlin_process_scales(marlin_scales, scale_factor=None, a_dtype=None, *, backend: str = "auto",
                                stream=None):
    """Permuted NVFP4 scales [ng, N] -> (S0E5M3 bytes uint8 [ng, N], scale_factor), as vLLM's function of this name.

    Scales are E4M3 values (float16, bfloat16, float32, or E4M3 bytes); any other value is refused. A negative
    scale warns (RuntimeWarning naming it) and is stored as its magnitude: the byte has no sign bit. In bf16 the
    scales are multiplied by ``scale_factor`` (computed when None, see ``nvfp4_scale_factor``), which the caller
    must divide out of the global scale (``nvfp4_marlin_global_scale``).
    """
    marlin_scales = _array(marlin_scales, "marlin_scales")
    _check_marlin_scale_tensor(marlin_scales, "marlin_scales", NVFP4_SCALE_DTYPES + (
        (np.uint16,) if _on_device(marlin_scales) else ()))
    if a_dtype is not None:
        _fm._act_dtype(a_dtype, _ms.NVFP4)
    if scale_factor is not None:
        scale_factor = _fm._check_scale_factor(scale_factor)
    if _on_device(marlin_scales) or backend == "numba":
        if a_dtype is None:
            raise TypeError("nvfp4_marlin_process_scales on the device needs a_dtype (float16 or bfloat16)")
    return backends.dispatch("nvfp4_marlin_process_scales", backend, stream, _fm.nvfp4_marlin_process_scales,
                             marlin_scales, scale_factor, a_dtype)


def mxfp4_marlin_process_scales(marlin_scales, input_dtype=None, *, backend: str = "auto", stream=None):
    """Permuted MXFP4 scales [ng, N] (E8M0 codes, or their bf16/float32 values) -> shuffled E8M0 codes uint8.

    The NaN code 0xFF and values that are no power of two in 2^-127..2^127 are refused by position.
    """
    marlin_scales = _array(marlin_scales, "marlin_scales")
    _check_marlin_scale_tensor(marlin_scales, "marlin_scales", MX_SCALE_DTYPES)
    if input_dtype is not None and np.dtype(input_dtype).itemsize != 2:
        raise TypeError(f"input_dtype = {np.dtype(input_dtype)}: only 16-bit activations are supported")
    return backends.dispatch("mx_marlin_process_scales", backend, stream, _fm.mx_marlin_process_scales,
                             marlin_scales)


def mxfp8_marlin_process_scales(marlin_scales, *, backend: str = "auto", stream=None):
    """Permuted MXFP8 scales [ng, N] -> shuffled E8M0 codes uint8 (the same step as MXFP4's)."""
    return mxfp4_marlin_process_scales(marlin_scales, backend=backend, stream=stream)


def nvfp4_marlin_process_global_scale(global_scale, a_dtype=None):
    """NVFP4 global scale (fp32) -> fp32 × 2^7 (fp16 activations) or × 2^119 (bf16). ``a_dtype`` defaults to the
    global scale's dtype, as in vLLM (which then must be float16 or bfloat16)."""
    g = np.asarray(global_scale)
    return _fm.nvfp4_marlin_process_global_scale(g, g.dtype if a_dtype is None else a_dtype)


def nvfp4_scale_factor(scales, a_dtype) -> float:
    """vLLM's scale factor of a layer (or, given all experts' scales, of a stack). NumPy only."""
    return _fm.nvfp4_scale_factor(np.asarray(scales), a_dtype)


# ---------------------------------------------------------------------------------------------------------------
# whole scale routes, checkpoint <-> Marlin
# ---------------------------------------------------------------------------------------------------------------
def nvfp4_marlin_scales(weight_scale, size_k: int, size_n: int, a_dtype=np.float16, scale_factor=None, *,
                        group_size: int = 16, backend: str = "auto", stream=None):
    """Checkpoint NVFP4 scales E4M3 [N, K/16] -> (Marlin S0E5M3 bytes uint8 [K/16, N_pad], scale_factor): the Marlin
    permutation, the shuffle and the S0E5M3 byte in one pass (padded columns: byte 0, scale 0)."""
    weight_scale = _array(weight_scale, "weight_scale")
    _ms.check_group_size(_ms.NVFP4, group_size)
    size_k, size_n = _sizes(_ms.NVFP4, size_k, size_n)
    _check_bytes(weight_scale, (size_n, size_k // 16), "weight_scale", f"[N, K/16] for K = {size_k}, N = {size_n}",
                 (np.uint8, _ms.E4M3))
    _fm._act_dtype(a_dtype, _ms.NVFP4)
    if scale_factor is not None:
        scale_factor = _fm._check_scale_factor(scale_factor)
    return backends.dispatch("nvfp4_marlin_scales", backend, stream, _fm.nvfp4_marlin_scales, weight_scale, size_k,
                             size_n, np.dtype(a_dtype), scale_factor)


def marlin_to_nvfp4_scales(marlin_scales, size_k: int, size_n: int, scale_factor: float = 1.0, *,
                           backend: str = "auto", stream=None):
    """Inverse of nvfp4_marlin_scales: Marlin S0E5M3 bytes [K/16, N_pad] -> E4M3 bytes uint8 [N, K/16]."""
    marlin_scales = _array(marlin_scales, "marlin_scales")
    size_k, size_n = _sizes(_ms.NVFP4, size_k, size_n)
    _check_bytes(marlin_scales, (size_k // 16, padded_n(size_n)), "marlin_scales", "[K/16, N_pad]")
    scale_factor = _fm._check_scale_factor(scale_factor)
    return backends.dispatch("marlin_to_nvfp4_scales", backend, stream, _fm.marlin_to_nvfp4_scales, marlin_scales,
                             size_k, size_n, scale_factor)


def mx_marlin_scales(weight_scale, size_k: int, size_n: int, fmt: str = "mxfp4", *, group_size: int = 32,
                     backend: str = "auto", stream=None):
    """Checkpoint E8M0 codes [N, K/32] (uint8 or float8_e8m0fnu) -> Marlin E8M0 codes uint8 [K/32, N_pad] (padded
    columns: code 0 = 2^-127, finite, times zero codes)."""
    f = _fmt(fmt)
    require(f.scale == "e8m0", f"fmt = {fmt!r} has no E8M0 scales (mxfp4 or mxfp8)")
    _ms.check_group_size(f, group_size)
    weight_scale = _array(weight_scale, "weight_scale")
    size_k, size_n = _sizes(f, size_k, size_n)
    _check_bytes(weight_scale, (size_n, size_k // 32), "weight_scale", f"[N, K/32] for K = {size_k}, N = {size_n}",
                 (np.uint8, _ms.E8M0))
    return backends.dispatch("mx_marlin_scales", backend, stream, _fm.mx_marlin_scales, weight_scale, size_k, size_n,
                             f.name)


def marlin_to_mx_scales(marlin_scales, size_k: int, size_n: int, fmt: str = "mxfp4", *, backend: str = "auto",
                        stream=None):
    """Inverse of mx_marlin_scales: Marlin E8M0 codes [K/32, N_pad] -> checkpoint codes uint8 [N, K/32]."""
    f = _fmt(fmt)
    require(f.scale == "e8m0", f"fmt = {fmt!r} has no E8M0 scales (mxfp4 or mxfp8)")
    marlin_scales = _array(marlin_scales, "marlin_scales")
    size_k, size_n = _sizes(f, size_k, size_n)
    _check_bytes(marlin_scales, (size_k // 32, padded_n(size_n)), "marlin_scales", "[K/32, N_pad]",
                 (np.uint8, _ms.E8M0))
    return backends.dispatch("marlin_to_mx_scales", backend, stream, _fm.marlin_to_mx_scales, marlin_scales, size_k,
                             size_n, f.name)


def nvfp4_marlin_global_scale(global_scale, a_dtype=np.float16, scale_factor: float = 1.0) -> np.float32:
    """The one fp32 an NVFP4 Marlin layer's kernel reads: ``global_scale × 2^7 (or 2^119) / scale_factor``."""
    return _fm.nvfp4_marlin_global_scale(global_scale, a_dtype, scale_factor)

