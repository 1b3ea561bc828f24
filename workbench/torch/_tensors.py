"""Torch tensors as the rest of the workbench sees arrays: NumPy dtypes, byte strides, contiguity flags.

The validation in ``workbench.gemm`` and ``workbench.formats._checks`` reads ``.shape``, ``.dtype`` (as a NumPy
dtype), ``.strides`` (bytes) and ``.flags["C_CONTIGUOUS"]``. A torch tensor has torch dtypes and element strides, so
the ops hand those checks an ``ArraySpec`` made from the tensor instead of re-implementing them (one rule, one
message). Specs read only metadata, so they work on fake and meta tensors while ``torch.compile`` traces.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import ml_dtypes
import numpy as np
import torch

# torch dtype -> NumPy dtype, for the dtypes the Marlin ops take
NUMPY_DTYPE = {
    torch.float16: np.dtype(np.float16),
    torch.bfloat16: np.dtype(ml_dtypes.bfloat16),
    torch.float32: np.dtype(np.float32),
    torch.int32: np.dtype(np.int32),
    torch.int64: np.dtype(np.int64),
    torch.uint8: np.dtype(np.uint8),
    torch.int8: np.dtype(np.int8),
    torch.int16: np.dtype(np.int16),
    torch.float8_e4m3fn: np.dtype(ml_dtypes.float8_e4m3fn),
    torch.float8_e8m0fnu: np.dtype(ml_dtypes.float8_e8m0fnu),  # (the MX formats' scales)
}
TORCH_DTYPE = {v: k for k, v in NUMPY_DTYPE.items()}


def numpy_dtype(dtype: torch.dtype, name: str) -> np.dtype:
    if dtype not in NUMPY_DTYPE:
        raise TypeError(f"{name} has dtype {dtype}, which no Marlin op takes")
    return NUMPY_DTYPE[dtype]


def torch_dtype(dtype) -> torch.dtype:
    return TORCH_DTYPE[np.dtype(dtype)]


@dataclasses.dataclass(frozen=True)
class ArraySpec:
    """Shape, NumPy dtype, byte strides and contiguity of a tensor: what the shared checks read."""

    shape: tuple
    dtype: np.dtype
    strides: tuple
    contiguous: bool

    @property
    def flags(self) -> dict:
        return {"C_CONTIGUOUS": self.contiguous}

    @classmethod
    def contiguous(cls, shape: tuple, dtype: np.dtype) -> "ArraySpec":
        """The spec of a row-major array that does not exist (e.g. the buffers a layer would have)."""
        strides, step = [], dtype.itemsize
        for extent in reversed(shape):
            strides.insert(0, step)
            step *= extent
        return cls(tuple(shape), dtype, tuple(strides), True)

    @property
    def size(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def spec(x: torch.Tensor | None, name: str, rows: Any = None) -> ArraySpec | None:
    """The spec of ``x`` (None for None). ``rows`` replaces the leading extent: the ops pass a representative row
    count when M is symbolic, so that checks written for ints do not specialize the traced graph on M."""
    if x is None:
        return None
    dt = numpy_dtype(x.dtype, name)
    shape = tuple(x.shape)
    if rows is not None and shape:
        shape = (rows,) + shape[1:]
    strides = tuple(s * dt.itemsize for s in x.stride())
    return ArraySpec(shape, dt, strides, _contiguous(x, shape))


def _contiguous(x: torch.Tensor, shape: tuple) -> bool:
    """Row-major contiguity from the strides, skipping extents of 1 (their stride never matters), as NumPy does."""
    expected = 1
    for extent, stride in zip(reversed(shape), reversed(x.stride())):
        if extent != 1 and stride != expected:
            return False
        expected *= extent
    return True


def is_empty(x: torch.Tensor | None) -> bool:
    """vLLM passes "no tensor" as None or as an empty tensor (``torch.empty(0)``)."""
    return x is None or x.numel() == 0


def require_cuda(op: str, name: str, x: torch.Tensor) -> None:
    """CUDA-only ops: a clear error for a tensor elsewhere (meta tensors pass: they are what tracing runs on)."""
    if x.device.type not in ("cuda", "meta"):
        raise RuntimeError(f"{op}: {name} is on {x.device}, but this op runs on CUDA devices only (the Marlin "
                           f"kernels); move the inputs to a GPU with .cuda()")


def require_same_device(op: str, anchor_name: str, anchor: torch.Tensor, **others: torch.Tensor | None) -> None:
    for name, x in others.items():
        if x is not None and x.device != anchor.device:
            raise ValueError(f"{op}: {name} is on {x.device} but {anchor_name} is on {anchor.device}; all tensors "
                             f"of one call must be on one device")


def require_positive_ints(op: str, **values: Any) -> None:
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{op}: {name} = {v!r} must be an int > 0")


def require_int32_vectors(op: str, what: str, **tensors: torch.Tensor) -> None:
    """Index buffers (routing, alignment): contiguous 1-D int32; ``what`` says where they come from."""
    for name, x in tensors.items():
        if x.dtype != torch.int32 or x.dim() != 1 or not x.is_contiguous():
            raise TypeError(f"{op}: {name} must be a contiguous 1-D int32 tensor{what}, got {x.dtype} of shape "
                            f"{tuple(x.shape)}")


def require_unimplemented_absent(op: str, **args: Any) -> None:
    """Arguments of vLLM's signature that no workbench kernel implements yet must be None / empty / False."""
    for name, value in args.items():
        given = bool(value) if isinstance(value, bool) else not is_empty(value)
        if given:
            shown = value if isinstance(value, bool) else f"a tensor of shape {tuple(value.shape)}"
            raise NotImplementedError(f"{op}: {name} = {shown} is not implemented by the workbench kernels yet "
                                      f"(pass None{' / False' if isinstance(value, bool) else ''}); see docs/torch.md")


