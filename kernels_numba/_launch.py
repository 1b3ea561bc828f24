"""Host-side plumbing shared by every kernel wrapper: device arrays in, device arrays out, streams, poison, and the
launch of a Numba kernel through the project's runtime (``workbench.cuda``).

Every public wrapper in ``kernels_numba`` follows the same three steps (check → allocate → launch):

* **inputs**: NumPy arrays are copied to the device; anything with ``__cuda_array_interface__`` (CuPy, PyTorch,
  Numba device arrays) is used in place, after a device and contiguity check. In the CUDA simulator
  (``NUMBA_ENABLE_CUDASIM=1``) the simulator's own device arrays play that role.
* **outputs**: from the memory pool of the caller's framework (``workbench.cuda.arrays``: PyTorch's caching
  allocator for torch tensors, CuPy's pool otherwise), handed back as a torch tensor for torch callers, a CuPy
  array for other device callers (where CuPy is installed; else a Numba device array), and NumPy when every array
  input was NumPy. Packed words are computed as ``uint32`` (wrapping integer semantics in both worlds) and handed
  back viewed as ``int32``, the checkpoint dtype.
* **streams**: ``stream=None`` is the current stream of the framework the inputs came from
  (``workbench.cuda.streams``); a Numba, CuPy or PyTorch stream or a raw ``CUstream`` integer is accepted.

**Launch.** On a GPU every kernel object the wrappers hold is a ``RuntimeKernel``: ``kernel[grid, block,
stream](*args)`` reads like Numba's launch, but Numba only compiles (once per argument signature and device:
``Dispatcher.compile``); the launch is one ``cuLaunchKernelEx`` of the compiled function with an ``ArgBlock``
filled in Numba's own argument layout (its kernel ABI, read in numba-cuda 0.30's ``_Kernel._prepare_args``): each
array as its expanded fields ``meminfo, parent, nitems, itemsize, data, shape[0..d), strides[0..d)`` — all 8 bytes
— and each scalar in one slot. Numba's dispatcher costs tens of microseconds per call in argument typing and
conversion; this costs a dictionary look-up and one slice store. In the simulator the same source runs through
Numba's dispatcher unchanged. ``numba_dispatcher()`` makes the GPU path launch through Numba's dispatcher too (the
comparison the tests make). Arrays that reach a kernel on the GPU are ``KernelArray``s: an address, a shape and a
dtype (always C-contiguous), owned by the framework array that holds the memory.

Tests can make every output allocation start as a poison pattern (``with poison_outputs(): ...``) so an element a
kernel forgets to write cannot pass an exact comparison.
"""
from __future__ import annotations

import contextlib
import ctypes
import math
import os
import threading
from typing import Any

import numpy as np
from numba import cuda

from workbench.cuda import arrays as _rta
from workbench.cuda import launch as _rtl
from workbench.cuda import streams as _rts

SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1"
POISON_BYTE = 0xA5  # 0xA5A5A5A5 as a word: not a valid result of any transform of fresh random data
_poison_depth = 0
_dispatcher_depth = 0


@contextlib.contextmanager
def poison_outputs():
    """Inside this block every output buffer is filled with POISON_BYTE before the kernel runs."""
    global _poison_depth
    _poison_depth += 1
    try:
        yield
    finally:
        _poison_depth -= 1


@contextlib.contextmanager
def numba_dispatcher():
    """Inside this block the kernels launch through Numba's own dispatcher instead of the runtime (same arrays,
    same kernels): what the runtime launch is compared against."""
    global _dispatcher_depth
    _dispatcher_depth += 1
    try:
        yield
    finally:
        _dispatcher_depth -= 1


def is_device_array(x: Any) -> bool:
    if type(x) is KernelArray:
        return True
    if SIMULATOR:
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        return isinstance(x, FakeCUDAArray) or hasattr(x, "__cuda_array_interface__")
    if type(x) is _rta.cupy_array_type() or type(x) is _rta.DeviceArray:
        return True
    if isinstance(x, _rta.torch_tensor_type()):  # (torch's interface property raises TypeError for bfloat16)
        return x.is_cuda
    return hasattr(x, "__cuda_array_interface__")


