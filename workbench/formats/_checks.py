"""Input checks shared by the references and the ops. Each raises with the offending values named."""
from __future__ import annotations

from typing import Any, Iterable

import numpy as np


def require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def check_bits(bits: int) -> int:
    if bits not in (4, 8):
        raise ValueError(f"num_bits = {bits!r} is not supported; Marlin packs 4- or 8-bit codes")
    return int(bits)


def dtype_of(x: Any) -> np.dtype:
    """NumPy dtype of a NumPy array or a CUDA array exposing a numpy-compatible dtype."""
    return np.dtype(x.dtype)


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


def require_positive_multiple(value: int, multiple: int, name: str, why: str) -> None:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value <= 0 or value % multiple:
        raise ValueError(f"{name} = {value} is not a positive multiple of {multiple} ({why})")


def require_contiguous(x: Any, name: str) -> None:
    flags = getattr(x, "flags", None)
    if flags is not None:
        contiguous = flags["C_CONTIGUOUS"] if not isinstance(flags, dict) else flags.get("C_CONTIGUOUS", True)
        if not contiguous:
            raise ValueError(f"{name} is not C-contiguous (strides {getattr(x, 'strides', '?')})")
