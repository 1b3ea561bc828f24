"""Backend dispatch for ``workbench.ops``: which implementation runs an already-validated op.

* ``"numpy"`` — the NumPy reference in ``workbench.formats`` (the spec). Refuses device arrays.
* ``"numba"`` — the Numba-CUDA kernel in ``kernels_numba``: on a real GPU when there is one, else in the CUDA
  simulator. NumPy in -> NumPy out; device arrays in -> device arrays out (CuPy where CuPy can talk to the GPU,
  otherwise Numba device arrays).
* ``"cpu"``   — the host loops of ``workbench.host_repack`` (Numba-compiled for the CPU, bit for bit the reference)
  for the ops the checkpoint pipeline converts with; every other op runs its reference. Refuses device arrays.
* ``"auto"``  — the kernel when any argument is a CUDA device array (anything with ``__cuda_array_interface__``:
  CuPy, PyTorch, Numba; or a simulator device array), NumPy otherwise.

The simulator has to be chosen before ``numba.cuda`` is first imported. ``backend="numba"`` on a machine without a
CUDA driver therefore switches this process to the simulator on first use if nothing has imported ``numba.cuda``
yet, and otherwise raises a RuntimeError that says how to get it (``NUMBA_ENABLE_CUDASIM=1``).

``normalize(x, name)`` is the one conversion of an op's array argument on entry: a device array becomes a view
with NumPy dtypes (``workbench.cuda.as_device_array``: CuPy arrays as they are, PyTorch tensors and other
``__cuda_array_interface__`` arrays as a ``DeviceArray``; in the simulator a Numba device array), so that
validation reads one set of attributes; a byte-swapped, Fortran-ordered or strided NumPy array becomes a
native-order C-contiguous copy; a list is refused.
"""
from __future__ import annotations

import ctypes
import math
import os
import sys
from typing import Any, Callable

import numpy as np

from workbench.cuda import arrays as _rta
from workbench.formats._checks import require_array

BACKENDS = ("auto", "numpy", "numba", "cpu")

# op name -> (module in kernels_numba, function name); each kernel wrapper takes the op's positional args + stream=
KERNELS = {
    "gptq_marlin_repack": ("marlin_repack", "gptq_marlin_repack"),
    "awq_marlin_repack": ("marlin_repack", "awq_marlin_repack"),
    "fp8_marlin_repack_raw_bits": ("marlin_repack", "fp8_marlin_repack_raw_bits"),
    "block_fp8_group128_repack": ("marlin_repack", "block_fp8_group128_repack"),
    "marlin_to_gptq_qweight": ("marlin_repack", "marlin_to_gptq_qweight"),
    "marlin_to_awq_qweight": ("marlin_repack", "marlin_to_awq_qweight"),
    "marlin_to_fp8_raw_bits": ("marlin_repack", "marlin_to_fp8_raw_bits"),
    "marlin_to_block_fp8": ("marlin_repack", "marlin_to_block_fp8_row_major"),
    "marlin_permute_scales": ("scales", "marlin_permute_scales"),
    "marlin_unpermute_scales": ("scales", "marlin_unpermute_scales"),
    "marlin_zero_points": ("scales", "marlin_zero_points"),
    "awq_to_marlin_zero_points": ("scales", "awq_to_marlin_zero_points"),
    "repack_gptq_qzeros_to_marlin": ("scales", "repack_gptq_qzeros_to_marlin"),
    "gptq_qzeros_are_symmetric_code7": ("scales", "gptq_qzeros_are_symmetric_code7"),
    "marlin_zero_points_to_codes": ("scales", "marlin_zero_points_to_codes"),
    "marlin_to_awq_zero_points": ("scales", "marlin_to_awq_zero_points"),
    "marlin_to_gptq_qzeros": ("scales", "marlin_to_gptq_qzeros"),
    "block_fp8_group128_scales": ("scales", "block_fp8_group128_scales"),
    "stack_gptq_experts_to_marlin": ("moe", "stack_gptq_experts_to_marlin"),
}


def _is_cupy_array(t: type) -> bool:
    """``t`` is CuPy's array type. Without CuPy imported there is no CuPy array, and asking must not import it: the
    CPU path would pay CuPy's import (and the CUDA libraries' memory) in every worker process."""
    known = _rta._cupy_array  # (resolved by the first caller that had CuPy)
    if known is None:
        if "cupy" not in sys.modules:
            return False
        known = _rta.cupy_array_type()
    return t is known


