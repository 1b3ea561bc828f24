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
    from workbench.cuda.arrays import torch_tensor_type

    if isinstance(x, torch_tensor_type()):  # (torch's interface property raises TypeError for bfloat16)
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
        from workbench.cuda.streams import stream_handle

        host = np.empty(self.shape, self.dtype)
        handle = stream_handle(stream)
        cu = _driver()
        if self.nbytes:
            _check(cu.cuMemcpyDtoHAsync(host.ctypes.data, self.ptr, self.nbytes, handle), "cuMemcpyDtoHAsync")
        _check(cu.cuStreamSynchronize(handle), "cuStreamSynchronize")
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
            from workbench.cuda.streams import stream_handle

            self._stream = stream_handle(self._stream_arg, self.framework or "cupy", self.device)
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
            from workbench.cuda.arrays import DeviceArray, as_device_array, cupy_array_type, framework_of

            framework = framework_of(x)
            v = as_device_array(x, name)
            flags = v.flags
            contiguous = flags["C_CONTIGUOUS"] if not isinstance(flags, dict) else flags.get("C_CONTIGUOUS", True)
            if not contiguous:
                raise ValueError(f"{name} is not C-contiguous (shape {tuple(v.shape)}, strides {v.strides}); "
                                 f"pass a contiguous array")
            owner = v.base if isinstance(v, DeviceArray) else v
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
                self.framework = framework if type(v) is not cupy_array_type() else "cupy"
            self.any_device = True
            d = KernelArray(v.data.ptr, tuple(v.shape), np.dtype(v.dtype), owner, device)
        else:
            a = np.asarray(x)
            if a.dtype.kind == "V" or a.dtype.itemsize == 2 and a.dtype.kind not in "iuf":
                a = a.view(np.uint16)  # ml_dtypes.bfloat16: move the raw bits
            a = np.ascontiguousarray(a)
            d = self._alloc(a.shape, a.dtype)
            if a.nbytes:
                _check(_driver().cuMemcpyHtoDAsync(d.ptr, a.ctypes.data, a.nbytes, self.stream), "cuMemcpyHtoDAsync")
        if view_dtype is not None and d.dtype != np.dtype(view_dtype):
            d = d.view(view_dtype)
        return d

    def _alloc(self, shape: tuple, dtype) -> KernelArray:
        """Device memory for ``shape`` x ``dtype`` from the pool of the call's framework (torch: the caching
        allocator, else CuPy's pool; Numba's allocator where CuPy is missing), on the call's stream."""
        dtype = np.dtype(dtype)
        shape = tuple(int(s) for s in shape)
        nbytes = max(1, math.prod(shape) * dtype.itemsize)
        device = self._device_of_call()
        if self.framework == "torch":
            import torch

            if torch.cuda.current_stream(device).cuda_stream == self.stream:
                owner = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{device}")
            else:  # the caching allocator keys blocks by the stream current at allocation: make it the launch's
                with torch.cuda.stream(torch.cuda.ExternalStream(self.stream, device=device)):
                    owner = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{device}")
            ptr = owner.data_ptr()
        else:
            try:
                from workbench.cuda.arrays import cupy
                from workbench.cuda.streams import cupy_stream

                cp = cupy()
            except RuntimeError:  # no CuPy: Numba's own allocation
                owner = cuda.device_array(nbytes, np.uint8)
                ptr = int(owner.__cuda_array_interface__["data"][0])
            else:
                with cp.cuda.Device(device), cupy_stream(self.stream):
                    owner = cp.empty(nbytes, dtype=np.uint8)
                ptr = owner.data.ptr
        return KernelArray(ptr, shape, dtype, owner, device)

    def empty(self, shape: tuple[int, ...], dtype: Any) -> KernelArray:
        d = self._alloc(shape, dtype)
        if _poison_depth and d.nbytes:
            _check(_driver().cuMemsetD8Async(d.ptr, POISON_BYTE, d.nbytes, self.stream), "cuMemsetD8Async")
        return d

    def to_host(self, d: KernelArray) -> np.ndarray:
        return d.copy_to_host(self.stream)

    def upload(self, host: np.ndarray, into: KernelArray | None = None) -> KernelArray:
        """``host`` (C-contiguous) on the device, in ``into`` when its shape and dtype match (a staging buffer
        reused in stream order), else in a new buffer."""
        if into is None or into.shape != host.shape or into.dtype != host.dtype:
            into = self._alloc(host.shape, host.dtype)
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
        owner = d.owner
        if self.framework == "torch":
            import torch

            if isinstance(owner, torch.Tensor) and owner.dtype == torch.uint8 and owner.data_ptr() == d.ptr:
                return owner[:d.nbytes].view(_torch_dtype(d.dtype)).view(d.shape)
            return torch.as_tensor(d, device=f"cuda:{d.device}")
        try:
            from workbench.cuda.arrays import cupy

            cp = cupy()
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
        from workbench.cuda.launch import ArgBlock, Launch

        self.args = ArgBlock(kinds)
        self.launch = Launch(function, 1, 1, 0)
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
        key, values = [], []
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
            values += (0, 0, math.prod(shape), item, a.ptr)
            values += shape
            values += _c_strides(shape, item)
        from workbench.cuda.streams import stream_handle

        handle = stream if type(stream) is int else stream_handle(stream)
        key.append(_current_device())
        key = tuple(key)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._compile(key, args, len(values))
        from workbench.cuda.launch import launch_kernel

        with plan.lock:
            plan.args.wides[:] = values
            plan.launch.set_grid(grid if isinstance(grid, int) else tuple(grid))
            if plan.launch.threads != block:
                plan.launch = type(plan.launch)(plan.launch.function, grid, block, 0)
            launch_kernel(plan.launch, handle, plan.args.address)

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
        self.dispatcher[grid, block, _numba_stream(stream)](*args)


_external_streams: dict[int, Any] = {}


def _numba_stream(stream: Any):
    from numba.cuda.cudadrv.driver import Stream

    if isinstance(stream, Stream):
        return stream
    from workbench.cuda.streams import stream_handle

    handle = stream_handle(stream) if stream is not None else 0
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
