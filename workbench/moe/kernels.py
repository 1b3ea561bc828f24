"""The native kernels of ``kernels_cuda/marlin_moe.cu`` beside the fused GEMM (compiled at first use through
workbench.cuda): SiLU-and-multiply, the router-weighted top-k sum, row gather, bias, and the CUDA
``moe_align_block_size``; their argument lists (``PLAN_ARG_KINDS``) and the one helper launch. Outputs come from the
pool of the framework of the inputs (``workbench.cuda.arrays``; ``new_array``).
"""
from __future__ import annotations

import functools

import numpy as np

from workbench import cuda as rt
from workbench.cuda import arrays as rt_arrays
from workbench.cuda import launch as rt_launch
from workbench.gemm import KERNEL_DIR, act_scalar_type

MOE_KERNEL_SOURCE = "marlin_moe.cu"


def on_gpu(x) -> bool:
    # CuPy arrays first: their __cuda_array_interface__ builds a dict on every read
    return type(x) is rt.cupy_array_type() or isinstance(x, rt.torch_tensor_type()) or \
        getattr(x, "__cuda_array_interface__", None) is not None


def array_module(x):
    if on_gpu(x):
        return rt.cupy()
    return np


def as_int(v, name: str) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(v).__name__} {v!r}")
    return int(v)


# ---- CuPy and torch arrays ----------------------------------------------------------------------------------------
# The MoE code works on CuPy arrays: a torch tensor is viewed as one without a copy on the way in, and every array the
# code makes comes from the pool of the caller's framework (``pool``): torch's caching allocator for torch callers,
# CuPy's pool otherwise, viewed as a CuPy array the same way.
def pool_of(x) -> str:
    """The framework whose pool allocates a call's outputs and intermediates: "torch" for torch tensors, else
    "cupy" (Numba has no pool of its own)."""
    return "torch" if isinstance(x, rt.torch_tensor_type()) else "cupy"


def as_cupy(x):
    """A CuPy array over a torch CUDA tensor's memory (DLPack, no copy); ``x`` itself for anything else (CuPy arrays,
    None, host arrays: the checks name those)."""
    if isinstance(x, rt.torch_tensor_type()) and x.is_cuda:
        return rt.cupy().from_dlpack(x.detach())
    return x


_torch_streams: dict = {}


def _torch_stream(stream_ptr: int, device: int):
    """A context making the torch stream of ``stream_ptr`` current (torch's allocator orders a block by the stream
    current when it is made, so blocks are made on the stream that uses them)."""
    import contextlib

    import torch

    if torch.cuda.current_stream(device).cuda_stream == stream_ptr:
        return contextlib.nullcontext()
    s = _torch_streams.get((stream_ptr, device))
    if s is None:
        s = _torch_streams.setdefault((stream_ptr, device), torch.cuda.ExternalStream(stream_ptr, device=device))
    return torch.cuda.stream(s)


def new_array(pool: str, shape, dtype, device: int, stream_ptr: int, *, zero: bool = False):
    """A new CuPy array from ``pool``'s memory on ``device``, made in ``stream_ptr``'s stream order."""
    cupy = rt.cupy()
    if pool == "torch":
        with _torch_stream(stream_ptr, device):
            tensor = rt_arrays.empty("torch", shape, dtype, device, zero=zero)
        with rt.cupy_stream(stream_ptr):  # (the DLPack exchange orders itself after the consumer's current stream)
            return cupy.from_dlpack(tensor)
    with cupy.cuda.Device(device), rt.cupy_stream(stream_ptr):
        return (cupy.zeros if zero else cupy.empty)(shape, dtype=dtype)


def upload(pool: str, host: np.ndarray, device: int, stream_ptr: int):
    """A host array copied into a new array from ``pool`` (stream-ordered on ``stream_ptr``)."""
    if pool != "torch":
        cupy = rt.cupy()
        with cupy.cuda.Device(device), rt.cupy_stream(stream_ptr):
            return cupy.asarray(host)
    out = new_array(pool, host.shape, host.dtype, device, stream_ptr)
    out.set(np.ascontiguousarray(host), stream=rt.cupy_stream(stream_ptr))
    return out