def _driver():
    from cuda.bindings import driver

    return driver


def _check(result, what: str):
    err = result[0]
    if int(err) != 0:
        raise RuntimeError(f"{what} failed: {err!r}")
    return result[1] if len(result) > 1 else None


# ---------------------------------------------------------------------------------------------------------------
# device arrays on the GPU path
# ---------------------------------------------------------------------------------------------------------------
def _c_strides(shape: tuple, itemsize: int) -> tuple:
    out, step = [], itemsize
    for s in reversed(shape):
        out.append(step)
        step *= s
    return tuple(reversed(out))


class KernelArray:
    """A C-contiguous device array as a kernel argument: ``ptr`` (address), ``shape``, ``dtype``; ``owner`` is the
    framework array (CuPy, torch, Numba) that holds the memory, kept alive with it. Views (reshape, view, leading
    index/slice) share the owner."""

    __slots__ = ("ptr", "shape", "dtype", "owner", "device")

    def __init__(self, ptr: int, shape: tuple, dtype, owner, device: int):
        self.ptr, self.shape, self.dtype, self.owner, self.device = ptr, shape, dtype, owner, device

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def strides(self) -> tuple:
        return _c_strides(self.shape, self.dtype.itemsize)

    @property
    def flags(self) -> dict:
        return {"C_CONTIGUOUS": True}

    def is_c_contiguous(self) -> bool:
        return True

    def reshape(self, shape) -> KernelArray:
        shape = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(int(s) for s in shape)
        if math.prod(shape) != self.size:
            raise ValueError(f"cannot reshape an array of shape {self.shape} into {shape}")
        return KernelArray(self.ptr, shape, self.dtype, self.owner, self.device)

    def view(self, dtype) -> KernelArray:
        dtype = np.dtype(dtype)
        if dtype == self.dtype:
            return self
        last = self.shape[-1] * self.dtype.itemsize
        if last % dtype.itemsize:
            raise ValueError(f"cannot view the last axis of {self.shape} ({self.dtype}) as {dtype}")
        return KernelArray(self.ptr, self.shape[:-1] + (last // dtype.itemsize,), dtype, self.owner, self.device)

    def __getitem__(self, key) -> KernelArray:
        """Leading integer indices, then at most one unit-step slice: views that stay C-contiguous."""
        key = key if isinstance(key, tuple) else (key,)
        offset, shape = 0, list(self.shape)
        strides = self.strides
        dim = 0
        for k in key:
            if isinstance(k, (int, np.integer)):
                i = int(k) + (shape[0] if k < 0 else 0)
                if not 0 <= i < shape[0]:
                    raise IndexError(f"index {k} is out of bounds for axis {dim} of size {shape[0]}")
                offset += i * strides[dim]
                shape.pop(0)
                dim += 1
                continue
            if isinstance(k, slice) and k is key[-1]:
                start, stop, step = k.indices(shape[0])
                if step != 1:
                    raise IndexError("only unit-step slices keep a device array contiguous")
                offset += start * strides[dim]
                shape[0] = max(0, stop - start)
                break
            raise IndexError(f"index {key!r}: leading integers and one final slice only")
        return KernelArray(self.ptr + offset, tuple(shape), self.dtype, self.owner, self.device)

    def copy_to_host(self, stream: Any = 0) -> np.ndarray:
        """A NumPy copy, after the work queued on ``stream`` (a raw handle or any stream object)."""
        host = np.empty(self.shape, self.dtype)
        handle = _rts.stream_handle(stream)
        cu = _driver()
        if self.nbytes:
            _check(cu.cuMemcpyDtoHAsync(host.ctypes.data, self.ptr, self.nbytes, handle), "cuMemcpyDtoHAsync")
        _check(cu.cuStreamSynchronize(handle), "cuStreamSynchronize")
        rec = _recording()
        if rec is not None:  # a verdict read back: a replay reads it again and goes the full way if it differs
            rec.readback(self.ptr, host, handle)
        return host

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"shape": self.shape, "typestr": self.dtype.str, "data": (self.ptr, False), "version": 3,
                "strides": None, "stream": None}


_TORCH_DTYPES: dict | None = None


def _torch_dtype(dtype: np.dtype):
    global _TORCH_DTYPES
    if _TORCH_DTYPES is None:
        import ml_dtypes
        import torch

        _TORCH_DTYPES = {np.dtype(n): t for n, t in (
            (np.float16, torch.float16), (ml_dtypes.bfloat16, torch.bfloat16), (np.float32, torch.float32),
            (np.int32, torch.int32), (np.uint32, torch.uint32), (np.int64, torch.int64), (np.uint8, torch.uint8),
            (np.int8, torch.int8), (np.int16, torch.int16), (np.uint16, torch.uint16), (np.uint64, torch.uint64))}
    return _TORCH_DTYPES[np.dtype(dtype)]


def _current_device() -> int:
    cu = _driver()
    err, dev = cu.cuCtxGetDevice()
    return int(dev) if int(err) == 0 else 0


class _RuntimeArrays:
    """Collects a call's inputs on the device (GPU path): which framework they came from, their device, the stream."""

    def __init__(self, stream: Any):
        self._stream_arg = stream
        self._stream: int | None = None
        self.any_device = False
        self.framework: str | None = None  # of the first device input: "torch", "cupy" or "other"
        self.device: int | None = None

    @property
    def stream(self) -> int:
        """The raw stream handle of the call (resolved on first use: ``None`` means the current stream of the
        framework the inputs came from)."""
        if self._stream is None:
            self._stream = _rts.stream_handle(self._stream_arg, self.framework or "cupy", self.device)
        return self._stream

    def _device_of_call(self) -> int:
        if self.device is None:
            self.device = _current_device()
        return self.device

    def take(self, x: Any, name: str, view_dtype: Any = None) -> KernelArray:
        """NumPy or device array -> contiguous KernelArray, optionally viewed as view_dtype."""
        if type(x) is KernelArray:
            d = x
        elif is_device_array(x):
            framework = _rta.framework_of(x)
            v = _rta.as_device_array(x, name)
            flags = v.flags
            contiguous = flags["C_CONTIGUOUS"] if not isinstance(flags, dict) else flags.get("C_CONTIGUOUS", True)
            if not contiguous:
                raise ValueError(f"{name} is not C-contiguous (shape {tuple(v.shape)}, strides {v.strides}); "
                                 f"pass a contiguous array")
            owner = v.base if isinstance(v, _rta.DeviceArray) else v
            device = v.data.device_id
            said = getattr(x, "device", None)  # an array that names its device (torch-like) is taken at its word
            if getattr(said, "type", None) == "cuda":
                device = said.index if said.index is not None else 0
            if self.device is None:
                current = _current_device()
                if device != current:
                    raise ValueError(f"{name} is on cuda:{device} but the kernels run on cuda:{current} (the current "
                                     f"CUDA device); move it or select that device first")
                self.device = device
            elif device != self.device:
                raise ValueError(f"{name} is on cuda:{device}, the call's other arrays on cuda:{self.device}")
            if self.framework is None:
                self.framework = framework if type(v) is not _rta.cupy_array_type() else "cupy"
            self.any_device = True
            d = KernelArray(v.data.ptr, tuple(v.shape), np.dtype(v.dtype), owner, device)
        else:
            a = np.asarray(x)
            if a.dtype.kind == "V" or a.dtype.itemsize == 2 and a.dtype.kind not in "iuf":
                a = a.view(np.uint16)  # ml_dtypes.bfloat16: move the raw bits
            a = np.ascontiguousarray(a)
            d = self._alloc(a.shape, a.dtype)
            rec = _recording()
            if rec is not None:  # (host data in a recorded call: the op's constants, e.g. a verdict's first value;
                rec.upload(d.ptr, a, self.stream)  # NumPy inputs never reach a recording, backends.plan_key)
            if a.nbytes:
                _check(_driver().cuMemcpyHtoDAsync(d.ptr, a.ctypes.data, a.nbytes, self.stream), "cuMemcpyHtoDAsync")
        if view_dtype is not None and d.dtype != np.dtype(view_dtype):
            d = d.view(view_dtype)
        return d

    def _alloc(self, shape: tuple, dtype) -> KernelArray:
        """Device memory for ``shape`` x ``dtype`` from the pool of the call's framework, on the call's stream."""
        dtype = np.dtype(dtype)
        shape = tuple(int(s) for s in shape)
        device = self._device_of_call()
        owner, ptr = _allocate(self.framework, device, self.stream, math.prod(shape) * dtype.itemsize)
        rec = _recording()
        if rec is not None:
            rec.allocs.append((ptr, max(1, math.prod(shape) * dtype.itemsize)))
        return KernelArray(ptr, shape, dtype, owner, device)

    def empty(self, shape: tuple[int, ...], dtype: Any) -> KernelArray:
        d = self._alloc(shape, dtype)
        if _poison_depth and d.nbytes:
            _not_replayable()
            _check(_driver().cuMemsetD8Async(d.ptr, POISON_BYTE, d.nbytes, self.stream), "cuMemsetD8Async")
        return d

    def zeros(self, shape: tuple[int, ...], dtype: Any) -> KernelArray:
        """A device buffer set to 0 in stream order (one memset: no host array, no upload)."""
        d = self._alloc(shape, dtype)
        _not_replayable()
        if d.nbytes:
            _check(_driver().cuMemsetD8Async(d.ptr, 0, d.nbytes, self.stream), "cuMemsetD8Async")
        return d

    def copy(self, d: KernelArray) -> KernelArray:
        """A new buffer (from the pool: 256-byte aligned) holding ``d``'s bytes, copied in stream order."""
        out = self._alloc(d.shape, d.dtype)
        _not_replayable()
        if d.nbytes:
            _check(_driver().cuMemcpyDtoDAsync(out.ptr, d.ptr, d.nbytes, self.stream), "cuMemcpyDtoDAsync")
        return out

    def to_host(self, d: KernelArray) -> np.ndarray:
        return d.copy_to_host(self.stream)

    def upload(self, host: np.ndarray, into: KernelArray | None = None) -> KernelArray:
        """``host`` (C-contiguous) on the device, in ``into`` when its shape and dtype match (a staging buffer
        reused in stream order), else in a new buffer."""
        if into is None or into.shape != host.shape or into.dtype != host.dtype:
            into = self._alloc(host.shape, host.dtype)
        _not_replayable()
        if host.nbytes:
            _check(_driver().cuMemcpyHtoDAsync(into.ptr, host.ctypes.data, host.nbytes, self.stream),
                   "cuMemcpyHtoDAsync")
        return into

    def give(self, d: KernelArray, dtype: Any = None):
        """Hand a result back in the caller's world: NumPy for NumPy callers, a torch tensor for torch callers,
        else CuPy (a Numba device array where CuPy is missing)."""
        if dtype is not None and d.dtype != np.dtype(dtype):
            d = d.view(dtype)
        if not self.any_device:
            return d.copy_to_host(self.stream)
        result = _wrap(self.framework, d)
        rec = _recording()
        if rec is not None:
            rec.give(self, d, result)
        return result


def _allocate(framework: str | None, device: int, stream: int, nbytes: int) -> tuple[Any, int]:
    """(owner, address) of ``nbytes`` of device memory from ``framework``'s pool (torch: the caching allocator,
    else CuPy's pool; Numba's allocator where CuPy is missing), in ``stream``'s order."""
    nbytes = max(1, nbytes)
    if framework == "torch":
        import torch

        if torch.cuda.current_stream(device).cuda_stream == stream:
            owner = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{device}")
        else:  # the caching allocator keys blocks by the stream current at allocation: make it the launch's
            with torch.cuda.stream(torch.cuda.ExternalStream(stream, device=device)):
                owner = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{device}")
        return owner, owner.data_ptr()
    try:
        cp = _rta.cupy()
    except RuntimeError:  # no CuPy: Numba's own allocation
        owner = cuda.device_array(nbytes, np.uint8)
        return owner, int(owner.__cuda_array_interface__["data"][0])
    if cp.cuda.runtime.getDevice() == device and cp.cuda.get_current_stream().ptr == stream:
        return _cupy_bytes(cp, nbytes)  # (the common case: the call runs on CuPy's current stream and device)
    with cp.cuda.Device(device), _rts.cupy_stream(stream):
        return _cupy_bytes(cp, nbytes)


def _cupy_bytes(cp, nbytes: int) -> tuple[Any, int]:
    owner = cp.empty(nbytes, dtype=np.uint8)
    return owner, owner.data.ptr


def _wrap(framework: str | None, d: KernelArray):
    """``d`` as an array of ``framework`` (torch: a tensor; else CuPy, or Numba without CuPy), sharing its memory."""
    owner = d.owner
    if framework == "torch":
        import torch

        if isinstance(owner, torch.Tensor) and owner.dtype == torch.uint8 and owner.data_ptr() == d.ptr:
            return owner[:d.nbytes].view(_torch_dtype(d.dtype)).view(d.shape)
        return torch.as_tensor(d, device=f"cuda:{d.device}")
    try:
        cp = _rta.cupy()
    except RuntimeError:
        return cuda.as_cuda_array(d)
    if type(owner) is cp.ndarray:
        return cp.ndarray(d.shape, d.dtype, cp.cuda.MemoryPointer(owner.data.mem, d.ptr - owner.data.mem.ptr))
    return cp.asarray(d)


class _SimulatorArrays:
    """The simulator's version of the same steps: Numba (simulator) device arrays throughout."""

    def __init__(self, stream: Any):
        self.stream = cuda.default_stream()  # the simulator runs kernels synchronously; streams carry no meaning
        if stream is not None and stream != 0 and not _names_a_stream(stream):
            raise TypeError(f"stream = {stream!r} is not a CUDA stream (Numba, CuPy or PyTorch stream, or an int "
                            f"handle)")
        self.any_device = False

    def take(self, x: Any, name: str, view_dtype: Any = None):
        if is_device_array(x):
            self.any_device = True
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

    def zeros(self, shape: tuple[int, ...], dtype: Any):
        return cuda.to_device(np.zeros(tuple(int(s) for s in shape), dtype=dtype), stream=self.stream)

    def copy(self, d):
        out = cuda.device_array(d.shape, dtype=d.dtype, stream=self.stream)
        out.copy_to_device(d, stream=self.stream)
        return out

    def to_host(self, d) -> np.ndarray:
        host = d.copy_to_host(stream=self.stream)
        self.stream.synchronize()
        return host

    def upload(self, host: np.ndarray, into=None):
        if into is None or tuple(into.shape) != host.shape or np.dtype(into.dtype) != host.dtype:
            into = cuda.device_array(host.shape, host.dtype, stream=self.stream)
        into.copy_to_device(host, stream=self.stream)
        return into

    def give(self, d, dtype: Any = None):
        if dtype is not None and np.dtype(d.dtype) != np.dtype(dtype):
            d = d.view(dtype)
        if not self.any_device:
            return self.to_host(d)
        return d


def _names_a_stream(stream: Any) -> bool:
    return isinstance(stream, (int, np.integer)) or any(hasattr(stream, a) for a in
                                                        ("ptr", "cuda_stream", "handle", "__cuda_stream__"))


Arrays = _SimulatorArrays if SIMULATOR else _RuntimeArrays


# ---------------------------------------------------------------------------------------------------------------
# kernels launched through the runtime
# ---------------------------------------------------------------------------------------------------------------
class _Plan:
    """One compiled (kernel, argument signature, device): its function, argument block and launch."""

    __slots__ = ("args", "launch", "lock")

    def __init__(self, function: int, kinds: str):
        self.args = _rtl.ArgBlock(kinds)
        self.launch = _rtl.Launch(function, 1, 1, 0)
        self.lock = threading.Lock()


def _function_handle(cufunc) -> int:
    """The CUfunction of a loaded Numba kernel (numba-cuda loads kernels as library kernels: CUkernel, which
    cuKernelGetFunction turns into the current context's function)."""
    handle = cufunc.handle
    cu = _driver()
    if isinstance(handle, cu.CUkernel):
        handle = _check(cu.cuKernelGetFunction(handle), "cuKernelGetFunction")
    return int(handle)


_SCALARS = {int: "int", bool: "bool", np.int32: "int32", np.uint32: "uint32", np.int64: "int64",
            np.uint64: "uint64", np.bool_: "bool"}


def _interface_fields(a) -> tuple[int, tuple, np.dtype] | None:
    """(address, shape, dtype) of a C-contiguous ``__cuda_array_interface__`` array, else None."""
    iface = a.__cuda_array_interface__
    shape, dtype = tuple(iface["shape"]), np.dtype(iface["typestr"])
    strides = iface.get("strides")
    if strides is not None and tuple(strides) != _c_strides(shape, dtype.itemsize) and math.prod(shape) > 1:
        return None
    return int(iface["data"][0]), shape, dtype


class RuntimeKernel:
    """A Numba kernel launched through the runtime (see the module docstring); ``dispatcher`` is Numba's."""

    def __init__(self, dispatcher):
        self.dispatcher = dispatcher
        self._plans: dict = {}
        self._compile_lock = threading.Lock()

    def __getitem__(self, config):
        grid, block, stream = (tuple(config) + (0,))[:3]
        return lambda *args: self.launch(grid, block, stream, args)

    def __getattr__(self, name: str):  # everything else (inspection, overloads) is the dispatcher's
        return getattr(self.dispatcher, name)

    def launch(self, grid, block, stream, args) -> None:
        if _dispatcher_depth:
            return self._dispatcher_launch(grid, block, stream, args)
        key, values, ptr_slots = [], [], []
        for a in args:
            t = type(a)
            if t is KernelArray:
                shape = a.shape
                item = a.dtype.itemsize
            elif hasattr(a, "__cuda_array_interface__"):
                fields = _interface_fields(a)
                if fields is None:  # strided: Numba's own launch takes layout "A"
                    return self._dispatcher_launch(grid, block, stream, args)
                ptr, shape, dtype = fields
                a = KernelArray(ptr, shape, dtype, a, -1)
                item = dtype.itemsize
            else:
                kind = _SCALARS.get(t)
                if kind is None:
                    return self._dispatcher_launch(grid, block, stream, args)
                key.append(kind)
                values.append(int(a))
                continue
            key.append((a.dtype, len(shape)))
            ptr_slots.append(len(values) + 4)
            values += (0, 0, math.prod(shape), item, a.ptr)
            values += shape
            values += _c_strides(shape, item)
        handle = stream if type(stream) is int else _rts.stream_handle(stream)
        key.append(_current_device())
        key = tuple(key)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._compile(key, args, len(values))
        rec = _recording()
        if rec is not None:
            rec.launch(plan, values, ptr_slots, grid, block, handle)
        _launch_plan(plan, grid, block, handle, values)

    def _compile(self, key: tuple, args, nvalues: int) -> _Plan:
        from numba import from_dtype, typeof, types

        sig = []
        for k, a in zip(key, args):
            if isinstance(k, tuple):
                sig.append(types.Array(from_dtype(k[0]), k[1], "C"))
            else:
                sig.append(typeof(a))
        with self._compile_lock:
            plan = self._plans.get(key)
            if plan is None:
                kernel = self.dispatcher.compile(tuple(sig))
                plan = _Plan(_function_handle(kernel._codelibrary.get_cufunc()), "q" * max(1, nvalues))
                self._plans[key] = plan
        return plan

    def _dispatcher_launch(self, grid, block, stream, args) -> None:
        _not_replayable()
        self.dispatcher[grid, block, _numba_stream(stream)](*args)


def _launch_plan(plan: _Plan, grid, block, handle: int, values: list) -> None:
    """One launch of a compiled kernel: its argument block filled with ``values`` (under the plan's lock: the
    launch copies the block before it returns), its grid and block set, on the raw stream ``handle``."""
    with plan.lock:
        plan.args.wides[:] = values
        launch = plan.launch
        if launch.threads != block:
            launch = plan.launch = type(launch)(launch.function, grid, block, 0)
        elif launch.grid != grid:
            launch.set_grid(grid if isinstance(grid, int) else tuple(grid))
        _rtl.launch_kernel(launch, handle, plan.args.address)


_external_streams: dict[int, Any] = {}


def _numba_stream(stream: Any):
    from numba.cuda.cudadrv.driver import Stream

    if isinstance(stream, Stream):
        return stream
    handle = _rts.stream_handle(stream) if stream is not None else 0
    if handle == 0:
        return cuda.default_stream()
    s = _external_streams.get(handle)
    if s is None:
        s = _external_streams.setdefault(handle, cuda.external_stream(handle))
    return s


def runtime_kernel(dispatcher):
    """The object the wrappers launch: Numba's dispatcher in the simulator, a RuntimeKernel over it on a GPU."""
    return dispatcher if SIMULATOR else RuntimeKernel(dispatcher)


def jit(function):
    """``cuda.jit`` for a kernel (not a device function), launched through the runtime on a GPU."""
    return runtime_kernel(cuda.jit(function))


# ---------------------------------------------------------------------------------------------------------------
# call plans: an op's first call with some argument metadata is recorded (its allocations and launches); the next
# call with the same metadata replays them with the new addresses (workbench.backends.run_planned decides when)
# ---------------------------------------------------------------------------------------------------------------
_local = threading.local()
UPLOAD, READBACK = "upload", "readback"  # the steps of a recorded call that are not launches


def _recording() -> _Recording | None:
    return getattr(_local, "recording", None)


def _not_replayable() -> None:
    rec = getattr(_local, "recording", None)
    if rec is not None:
        rec.ok = False


class _Recording:
    """What one op call did on the GPU path, in terms a replay can redo: allocations (sizes), launches (the
    compiled plan, the argument values, which of them are addresses of which input or allocation), the result
    (which allocation, its shape and dtype, the framework it was handed back in), in ``launches`` with them, in
    order: uploads of the op's host constants and readbacks of verdicts (the bytes read). A replay reads each
    verdict again and gives up (the caller goes the full way, which raises the error) when its bytes differ from
    the recorded call's, so everything the op decided from them holds. Poison, staging uploads and Numba-dispatcher
    launches make it not replayable (``ok`` False)."""

    def __init__(self, inputs: list[tuple[int, int]]):
        self.inputs = inputs  # (address, nbytes) of the op's device array arguments, in order
        self.allocs: list[tuple[int, int]] = []
        self.launches: list[tuple] = []
        self.given = None
        self.stream: int | None = None
        spans = sorted((base, base + max(1, n)) for base, n in inputs)
        # inputs that share memory: a replay could not tell which one a launch argument came from
        self.ok = all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))

    def _locate(self, ptr: int):
        for kind, table in ((0, self.inputs), (1, self.allocs)):
            for i, (base, nbytes) in enumerate(table):
                if base <= ptr < base + nbytes:
                    return kind, i, ptr - base
        return None

    def _same_stream(self, handle: int) -> None:
        if self.stream is None:
            self.stream = handle
        elif self.stream != handle:
            self.ok = False

    def launch(self, plan: _Plan, values: list, ptr_slots: list, grid, block, handle: int) -> None:
        self._same_stream(handle)
        subs = []
        for slot in ptr_slots:
            where = self._locate(values[slot])
            if where is None:
                self.ok = False
                return
            subs.append((slot,) + where)
        self.launches.append((plan, list(values), tuple(subs), grid, block))

    def upload(self, ptr: int, host: np.ndarray, handle: int) -> None:
        self._step(UPLOAD, ptr, np.array(host, copy=True), handle)

    def readback(self, ptr: int, host: np.ndarray, handle: int) -> None:
        self._step(READBACK, ptr, np.array(host, copy=True), handle)

    def _step(self, tag: str, ptr: int, data: np.ndarray, handle: int) -> None:
        self._same_stream(handle)
        where = self._locate(ptr)
        if where is None:
            self.ok = False
            return
        self.launches.append((tag,) + where + (data,))

    def give(self, arrays: _RuntimeArrays, d: KernelArray, result) -> None:
        where = self._locate(d.ptr)
        if self.given is not None or where is None or where[0] != 1:
            self.ok = False
            return
        self._same_stream(arrays.stream)
        self.given = (result, where[1], where[2], d.shape, d.dtype, arrays.framework, arrays.device,
                      arrays._stream_arg is None)

    def plan(self, result) -> CallPlan | None:
        if not (self.ok and self.launches and self.given is not None and self.given[0] is result):
            return None
        _, index, offset, shape, dtype, framework, device, _ = self.given
        return CallPlan([n for _, n in self.allocs], self.launches, (index, offset, shape, dtype), framework, device)