def is_device_array(x: Any) -> bool:
    t = type(x)
    if t is _rta.DeviceArray or _is_cupy_array(t):
        return True
    if isinstance(x, _rta.torch_tensor_type()):  # (torch's interface property raises TypeError for bfloat16)
        return x.is_cuda
    if hasattr(x, "__cuda_array_interface__"):
        return True
    return t.__name__ == "FakeCUDAArray"  # the CUDA simulator's device array


def _cuda_driver_has_device() -> bool:
    """True when libcuda loads and reports at least one device (probed without importing numba.cuda)."""
    for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        count = ctypes.c_int(0)
        return lib.cuInit(0) == 0 and lib.cuDeviceGetCount(ctypes.byref(count)) == 0 and count.value > 0
    return False


_target: str | None = None  # "gpu" once found (a process never leaves it)


def ensure_numba_target() -> str:
    """Make sure Numba kernels can run here; returns "gpu" or "simulator" (raises RuntimeError if neither)."""
    global _target
    if _target is not None:
        return _target
    if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1":
        return "simulator"
    if "numba.cuda" not in sys.modules and not _cuda_driver_has_device():
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"  # no GPU: take the simulator while it can still be chosen
        try:
            import numba

            numba.config.ENABLE_CUDASIM = 1
        except ImportError as exc:  # pragma: no cover - numba is a dependency
            raise RuntimeError("backend='numba' needs numba and numba-cuda installed") from exc
        return "simulator"
    from workbench import hardware

    if hardware.gpu_available():
        _target = "gpu"
        return _target
    raise RuntimeError("backend='numba': no CUDA GPU is usable and numba.cuda was already imported in GPU mode, so "
                       "the CUDA simulator can no longer be chosen; set NUMBA_ENABLE_CUDASIM=1 before starting Python")


_kernels: dict[str, Callable[..., Any]] = {}


def kernel_for(op_name: str) -> Callable[..., Any]:
    kernel = _kernels.get(op_name)
    if kernel is not None:
        return kernel
    if op_name not in KERNELS:
        raise NotImplementedError(f"{op_name}: there is no Numba kernel for this op; use backend='numpy'")
    target = ensure_numba_target()
    import importlib

    module, name = KERNELS[op_name]
    kernel = getattr(importlib.import_module(f"kernels_numba.{module}"), name)
    if target == "gpu":
        _kernels[op_name] = kernel
    return kernel


def host_op(op_name: str, reference: Callable[..., Any]) -> Callable[..., Any]:
    """The ``"cpu"`` backend's implementation of ``op_name``: its host loop, or the reference where there is none.
    (``workbench.host_repack`` is imported on first use: it loads Numba and its compiled loops.)"""
    from workbench import host_repack

    return host_repack.OPS.get(op_name, reference)


def normalize(x: Any, name: str | None = None) -> Any:
    """An op's array argument, converted once on entry (the one place that does it, for both backends):

    * a device array -> itself (CuPy) or a ``DeviceArray`` view with a NumPy dtype (PyTorch, other interface
      arrays; in the simulator a Numba device array), used in place, no copy;
    * a host NumPy array that is byte-swapped, Fortran-ordered or strided -> a native-order C-contiguous copy
      (the caller's array is never changed); other NumPy arrays pass through;
    * with ``name`` given, anything that is not an array (a list, a scalar) is refused with a TypeError naming it
      (``_checks.require_array``); ``None`` passes through (optional arguments such as ``perm``).
    """
    if x is None:
        return None
    if isinstance(x, np.ndarray):
        if not x.dtype.isnative:
            x = x.astype(x.dtype.newbyteorder("="))
        return np.ascontiguousarray(x)
    t = type(x)
    if t is _rta.DeviceArray or _is_cupy_array(t):
        return x
    torch_cuda = isinstance(x, _rta.torch_tensor_type()) and x.is_cuda
    if torch_cuda or (not isinstance(x, _rta.torch_tensor_type()) and hasattr(x, "__cuda_array_interface__")
                      and not t.__module__.startswith("numba")):
        if ensure_numba_target() == "simulator":
            from numba import cuda

            return cuda.as_cuda_array(x)
        return _rta.as_device_array(x, name or "array")
    if name is not None and not is_device_array(x):
        require_array(x, name)
    return x


