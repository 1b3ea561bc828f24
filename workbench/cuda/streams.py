"""Streams from any framework as raw CUstream handles, and CuPy stream objects for a handle.

``stream_handle(stream, framework)`` takes an int (a raw handle, 0 = the legacy default stream), a CuPy stream
(``.ptr``), a PyTorch stream (``.cuda_stream``), a Numba stream (``.handle``) or any object with the
``__cuda_stream__`` protocol; ``None`` means the current stream of ``framework`` (the framework of the call's
inputs: ``torch.cuda.current_stream()`` for torch tensors, CuPy's current stream otherwise).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from workbench.cuda.arrays import cupy

_streams: dict[int, Any] = {}


def stream_handle(stream, framework: str = "cupy", device: int | None = None) -> int:
    if stream is None:
        if framework == "torch":
            import torch

            return int(torch.cuda.current_stream(device).cuda_stream)
        return cupy().cuda.get_current_stream().ptr
    if isinstance(stream, (int, np.integer)):
        return int(stream)
    ptr = getattr(stream, "ptr", None)  # CuPy
    if ptr is not None:
        return int(ptr)
    ptr = getattr(stream, "cuda_stream", None)  # PyTorch
    if ptr is not None:
        return int(ptr)
    protocol = getattr(stream, "__cuda_stream__", None)
    if protocol is not None:
        return int(protocol()[1])  # (version, handle)
    handle = getattr(stream, "handle", None)  # Numba: a ctypes handle
    if handle is not None:
        return int(getattr(handle, "value", handle) or 0)
    raise TypeError(f"stream must be None, an int handle or a CuPy / PyTorch / Numba stream, got "
                    f"{type(stream).__module__}.{type(stream).__name__}")


def cupy_stream(ptr: int):
    """A CuPy stream object for a raw CUstream handle (cached: creating one allocates nothing on the device)."""
    cp = cupy()
    if ptr == 0:
        return cp.cuda.Stream.null
    s = _streams.get(ptr)
    if s is None:
        import warnings

        with warnings.catch_warnings():  # CuPy 14 deprecates it in favour of objects with __cuda_stream__; a raw
            warnings.simplefilter("ignore", DeprecationWarning)  # handle has nothing else to wrap
            s = _streams.setdefault(ptr, cp.cuda.ExternalStream(ptr))
    return s
