"""Host-side plumbing shared by every kernel wrapper: device arrays in, device arrays out, streams, poison.

Every public wrapper in ``kernels_numba`` follows the same three steps (check → allocate → launch):

* **inputs**: NumPy arrays are copied to the device; anything with ``__cuda_array_interface__`` (CuPy, PyTorch,
  Numba device arrays) is used in place, after a device and contiguity check. In the CUDA simulator
  (``NUMBA_ENABLE_CUDASIM=1``) the simulator's own device arrays play that role.
* **outputs**: NumPy when every array input was NumPy, else a device array (CuPy where CuPy can talk to the GPU,
  otherwise a Numba device array). Packed words are computed as ``uint32`` (wrapping integer semantics in both
  worlds) and handed back viewed as ``int32``, the checkpoint dtype.
* **streams**: ``stream=None`` is the default stream; a Numba stream, a CuPy stream (``.ptr``), a PyTorch stream
  (``.cuda_stream``) or a raw ``CUstream`` integer is accepted.

Tests can make every output allocation start as a poison pattern (``with poison_outputs(): ...``) so an element a
kernel forgets to write cannot pass an exact comparison.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any

import numpy as np
from numba import cuda

SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1"
POISON_BYTE = 0xA5  # 0xA5A5A5A5 as a word: not a valid result of any transform of fresh random data
_poison_depth = 0


@contextlib.contextmanager
def poison_outputs():
    """Inside this block every output buffer is filled with POISON_BYTE before the kernel runs."""
    global _poison_depth
    _poison_depth += 1
    try:
        yield
    finally:
        _poison_depth -= 1


def is_device_array(x: Any) -> bool:
    if hasattr(x, "__cuda_array_interface__"):
        return True
    if SIMULATOR:
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        return isinstance(x, FakeCUDAArray)
    return False


def resolve_stream(stream: Any):
    """Anything that names a CUDA stream -> a Numba stream object (the default stream for None)."""
    if stream is None or stream == 0:
        return cuda.default_stream()
    if SIMULATOR:
        return cuda.default_stream()  # the simulator runs kernels synchronously; streams carry no meaning
    from numba.cuda.cudadrv.driver import Stream

    if isinstance(stream, Stream):
        return stream
    if isinstance(stream, int):
        return cuda.external_stream(stream)
    for attr in ("ptr", "cuda_stream"):  # CuPy, PyTorch
        handle = getattr(stream, attr, None)
        if isinstance(handle, int):
            return cuda.external_stream(handle)
    raise TypeError(f"stream = {stream!r} is not a CUDA stream (Numba, CuPy or PyTorch stream, or an int handle)")


def _device_index_of(x: Any) -> int | None:
    """The CUDA device ordinal an array lives on, where the array says so (PyTorch, CuPy)."""
    dev = getattr(x, "device", None)
    if dev is None:
        return None
    if getattr(dev, "type", None) == "cuda":  # torch.device
        return dev.index if dev.index is not None else 0
    if getattr(dev, "type", None) == "cpu":
        raise TypeError("a PyTorch CPU tensor was passed where a CUDA array is needed; pass .cuda() or NumPy")
    if hasattr(dev, "id") and isinstance(dev.id, int):  # cupy.cuda.Device
        return dev.id
    return None


class Arrays:
    """Collects a call's inputs on the device and remembers whether the caller worked with NumPy."""

    def __init__(self, stream: Any):
        self.stream = resolve_stream(stream)
        self.any_device = False

    def take(self, x: Any, name: str, view_dtype: Any = None):
        """NumPy or device array -> contiguous Numba (or simulator) device array, optionally viewed as view_dtype."""
        if is_device_array(x):
            self.any_device = True
            if not SIMULATOR:
                idx = _device_index_of(x)
                current = cuda.get_current_device().id
                if idx is not None and idx != current:
                    raise ValueError(f"{name} is on cuda:{idx} but the kernels run on cuda:{current} (the current "
                                     f"Numba device); move it or select that device first")
                d = cuda.as_cuda_array(x)
                if not d.is_c_contiguous():
                    raise ValueError(f"{name} is not C-contiguous (shape {d.shape}, strides {d.strides}); "
                                     f"pass a contiguous array")
            else:
                d = x
                if not d.is_c_contiguous():
                    raise ValueError(f"{name} is not C-contiguous (shape {d.shape}); pass a contiguous array")
        else:
            a = np.asarray(x)
            if a.dtype.kind == "V" or a.dtype.itemsize == 2 and a.dtype.kind not in "iuf":
                a = a.view(np.uint16)  # ml_dtypes.bfloat16: move the raw bits
            d = cuda.to_device(np.ascontiguousarray(a), stream=self.stream)
        if view_dtype is not None and np.dtype(d.dtype) != np.dtype(view_dtype):
            d = d.view(view_dtype)
        return d

    def empty(self, shape: tuple[int, ...], dtype: Any):
        shape = tuple(int(s) for s in shape)
        if _poison_depth:
            nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
            poisoned = np.full(nbytes, POISON_BYTE, dtype=np.uint8).view(dtype).reshape(shape)
            return cuda.to_device(poisoned, stream=self.stream)
        return cuda.device_array(shape, dtype=dtype, stream=self.stream)

    def give(self, d, dtype: Any = None):
        """Hand a result back in the caller's world: NumPy for NumPy callers, else CuPy or a Numba device array."""
        if dtype is not None and np.dtype(d.dtype) != np.dtype(dtype):
            d = d.view(dtype)
        if not self.any_device:
            host = d.copy_to_host(stream=self.stream)
            self.stream.synchronize()
            return host
        return as_user_device_array(d)


def as_user_device_array(d):
    """A Numba device array -> CuPy (zero-copy) when CuPy can talk to the GPU, else the Numba array itself."""
    if SIMULATOR:
        return d
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            return cupy.asarray(d)
    except Exception:  # CuPy missing or unusable: the Numba device array is the answer
        pass
    return d


def grid_stride_blocks(total: int, threads: int, cap: int = 65535 * 8) -> int:
    """Blocks for an element-wise grid-stride kernel: enough to cover ``total`` once, capped (small transforms)."""
    return max(1, min(cap, -(-total // threads)))


def copy_to_host_checked(d, stream) -> np.ndarray:
    host = d.copy_to_host(stream=stream)
    stream.synchronize()
    return host