_SCALAR_TYPES = (int, bool, type(None), np.ndarray, str, float, type)  # (np.ndarray: a host array)


def dispatch(op_name: str, backend: str, stream: Any, reference: Callable[..., Any], *args: Any) -> Any:
    """Run ``op_name`` on ``args`` with the chosen backend. ``reference`` is the NumPy implementation."""
    if backend not in BACKENDS:
        raise ValueError(f"backend = {backend!r} is not one of {BACKENDS}")
    on_device = False
    for a in args:
        if type(a) in _SCALAR_TYPES or isinstance(a, np.dtype):
            continue
        if is_device_array(a) or isinstance(a, (list, tuple)) and any(is_device_array(b) for b in a):
            on_device = True
            break
    if backend in ("numpy", "cpu") or (backend == "auto" and not on_device):
        if on_device:
            raise TypeError(f"{op_name}: backend={backend!r} was given a CUDA device array; pass NumPy arrays")
        if backend == "cpu":
            return host_op(op_name, reference)(*args)
        return reference(*args)
    return kernel_for(op_name)(*args, stream=stream)


def stack_gptq_experts_to_marlin(qweights, scales, qzeros, bits: int, group_size: int, size_k: int,
                                 n_per_expert: int, act_dtype, *, stream=None):
    """The Numba path of ``ops.stack_gptq_experts_to_marlin`` (inputs already validated) -> MarlinWeight."""
    from workbench.scalar_types import ScalarType
    from workbench.weight import MarlinWeight

    qweight, scale_stack, zeros, asymmetric = kernel_for("stack_gptq_experts_to_marlin")(
        qweights, scales, qzeros, bits, group_size, size_k, n_per_expert, act_dtype, stream=stream)
    wt = {(4, False): ScalarType.U4B8, (4, True): ScalarType.U4, (8, False): ScalarType.U8B128,
          (8, True): ScalarType.U8}[(bits, asymmetric)]
    return MarlinWeight(qweight, scale_stack, zeros, None, None, size_k, n_per_expert, group_size, wt,
                        np.dtype(act_dtype), num_experts=len(qweights) if isinstance(qweights, (list, tuple))
                        else int(qweights.shape[0]))


# ---------------------------------------------------------------------------------------------------------------
# call plans: a device call's verdict and launches, kept per argument metadata
# ---------------------------------------------------------------------------------------------------------------
_PLAIN = (int, bool, float, str, type(None), np.integer, np.floating, np.dtype, type)
_SCALARS = frozenset((int, bool, float, str, type(None)))
_plans: dict[tuple, Any] = {}  # key -> (CallPlan or None = "always the full path", repack policy it was made under)


def _array_key(x: Any):
    """(metadata, address, nbytes) of a device array whose framework gives them cheaply, else None."""
    t = type(x)
    if _is_cupy_array(t):
        return ("cupy", x.shape, x.dtype, x.strides, x.data.device_id), x.data.ptr, x.nbytes
    if t is _rta.DeviceArray:
        return (x.framework, x.shape, x.dtype, x.strides, x.data.device_id), x.data.ptr, x.nbytes
    if isinstance(x, _rta.torch_tensor_type()) and x.is_cuda:  # (get_device, nbytes: no device/size objects made)
        return ("torch", x.shape, x.dtype, x.stride(), x.get_device()), x.data_ptr(), x.nbytes
    return None


def plan_key(op_name: str, backend: str, args: tuple, kwargs: dict):
    """(key, [(address, nbytes)]) for an op call whose arrays are all device arrays (CuPy, torch, DeviceArray) and
    whose other arguments are plain scalars or dtypes; None otherwise (NumPy inputs, lists: the full path)."""
    key, inputs = [op_name, backend], []
    for a in args:
        if type(a) in _SCALARS or isinstance(a, _PLAIN):
            key.append((type(a), a))
            continue
        found = _array_key(a)
        if found is None:
            return None
        key.append(found[0])
        inputs.append(found[1:])
    for name, a in kwargs.items():
        if not isinstance(a, _PLAIN):
            return None
        key.append((name, type(a), a))
    if not inputs:
        return None
    return tuple(key), inputs