def contiguous(x, pool: str, stream_ptr: int):
    """``x`` if C-contiguous, else a contiguous copy from ``pool``."""
    if x.flags["C_CONTIGUOUS"]:
        return x
    if pool != "torch":
        with rt.cupy_stream(stream_ptr):
            return rt.cupy().ascontiguousarray(x)
    out = new_array(pool, x.shape, x.dtype, x.data.device_id, stream_ptr)
    with rt.cupy_stream(stream_ptr):
        out[...] = x
    return out


def output_array(out, shape: tuple, dtype, pool: str, device: int, stream_ptr: int):
    """A kernel's output: ``out`` checked (``shape``, ``dtype``, C-contiguous), or a new array from ``pool``."""
    if out is None:
        return new_array(pool, shape, dtype, device, stream_ptr)
    if tuple(out.shape) != shape or out.dtype != dtype or not out.flags["C_CONTIGUOUS"]:
        raise ValueError(f"out must be a contiguous {shape} {dtype} array, got {tuple(out.shape)} {out.dtype}")
    return out


def for_caller(x, like):
    """``x`` (a CuPy array of the code) in the framework of ``like`` (the caller's array): a torch tensor over the
    same memory for torch callers, ``x`` itself otherwise."""
    if isinstance(like, rt.torch_tensor_type()):
        import torch

        return torch.from_dlpack(x)
    return x


@functools.lru_cache(maxsize=None)
def moe_kernel_source() -> str:
    """marlin_moe.cu with its local headers (marlin_mainloop.cuh / dequant.cuh / mma.cuh, shared with the dense
    kernel) inlined."""
    return rt.inline_includes(KERNEL_DIR, MOE_KERNEL_SOURCE)


_module = rt.KernelModule(lambda: moe_kernel_source())


def get_moe_kernel(name_expression: str, device: int, smem_bytes: int = 0):
    """The compiled marlin_moe.cu instantiation on one device (compiled once per process)."""
    return _module.kernel(name_expression, device, smem_bytes)


# Parameter lists of the marlin_moe.cu kernels (their argument blocks), 'p' = 64-bit address, 'i' = int32
# (checked against kernels_cuda/marlin_moe.cu by tests/cpu/test_moe_plan.py).
PLAN_ARG_KINDS = {"marlin_moe": "pppppppppp" + "iiiiiiiii", "moe_align": "piiippipp", "silu_and_mul": "ppii",
                  "swiglu_oai_and_mul": "ppiiii",
                  "moe_sum": "ppppiiii", "gather_rows": "pppiii", "add_bias": "ppii"}


def function_ptr(name_expression: str, device: int, smem_bytes: int = 0) -> int:
    """The CUfunction handle of one marlin_moe.cu instantiation on one device (compiled on first use)."""
    return _module.function_ptr(name_expression, device, smem_bytes)


def launch_helper(name_expression: str, device: int, blocks: int, threads: int, values: tuple, stream) -> None:
    """One launch of a marlin_moe.cu helper kernel (align, SiLU, sum, gather, bias; parameters PLAN_ARG_KINDS) on
    checked arguments, through the runtime's launch call."""
    kinds = PLAN_ARG_KINDS[name_expression.split("<")[0].removeprefix("mwb::")]
    args = rt.ArgBlock(kinds)
    args.set(values)
    launch = rt.Launch(function_ptr(name_expression, device), blocks, threads, 0)
    with rt.cupy().cuda.Device(device):
        rt_launch.launch_kernel(launch, rt.stream_handle(stream), args.address)


def ctype_name(dtype) -> str:
    return "__half" if np.dtype(dtype) == np.dtype(np.float16) else "__nv_bfloat16"


def silu_and_mul(x, out=None, *, stream=None, pool: str | None = None):
    """out[r, j] = rnd(silu(x[r, j]) · x[r, N + j]) for x [R, 2N] fp16/bf16 on the GPU (fp32 math inside).

    ``x`` / ``out``: CuPy arrays or torch CUDA tensors; a new ``out`` comes from
    ``pool`` ("torch" / "cupy"; None: x's framework's) and is returned in x's framework. ``stream`` None: the
    current stream of x's framework."""
    return activation_and_mul(x, "silu", out, stream=stream, pool=pool)


