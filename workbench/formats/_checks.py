"""Input checks shared by the references, the ops and the Numba wrappers. Each rule and its message live here once;
each raises with the offending values named.

The checks of *metadata* (scalar types and ranges, dtypes, byte order, shapes, contiguity) read only ``.shape``,
``.dtype``, ``.strides`` and flags, so they apply unchanged to NumPy and CUDA device arrays. Checks of *values*
(``require_codes_in_range``, ``check_permutation_values``, ``warn_nonfinite``) need the values on the host; for
device arrays the kernels check the same rule themselves and report with the same message (``code_range_message``).
"""
from __future__ import annotations

import warnings
from typing import Any, Iterable

import numpy as np

TILE_K = 16  # rows of a Marlin tile (the k extent of mma.m16n8k16)
TILE_N = 64  # columns of a Marlin tile (four 16-wide sub-blocks)


def require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


# ---------------------------------------------------------------------------------------------------------------
# scalars: always handed on as plain Python ints, so that kernel caches and compile-time constants never see a
# float or a NumPy scalar (a float 4.0 equals and hashes like 4: cached under it, it poisoned later calls)
# ---------------------------------------------------------------------------------------------------------------
def check_int(value: Any, name: str) -> int:
    """A Python or NumPy integer (not a bool, not a float, even an integral one) -> a Python int."""
    if not isinstance(value, (int, np.integer)) or isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return int(value)


def check_bits(bits: Any) -> int:
    bits = check_int(bits, "num_bits")
    if bits not in (4, 8):
        raise ValueError(f"num_bits = {bits!r} is not supported; Marlin packs 4- or 8-bit codes")
    return bits


def check_size_n(size_n: Any) -> int:
    """N of a scale or zero-point tensor: a positive multiple of the 64-wide Marlin tile."""
    size_n = check_int(size_n, "size_n")
    require(size_n > 0 and size_n % TILE_N == 0, f"size_n = {size_n} is not divisible by {TILE_N} (Marlin tile width)")
    return size_n


def check_tile_sizes(size_k: Any, size_n: Any) -> tuple[int, int]:
    """(K, N) of a weight: whole 16×64 Marlin tiles."""
    size_k, size_n = check_int(size_k, "size_k"), check_int(size_n, "size_n")
    require(size_k > 0 and size_k % TILE_K == 0, f"size_k = {size_k} is not divisible by tile_k_size = {TILE_K}")
    require(size_n > 0 and size_n % TILE_N == 0, f"size_n = {size_n} is not divisible by tile_n_size = {TILE_N}")
    return size_k, size_n


def check_size(value: Any, name: str) -> int:
    """A true tensor size (size_k, size_n): a positive int, any value. The Marlin arrays of a weight are those of
    the weight zero-padded to whole tiles (docs/formats.md, "Shapes that are not tile multiples")."""
    value = check_int(value, name)
    require(value > 0, f"{name} = {value} must be positive")
    return value


def check_weight_sizes(size_k: Any, size_n: Any) -> tuple[int, int]:
    """(K, N) of a weight: positive ints; edges that are not whole 16×64 tiles are zero-padded in the Marlin
    arrays (the format's own rules, e.g. K a multiple of the GPTQ pack factor, are checked beside it)."""
    return check_size(size_k, "size_k"), check_size(size_n, "size_n")