def _repack_policy():
    module = sys.modules.get("kernels_numba.marlin_repack")
    return None if module is None else module.__dict__.get("_policy")


def run_planned(op: Callable[..., Any], args: tuple, kwargs: dict, backend: str, stream: Any) -> Any:
    """``op(*args, backend=backend, stream=stream, **kwargs)``; on device arrays through its call plan: the first
    call with some argument metadata runs in full (every check, then the kernels) while being recorded, later calls
    with the same metadata (shapes, dtypes, strides, devices, scalar values) replay its launches on the new
    addresses. A call that reads a verdict back (a device perm's check, zero-point codes) replays it too: the
    verdict is read again before the result is returned, and one that differs from the recorded call's sends the
    call the full way, which raises the check's message (kernels_numba._launch._Recording)."""
    found = plan_key(op.__name__, backend, args, kwargs)
    if found is None or ensure_numba_target() != "gpu":
        return op(*args, backend=backend, stream=stream, **kwargs)
    key, inputs = found
    _launch = sys.modules.get("kernels_numba._launch")
    if _launch is None:
        from kernels_numba import _launch
    if not _launch.replay_allowed():
        if _launch._recording() is not None:
            _launch._not_replayable()  # an op inside a recorded op: the outer call is not replayed
        return op(*args, backend=backend, stream=stream, **kwargs)
    entry = _plans.get(key)
    policy = _repack_policy()
    if entry is not None and entry[1] is policy:
        plan = entry[0]
        if plan is None:
            return op(*args, backend=backend, stream=stream, **kwargs)
        ptrs = [ptr for ptr, _ in inputs]
        result = _replay_torch(plan, ptrs, stream) if plan.framework == "torch" else plan(ptrs, stream)
        if result is not None:
            return result
    with _launch.recording(inputs) as rec:
        result = op(*args, backend=backend, stream=stream, **kwargs)
    _plans[key] = (rec.plan(result), _repack_policy())
    return result


_torch_devices: dict[int, Any] = {}


def _torch_current_stream(device: int) -> int:
    """The raw handle of torch's current stream on ``device``: torch's own accessor of the handle when it has one
    (``torch.cuda.current_stream`` builds a Stream object per call, a few microseconds), else that."""
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return int(raw(device)) if raw is not None else int(torch.cuda.current_stream(device).cuda_stream)


def _replay_torch(plan, ptrs: list[int], stream: Any):
    """``plan(ptrs, stream)`` for torch callers, at less host cost: the stream read once, the result allocated
    with its own shape and dtype (no views to make afterwards), temporaries as bytes; from torch's caching
    allocator on the launch's stream, as the full path allocates. None where the full path must say why (another
    current device)."""
    import torch

    from kernels_numba import _launch

    device = plan.device
    if _launch._current_device() != device:
        return None
    if stream is None:
        handle = _torch_current_stream(device)
    else:
        handle = _rta_stream_handle(stream, device)
        if handle != _torch_current_stream(device):
            return plan(ptrs, stream)  # another stream: the full replay allocates on it
    dev = _torch_devices.get(device)
    if dev is None:
        dev = _torch_devices.setdefault(device, torch.device("cuda", device))
    index, offset, shape, dtype = plan.out
    result, owners = None, []  # (the temporaries are held until their kernels are queued)
    for i, nbytes in enumerate(plan.allocs):
        if i == index and offset == 0 and nbytes == math.prod(shape) * dtype.itemsize:
            result = torch.empty(shape, dtype=_launch._torch_dtype(dtype), device=dev)
            owners.append(result)
        else:
            owners.append(torch.empty(nbytes, dtype=torch.uint8, device=dev))
    bases = [o.data_ptr() for o in owners]
    if not plan.run(ptrs, bases, handle):
        return None
    if result is None:
        result = _launch._wrap("torch", _launch.KernelArray(bases[index] + offset, shape, dtype, owners[index],
                                                            device))
    return result


def _rta_stream_handle(stream: Any, device: int) -> int:
    from workbench.cuda import streams

    return streams.stream_handle(stream, "torch", device)