def activation_kernel(activation, dtype) -> tuple[str, tuple[int, ...]]:
    """(the marlin_moe.cu kernel of an Activation for activations of ``dtype``, its scalar arguments after
    (rows, n)): silu_and_mul, or swiglu_oai_and_mul with (alpha, limit) as float32 bits."""
    if activation.name == "silu":
        return f"mwb::silu_and_mul<{ctype_name(dtype)}>", ()
    return f"mwb::swiglu_oai_and_mul<{ctype_name(dtype)}>", activation.kernel_args


def activation_and_mul(x, activation=None, out=None, *, stream=None, pool: str | None = None):
    """The MoE activation of x [R, 2N] (gate columns first, then up) -> [R, N] on the GPU, fp32 math inside, one
    rounding: ``activation`` a workbench.moe.activation spec (None / "silu": silu_and_mul; "swigluoai" or an
    Activation with alpha and limit: gpt-oss's clamped SwiGLU). Arrays, pools and streams as silu_and_mul's."""
    from workbench.moe.activation import activation_of

    act = activation_of(activation)
    caller, given, pool = x, out, pool or pool_of(x)
    x, out = as_cupy(x), as_cupy(out)
    act_scalar_type(x.dtype)
    if len(x.shape) != 2 or x.shape[1] % 2 or not x.flags["C_CONTIGUOUS"]:
        raise ValueError(f"{act.name}_and_mul takes a contiguous (R, 2N) array, got shape {tuple(x.shape)}")
    rows, n = int(x.shape[0]), int(x.shape[1]) // 2
    x_ptr, device = rt.device_pointer(x, "x")
    stream_ptr = rt.stream_handle(stream, pool_of(caller), device)
    out = output_array(out, (rows, n), x.dtype, pool, device, stream_ptr)
    if rows:
        name, extra = activation_kernel(act, x.dtype)
        blocks = min(65535, -(-(rows * n) // 256))
        launch_helper(name, device, blocks, 256, (x_ptr, rt.device_pointer(out, "out")[0], rows, n) + extra,
                      stream_ptr)
    return given if given is not None else for_caller(out, caller)


def moe_sum(y, top_k: int, out=None, *, weights=None, row_of=None, stream=None, pool: str | None = None):
    """out[t, :] = rnd(Σ_j w[t, j] · y[r(t·top_k + j), :]) in fp32 for y [R, K] fp16/bf16 on the GPU.

    w = 1 when ``weights`` ([M, top_k] float32) is None; r = identity (R = M·top_k) when ``row_of`` is None, else
    ``row_of`` ([M·top_k] int32) names the row of y holding each entry, -1 for an entry that contributes nothing.
    CuPy arrays or torch tensors; a new ``out`` from ``pool`` (None: y's framework's), returned in y's framework.
    """
    caller, given, pool = y, out, pool or pool_of(y)
    y, out, weights, row_of = as_cupy(y), as_cupy(out), as_cupy(weights), as_cupy(row_of)
    act_scalar_type(y.dtype)
    if len(y.shape) != 2 or not y.flags["C_CONTIGUOUS"]:
        raise ValueError(f"y must be a contiguous 2-D array, got shape {tuple(y.shape)}")
    top_k = as_int(top_k, "top_k")
    if top_k < 1:
        raise ValueError(f"top_k = {top_k} must be >= 1")
    rows, k = (int(s) for s in y.shape)
    if row_of is None:
        if rows % top_k:
            raise ValueError(f"y has {rows} rows, not a multiple of top_k = {top_k}")
        entries = rows
    else:
        if np.dtype(row_of.dtype) != np.int32 or len(row_of.shape) != 1:
            raise TypeError(f"row_of must be 1-D int32, got {np.dtype(row_of.dtype)} {tuple(row_of.shape)}")
        entries = int(row_of.shape[0])
        if entries % top_k:
            raise ValueError(f"row_of has {entries} entries, not a multiple of top_k = {top_k}")
    m = entries // top_k
    y_ptr, device = rt.device_pointer(y, "y")
    stream_ptr = rt.stream_handle(stream, pool_of(caller), device)
    out = output_array(out, (m, k), y.dtype, pool, device, stream_ptr)
    if weights is not None and (np.dtype(weights.dtype) != np.float32 or int(weights.size) != entries):
        raise ValueError(f"weights must be float32 with {entries} elements, got {weights.dtype} "
                         f"{tuple(weights.shape)}")
    if m:
        blocks = min(65535, -(-(m * k) // 256))
        launch_helper(f"mwb::moe_sum<{ctype_name(y.dtype)}>", device, blocks, 256,
                      (y_ptr, 0 if weights is None else rt.device_pointer(weights, "weights")[0],
                       0 if row_of is None else rt.device_pointer(row_of, "row_of")[0],
                       rt.device_pointer(out, "out")[0], m, top_k, k, rows), stream_ptr)
    return given if given is not None else for_caller(out, caller)


def gather_rows(x, rows, *, stream=None, pool: str | None = None):
    """out[i, :] = x[rows[i], :] for x [R, K] fp16/bf16 (K % 8 == 0) and rows [n] int32 on the GPU; ``out`` from
    ``pool`` (None: x's framework's), returned in x's framework."""
    caller, pool = x, pool or pool_of(x)
    x, rows = as_cupy(x), as_cupy(rows)
    act_scalar_type(x.dtype)
    if len(x.shape) != 2 or not x.flags["C_CONTIGUOUS"] or int(x.shape[1]) % 8:
        raise ValueError(f"x must be contiguous (R, K) with K % 8 == 0, got shape {tuple(x.shape)}")
    if np.dtype(rows.dtype) != np.int32 or len(rows.shape) != 1:
        raise TypeError(f"rows must be 1-D int32, got {np.dtype(rows.dtype)} {tuple(rows.shape)}")
    n, k = int(rows.shape[0]), int(x.shape[1])
    x_ptr, device = rt.device_pointer(x, "x")
    stream_ptr = rt.stream_handle(stream, pool_of(caller), device)
    out = new_array(pool, (n, k), x.dtype, device, stream_ptr)
    if n:
        blocks = min(65535, -(-(n * k // 8) // 256))
        launch_helper("mwb::gather_rows", device, blocks, 256,
                      (x_ptr, rt.device_pointer(rows, "rows")[0], out.data.ptr, n, k // 8, int(x.shape[0])),
                      stream_ptr)
    return for_caller(out, caller)


def add_bias(y, bias, *, stream=None):
    """y[r, :] = rnd(y[r, :] + bias) in fp32, in place; y [R, N], bias [N], same fp16/bf16 dtype, on the GPU (any
    framework's arrays; returns y)."""
    caller = y
    y, bias = as_cupy(y), as_cupy(bias)
    if np.dtype(bias.dtype) != np.dtype(y.dtype) or tuple(bias.shape) != (int(y.shape[1]),):
        raise ValueError(f"bias must be ({int(y.shape[1])},) {y.dtype}, got {tuple(bias.shape)} {bias.dtype}")
    rows, n = (int(s) for s in y.shape)
    if rows:
        y_ptr, device = rt.device_pointer(y, "y")
        blocks = min(65535, -(-(rows * n) // 256))
        launch_helper(f"mwb::add_bias<{ctype_name(y.dtype)}>", device, blocks, 256,
                      (y_ptr, rt.device_pointer(bias, "bias")[0], rows, n),
                      rt.stream_handle(stream, pool_of(caller), device))
    return caller


ALIGN_MAX_EXPERTS = 1024  # marlin_moe.cu kAlignMaxExperts: the one-block scan gives each thread one expert
ALIGN_THREADS = 1024  # marlin_moe.cu kAlignThreads: the launch must have at least num_experts threads


def moe_align_block_size(topk_ids, block_size: int, num_experts: int, expert_map=None, *, stream=None,
                         pool: str | None = None):
    """Device ``moe_align_block_size`` in one CuPy launch of ``marlin_moe.cu``'s ``mwb::moe_align`` (the Numba
    kernel in ``kernels_numba.moe_align`` runs the same algorithm but pays Numba's per-call host dispatch, ~0.5 ms).

    topk_ids [M, top_k] int32 contiguous CuPy array or torch tensor (ids outside [0, num_experts) are dropped);
    ``expert_map`` [num_experts] int32 on the same device (global -> local id, -1 = another device). Returns int32
    arrays from ``pool`` (None: topk_ids' framework's), in topk_ids' framework
    ``(sorted_token_ids [cap], expert_ids [cap / block_size], num_tokens_post_padded [1])``, cap =
    ``aligned_capacity(M·top_k, block_size, num_experts)``; segments, expert ids and the padded count equal
    ``workbench.formats.moe_align.moe_align_block_size``'s (the order inside a segment is not specified). Every
    element of the outputs is written. Bad input raises before anything is allocated or launched.
    """
    from workbench.formats.moe_align import aligned_capacity

    caller, pool = topk_ids, pool or pool_of(topk_ids)
    topk_ids, expert_map = as_cupy(topk_ids), as_cupy(expert_map)
    if not on_gpu(topk_ids):
        raise TypeError(f"topk_ids is not on GPU (got {type(topk_ids).__module__}.{type(topk_ids).__name__}; "
                        f"use a CuPy array)")
    if len(topk_ids.shape) != 2 or not topk_ids.flags["C_CONTIGUOUS"]:
        raise ValueError(f"topk_ids must be a contiguous 2-D (M, top_k) array, got shape {tuple(topk_ids.shape)}")
    if np.dtype(topk_ids.dtype) != np.int32:
        raise TypeError(f"topk_ids dtype = {np.dtype(topk_ids.dtype)} must be int32")
    block_size, num_experts = as_int(block_size, "block_size"), as_int(num_experts, "num_experts")
    if block_size <= 0:
        raise ValueError(f"block_size = {block_size} must be > 0")
    if not 0 < num_experts <= ALIGN_MAX_EXPERTS:
        raise ValueError(f"num_experts = {num_experts} must be in [1, {ALIGN_MAX_EXPERTS}] (one thread per expert "
                         f"in the kernel's scan)")
    numel = int(topk_ids.size)
    cap = aligned_capacity(numel, block_size, num_experts)
    if cap >= 2 ** 31:
        raise ValueError(f"aligned capacity {cap} (numel = {numel}, block_size = {block_size}, num_experts = "
                         f"{num_experts}) does not fit the kernel's 32-bit indices")
    _, device = rt.device_pointer(topk_ids, "topk_ids")
    if expert_map is not None:
        if not on_gpu(expert_map):
            raise TypeError(f"expert_map is not on GPU (got {type(expert_map).__module__}."
                            f"{type(expert_map).__name__}; use a CuPy array)")
        if tuple(expert_map.shape) != (num_experts,) or not expert_map.flags["C_CONTIGUOUS"]:
            raise ValueError(f"expert_map must be a contiguous ({num_experts},) array, got shape "
                             f"{tuple(expert_map.shape)}")
        if np.dtype(expert_map.dtype) != np.int32:
            raise TypeError(f"expert_map dtype = {np.dtype(expert_map.dtype)} must be int32")
        map_device = rt.device_pointer(expert_map, "expert_map")[1]
        if map_device != device:
            raise ValueError(f"expert_map is on device {map_device}, topk_ids on device {device}")
    stream_ptr = rt.stream_handle(stream, pool_of(caller), device)
    # (outputs made in the launch's stream order)
    sorted_ids = new_array(pool, cap, np.int32, device, stream_ptr)  # (cap,)
    expert_ids = new_array(pool, cap // block_size, np.int32, device, stream_ptr)  # (cap / block_size,)
    post = new_array(pool, 1, np.int32, device, stream_ptr)  # (1,)
    launch_helper("mwb::moe_align", device, 1, ALIGN_THREADS,
                   (rt.device_pointer(topk_ids, "topk_ids")[0], numel, num_experts, block_size,
                    0 if expert_map is None else rt.device_pointer(expert_map, "expert_map")[0], sorted_ids.data.ptr,
                    cap, expert_ids.data.ptr, post.data.ptr), stream_ptr)
    return tuple(for_caller(x, caller) for x in (sorted_ids, expert_ids, post))