@contextlib.contextmanager
def recording(inputs: list[tuple[int, int]]):
    """Record the op call run inside the block (this thread); yields the _Recording."""
    rec = _Recording(inputs)
    _local.recording = rec
    try:
        yield rec
    finally:
        _local.recording = None


def replay_allowed() -> bool:
    """No poison, no dispatcher comparison, no recording in progress (an op called inside another op's call)."""
    return not (_poison_depth or _dispatcher_depth or getattr(_local, "recording", None) is not None)


class CallPlan:
    """A recorded op call (see _Recording) replayed for new input addresses: the same allocations from the same
    framework's pool, the same launches with the addresses substituted, the result wrapped the same way."""

    __slots__ = ("allocs", "launches", "out", "framework", "device")

    def __init__(self, allocs, launches, out, framework, device):
        self.allocs, self.launches, self.out = allocs, launches, out
        self.framework, self.device = framework, device

    def __call__(self, ptrs: list[int], stream: Any):
        """The op's result for inputs at ``ptrs`` on ``stream``; None when the current device is not the
        recorded one or a verdict differs from the recorded call's (the caller takes the full path, which says
        why)."""
        if _current_device() != self.device:
            return None
        handle = _rts.stream_handle(stream, self.framework or "cupy", self.device)
        owners, bases = [], []
        for nbytes in self.allocs:
            owner, ptr = _allocate(self.framework, self.device, handle, nbytes)
            owners.append(owner)
            bases.append(ptr)
        if not self.run(ptrs, bases, handle):
            return None
        index, offset, shape, dtype = self.out
        return _wrap(self.framework, KernelArray(bases[index] + offset, shape, dtype, owners[index], self.device))

    def run(self, ptrs: list[int], bases: list[int], handle: int) -> bool:
        """The recorded steps for inputs at ``ptrs`` and allocations at ``bases`` on stream ``handle``; False as
        soon as a verdict read back differs from the recorded one."""
        cu = None
        for step in self.launches:
            tag = step[0]
            if tag is UPLOAD or tag is READBACK:
                _, kind, index, offset, data = step
                ptr = (ptrs if kind == 0 else bases)[index] + offset
                cu = cu or _driver()
                if tag is UPLOAD:
                    _check(cu.cuMemcpyHtoDAsync(ptr, data.ctypes.data, data.nbytes, handle), "cuMemcpyHtoDAsync")
                    continue
                host = np.empty_like(data)
                _check(cu.cuMemcpyDtoHAsync(host.ctypes.data, ptr, data.nbytes, handle), "cuMemcpyDtoHAsync")
                _check(cu.cuStreamSynchronize(handle), "cuStreamSynchronize")
                if host.tobytes() != data.tobytes():
                    return False
                continue
            plan, template, subs, grid, block = step
            values = template.copy()
            for slot, kind, index, offset in subs:
                values[slot] = (ptrs if kind == 0 else bases)[index] + offset
            _launch_plan(plan, grid, block, handle, values)
        return True


# ---------------------------------------------------------------------------------------------------------------
# small helpers
# ---------------------------------------------------------------------------------------------------------------
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
    """``d`` on the host, after the work queued on ``stream``."""
    if type(d) is KernelArray:
        return d.copy_to_host(stream)
    host = d.copy_to_host(stream=stream)
    stream.synchronize()
    return host
