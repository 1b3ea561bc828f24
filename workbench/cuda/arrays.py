"""Device arrays from any framework: pointers, devices, the owning framework, and allocation from its pool.

CuPy arrays are the fast case (their pointer and device are attributes). PyTorch tensors are read through their own
accessors (their ``__cuda_array_interface__`` refuses bfloat16), everything else (Numba device arrays, ...) through
``__cuda_array_interface__``. ``as_device_array`` wraps a non-CuPy array in a ``DeviceArray``: a view with CuPy's
attribute names (``shape``, ``strides`` in bytes, ``dtype`` as NumPy's, ``data.ptr``, ``data.device_id``,
``flags``), so one set of checks reads every framework's arrays.

Allocation: outputs and scratch come from the pool of the framework the caller's inputs belong to: PyTorch's caching
allocator for torch tensors, CuPy's memory pool for everything else (Numba has no pool of its own). When inputs are
mixed, the framework of the first array argument (the activations) wins.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

_cupy_module = None
_cupy_array = None
_torch_tensor = None
_torch_dtypes: dict | None = None


def cupy():
    """The ``cupy`` module, imported on first use (an import statement costs time in a launch path)."""
    global _cupy_module
    if _cupy_module is None:
        try:
            import cupy as module
        except ImportError as exc:  # pragma: no cover - environment
            raise RuntimeError("the native kernels need CuPy (pip install cupy-cuda13x)") from exc
        _cupy_module = module
    return _cupy_module


def cupy_array_type() -> type:
    """``cupy.ndarray``, or a class nothing is an instance of where CuPy is not installed."""
    global _cupy_array
    if _cupy_array is None:
        try:
            import cupy as module

            _cupy_array = module.ndarray
        except ImportError:  # pragma: no cover - environment
            _cupy_array = type("NoCuPy", (), {})
    return _cupy_array


def torch_tensor_type() -> type:
    """``torch.Tensor`` if PyTorch is already imported (a caller with torch tensors has imported it), else a class
    nothing is an instance of: this module never imports torch itself."""
    global _torch_tensor
    if _torch_tensor is None:
        import sys

        torch = sys.modules.get("torch")
        if torch is None:
            return _NoTorch
        _torch_tensor = torch.Tensor
    return _torch_tensor


class _NoTorch:
    pass


def _torch_numpy_dtype(dtype) -> np.dtype:
    global _torch_dtypes
    if _torch_dtypes is None:
        import ml_dtypes
        import torch

        _torch_dtypes = {torch.float16: np.dtype(np.float16), torch.bfloat16: np.dtype(ml_dtypes.bfloat16),
                         torch.float32: np.dtype(np.float32), torch.int32: np.dtype(np.int32),
                         torch.int64: np.dtype(np.int64), torch.uint8: np.dtype(np.uint8),
                         torch.int8: np.dtype(np.int8), torch.int16: np.dtype(np.int16)}
        # raw bit patterns (bf16 scales travel as uint16); torch has unsigned 16/32-bit dtypes since 2.3
        _torch_dtypes.update({getattr(torch, name): np.dtype(name) for name in ("uint16", "uint32")
                              if hasattr(torch, name)})
    try:
        return _torch_dtypes[dtype]
    except KeyError:
        raise TypeError(f"torch dtype {dtype} has no NumPy counterpart the kernels take") from None


def numpy_to_torch_dtype(dtype):
    """The inverse of ``_torch_numpy_dtype`` (one table for both directions)."""
    import torch

    _torch_numpy_dtype(torch.float16)  # builds the table
    dtype = np.dtype(dtype)
    for t, n in _torch_dtypes.items():
        if n == dtype:
            return t
    raise TypeError(f"dtype {dtype} has no torch counterpart here")


class _Memory:
    __slots__ = ("ptr", "device_id")

    def __init__(self, ptr: int, device_id: int):
        self.ptr, self.device_id = ptr, device_id


class DeviceArray:
    """A view of another framework's device array with CuPy's attribute names; ``base`` is the array itself."""

    __slots__ = ("shape", "strides", "dtype", "data", "size", "nbytes", "flags", "base", "framework")

    def __init__(self, base, shape, strides, dtype, ptr: int, device: int, framework: str):
        self.base, self.framework = base, framework
        self.shape, self.strides, self.dtype = tuple(shape), tuple(strides), np.dtype(dtype)
        self.data = _Memory(int(ptr), int(device))
        self.size = math.prod(self.shape)
        self.nbytes = self.size * self.dtype.itemsize
        self.flags = {"C_CONTIGUOUS": self.size <= 1 or self.strides == _c_strides(self.shape, self.dtype.itemsize)}

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.shape, "typestr": self.dtype.str, "data": (self.data.ptr, False), "version": 3,
                "strides": self.strides}


def _c_strides(shape, item: int) -> tuple:
    out, step = [], item
    for s in reversed(shape):
        out.append(step)
        step *= max(s, 1)
    return tuple(reversed(out))


def framework_of(x) -> str:
    """"cupy", "torch" or "other" (Numba and anything else with ``__cuda_array_interface__``; None: "cupy")."""
    if x is None or type(x) is cupy_array_type():
        return "cupy"
    if isinstance(x, torch_tensor_type()):
        return "torch"
    if isinstance(x, DeviceArray):
        return x.framework
    return "other"


def as_device_array(x, name: str):
    """``x`` itself for CuPy arrays, None and DeviceArrays; a DeviceArray view of a torch tensor or of any
    ``__cuda_array_interface__`` array; TypeError naming the argument for host arrays."""
    if x is None or type(x) is cupy_array_type() or isinstance(x, DeviceArray):
        return x
    if isinstance(x, torch_tensor_type()):
        if not x.is_cuda:
            raise TypeError(f"{name} is a torch tensor on {x.device}, not on a CUDA device")
        dtype = _torch_numpy_dtype(x.dtype)
        return DeviceArray(x, tuple(x.shape), tuple(s * dtype.itemsize for s in x.stride()), dtype, x.data_ptr(),
                           x.device.index, "torch")
    iface = getattr(x, "__cuda_array_interface__", None)
    if iface is None:
        raise TypeError(f"{name} is not on GPU (got {type(x).__module__}.{type(x).__name__}; use a CuPy array, a "
                        f"torch CUDA tensor or any __cuda_array_interface__ array)")
    dtype = np.dtype(iface["typestr"])
    shape = tuple(iface["shape"])
    strides = iface.get("strides") or _c_strides(shape, dtype.itemsize)
    ptr = int(iface["data"][0])
    return DeviceArray(x, shape, strides, dtype, ptr, _device_of_pointer(x, ptr), "other")


def _device_of_pointer(x, ptr: int) -> int:
    device = getattr(getattr(x, "device", None), "id", None)
    if device is None:
        device = cupy().cuda.runtime.pointerGetAttributes(ptr).device
    return int(device)


def device_pointer(x, name: str) -> tuple[int, int]:
    """(address, device id) of a device array of any framework; TypeError naming the argument otherwise."""
    if type(x) is cupy_array_type():  # no interface dict, no pointer query
        mem = x.data
        return mem.ptr, mem.device_id
    view = as_device_array(x, name)
    return view.data.ptr, view.data.device_id


def empty(framework: str, shape, dtype, device: int, *, zero: bool = False) -> Any:
    """A new array from ``framework``'s pool ("torch": the caching allocator; else CuPy's pool) on ``device``,
    allocated in that framework's current stream order (callers make the launch stream current)."""
    if framework == "torch":
        import torch

        make = torch.zeros if zero else torch.empty
        return make(tuple(shape) if not isinstance(shape, int) else (shape,), dtype=numpy_to_torch_dtype(dtype),
                    device=f"cuda:{device}")
    cp = cupy()
    with cp.cuda.Device(device):
        return (cp.zeros if zero else cp.empty)(shape, dtype=dtype)