def padded_k(size_k: int) -> int:
    """K_pad = ceil(K / 16) * 16: rows of the Marlin arrays of a weight with size_k rows."""
    return -(-size_k // TILE_K) * TILE_K


def padded_n(size_n: int) -> int:
    """N_pad = ceil(N / 64) * 64: columns of the Marlin arrays (qweight, scales, zero points) of size_n columns."""
    return -(-size_n // TILE_N) * TILE_N


def require_pack_multiple(value: int, pf: int, name: str, what: str) -> None:
    """An input format's own rule: ``value`` (K of GPTQ rows, N of column-packed words) fills whole words."""
    require(value % pf == 0, f"{name} = {value} is not a multiple of the pack factor {pf} ({what})")


def require_positive_multiple(value: int, multiple: int, name: str, why: str) -> int:
    value = check_int(value, name)
    if value <= 0 or value % multiple:
        raise ValueError(f"{name} = {value} is not a positive multiple of {multiple} ({why})")
    return value


# ---------------------------------------------------------------------------------------------------------------
# array metadata
# ---------------------------------------------------------------------------------------------------------------
def dtype_of(x: Any) -> np.dtype:
    """NumPy dtype of a NumPy array or a CUDA array exposing a numpy-compatible dtype."""
    return np.dtype(x.dtype)


def require_array(x: Any, name: str) -> None:
    """Op inputs are arrays (NumPy or CUDA): a list or scalar carries no dtype, and the dtype is part of every
    format here (int32 words vs uint8 codes), so it is refused rather than guessed."""
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise TypeError(f"{name} must be a NumPy or CUDA array, got {type(x).__name__}; convert it with "
                        f"np.asarray(..., dtype=...) so that its dtype is explicit")


def require_native_byte_order(x: Any, name: str) -> None:
    """Kernels read raw bytes: a byte-swapped device array would be read as other values. (Host arrays are
    converted to native order once, on entry, by ``workbench.backends.normalize``.)"""
    if not dtype_of(x).isnative:
        raise TypeError(f"{name} has non-native byte order (dtype {dtype_of(x).str}) on the device; convert it to "
                        f"native byte order first")


def require_ndim(x: Any, ndim: int, name: str) -> None:
    if len(x.shape) != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(x.shape)}")


def require_shape(x: Any, shape: tuple[int, ...], name: str, hint: str = "") -> None:
    if tuple(x.shape) != tuple(shape):
        extra = f" ({hint})" if hint else ""
        raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {tuple(shape)}{extra}")


def require_dtype(x: Any, dtypes: Iterable[Any], name: str) -> None:
    allowed = [np.dtype(d) for d in dtypes]
    if dtype_of(x) not in allowed:
        names = " or ".join(str(d) for d in allowed)
        raise TypeError(f"{name} must have dtype {names}, got {dtype_of(x)}")


def require_integer_dtype(x: Any, name: str, what: str = "integer codes") -> None:
    if not np.issubdtype(dtype_of(x), np.integer):
        raise TypeError(f"{name} must hold {what}, got dtype {dtype_of(x)}")


def require_contiguous(x: Any, name: str) -> None:
    flags = getattr(x, "flags", None)
    if flags is not None:
        contiguous = flags["C_CONTIGUOUS"] if not isinstance(flags, dict) else flags.get("C_CONTIGUOUS", True)
        if not contiguous:
            raise ValueError(f"{name} is not C-contiguous (strides {getattr(x, 'strides', '?')})")


def require_rows(x: Any, name: str, what: str = "groups") -> None:
    """A scale or zero-point tensor has at least one row (group): a layer has at least one group."""
    if x.shape[0] == 0:
        raise ValueError(f"{name} has shape {tuple(x.shape)}: 0 {what}; a layer has at least one")


# ---------------------------------------------------------------------------------------------------------------
# values (host arrays; device arrays are checked by the kernels with the same messages)
# ---------------------------------------------------------------------------------------------------------------
def code_range_message(name: str, index: tuple[int, ...], value: int, count: int, bits: int) -> str:
    where = ", ".join(str(i) for i in index)
    return (f"{name}[{where}] = {value} is outside the {bits}-bit code range [0, {(1 << bits) - 1}] "
            f"({count} such value(s))")


def require_codes_in_range(codes: np.ndarray, bits: int, name: str) -> None:
    """Every code fits ``bits`` bits; otherwise name the first offender (row-major order) and the count."""
    codes = np.asarray(codes)
    bad = (codes < 0) | (codes >= (1 << bits)) if codes.dtype.kind == "i" else codes >= (1 << bits)
    if bad.any():
        first = np.unravel_index(int(np.flatnonzero(bad)[0]), codes.shape)
        raise ValueError(code_range_message(name, tuple(int(i) for i in first), int(codes[first]), int(bad.sum()),
                                            bits))


def v1_all_ones_message(where: str, column: int, bits: int, count: int) -> str:
    """A GPTQ v1 stored zero of all ones (zero = stored + 1 would need bits + 1 bits); ``where``: "group=g" or
    "expert=e group=g", ``column``: the code's column n."""
    pf = 32 // bits
    return (f"qzeros {where} packed_col={column // pf} lane={column % pf} has code {(1 << bits) - 1}; "
            f"AutoGPTQ zero+1 would exceed the {bits}-bit range ({count} such field(s))")


def v1_zero_message(where: str, column: int, count: int) -> str:
    """A zero point of 0 going into GPTQ v1 (it would be stored as -1)."""
    return (f"zero point at {where} column={column} is 0, which GPTQ v1 cannot store (it would need field -1); "
            f"{count} such zero point(s)")


def permutation_message(name: str, size_k: int, detail: str) -> str:
    return f"{name} is not a permutation of range({size_k}): {detail}"


def check_permutation_values(perm: np.ndarray, size_k: int, name: str = "perm") -> None:
    """A host array of any integer width is a permutation of range(size_k), judged on its own values (never after
    a cast that could wrap them). Names the first value outside [0, size_k), else the lowest repeated value."""
    perm = np.asarray(perm)
    outside = (perm < 0) | (perm >= size_k)
    if outside.any():
        i = int(np.flatnonzero(outside)[0])
        raise ValueError(permutation_message(name, size_k, f"{name}[{i}] = {int(perm[i])} is outside [0, {size_k})"))
    counts = np.bincount(perm.astype(np.int64), minlength=size_k)
    if (counts > 1).any():  # size_k values in range with no repeat are a permutation (the device check's rule too)
        v = int(np.flatnonzero(counts > 1)[0])
        raise ValueError(permutation_message(name, size_k, f"{v} appears {int(counts[v])} times"))


def warn_nonfinite(x: Any, name: str) -> None:
    """Scales that hold NaN or Inf make every output of their group NaN/Inf: warn (they may be intended, e.g. a
    masked group) and name the first one. Host arrays only; device scales are not copied back to look."""
    if not isinstance(x, np.ndarray) or x.dtype.kind in "iub":
        return
    finite = np.isfinite(x.astype(np.float32, copy=False))
    if not finite.all():
        first = np.unravel_index(int(np.flatnonzero(~finite)[0]), x.shape)
        where = ", ".join(str(int(i)) for i in first)
        warnings.warn(f"{name} holds {int((~finite).sum())} NaN/Inf value(s), the first {name}[{where}] = "
                      f"{x[first]}", RuntimeWarning, stacklevel=3)