def cupy_view(x: torch.Tensor | None):
    """A zero-copy CuPy view of a CUDA tensor through DLPack (None for None). The caller runs this inside
    ``cupy_stream(...)`` of the torch stream, so the exchange needs no cross-stream synchronisation."""
    if x is None:
        return None
    import cupy

    return cupy.from_dlpack(x.detach())  # torch exports no tensor that autograd tracks; the ops are inference-only


def cupy_stream(stream_ptr: int):
    """The torch stream as CuPy's current stream (a context manager)."""
    import cupy

    return cupy.cuda.ExternalStream(stream_ptr)


def from_device_array(x, like: torch.Tensor) -> torch.Tensor:
    """A Numba/CuPy result -> a tensor from torch's caching allocator on ``like``'s device (one device copy on the
    current torch stream, which the producing kernel ran on too)."""
    return torch.as_tensor(x, device=like.device).clone()


def to_numpy(x: torch.Tensor | None) -> np.ndarray | None:
    """A CPU tensor's memory as a NumPy array (no copy; bfloat16 and float8 through their bit patterns)."""
    if x is None:
        return None
    dt = numpy_dtype(x.dtype, "tensor")
    if x.dtype in (torch.bfloat16, torch.float8_e4m3fn):
        bits = torch.int16 if x.dtype == torch.bfloat16 else torch.uint8
        return x.detach().view(bits).numpy().view(dt)
    return x.detach().numpy()


def from_numpy(a: np.ndarray) -> torch.Tensor:
    """A NumPy result as a CPU tensor (no copy; bfloat16 and float8 through their bit patterns)."""
    a = np.ascontiguousarray(a)
    dt = torch_dtype(a.dtype)
    if dt in (torch.bfloat16, torch.float8_e4m3fn):
        bits = np.int16 if dt == torch.bfloat16 else np.uint8
        return torch.from_numpy(a.view(bits)).view(dt)
    return torch.from_numpy(a)
