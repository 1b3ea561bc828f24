"""MoE expert stacks on the native Marlin GEMM: ``MarlinExpertStack``, ``fused_moe`` and the NumPy MoE reference.

A stack holds E experts' Marlin tiles for one matmul role (gate_up = w13, or down = w2) in one buffer with a
leading expert axis (``workbench.weight.MarlinWeight`` with ``num_experts``; docs/formats.md, "MoE expert stacks").
Three ways to run it:

* ``gemm_phase_batched(input, dispatches, output)`` — one dense Marlin GEMM per dispatch
  ``(expert, in_row_offset, out_row_offset, m)`` at the rows' and the expert's addresses (checked once per row
  count, see ``gemm.plan_marlin_gemm``), spread round-robin over a few CuPy streams (each with its own lock counters
  and partial-sum buffer), joined back to the caller's stream by events.
* ``gemm_phase_fused(input, sorted_token_ids, expert_ids, num_tokens_post_padded, output, prob_m,
  moe_block_size, top_k)`` — one launch of ``kernels_cuda/marlin_moe.cu``: every block of ``moe_block_size``
  routed rows reads its expert from ``expert_ids`` inside the kernel, gathers its A rows by sorted id, scatters
  its C rows, optionally scales them by the router weight; ``-1`` experts and sentinel rows are skipped.
* ``make_expert_linear(offset, n, bias)`` — one expert's column slice as a plain layer for the dense GEMM.

``fused_moe(hidden, w13, w2, topk_weights, topk_ids, path=...)`` is an inference engine's MoE layer on top:
gate_up -> SiLU(gate) * up -> down -> router-weighted sum over top_k.

``moe_reference`` is the NumPy spec of that layer (fp32 math on the exact dequantized weights, rounded to the
activation type where the kernels write activations) and ``moe_error_bound`` the per-element tolerance derived
from those roundings.
"""
from __future__ import annotations

import dataclasses
import functools
import threading
from typing import Any, Sequence

import numpy as np

from workbench import cuda as rt
from workbench import gemm
from workbench.cuda import launch as rt_launch
from workbench.formats.moe_align import SUPPORTED_BLOCK_SIZES
from workbench.policy import DEFAULT_MOE_POLICY, MOE_GLOBALS, MoePolicy, install_deprecated_globals
from workbench.weight import MarlinWeight

MOE_KERNEL_SOURCE = "marlin_moe.cu"
DEFAULT_STREAMS = 4  # concurrent dense GEMMs in the batched path: enough to fill the SMs when each is small
PATHS = ("fused", "batched", "dense_loop")


class UnsupportedError(NotImplementedError):
    """This backend/build cannot run the requested path (ferrum-kernels' ``unsupported`` error)."""


# ---------------------------------------------------------------------------------------------------------------
# NumPy reference
# ---------------------------------------------------------------------------------------------------------------
def _round(x: np.ndarray, act: np.dtype) -> np.ndarray:
    """fp32 -> activation type -> fp32: where a kernel writes an activation-typed value."""
    return np.asarray(x, dtype=np.float32).astype(act).astype(np.float32)


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def _check_routing(hidden: np.ndarray, w13_ref: np.ndarray, w2_ref: np.ndarray, topk_weights, topk_ids,
                   expert_map=None):
    hidden = np.asarray(hidden)
    topk_ids = np.asarray(topk_ids)
    topk_weights = np.asarray(topk_weights, dtype=np.float32)
    if hidden.ndim != 2:
        raise ValueError(f"hidden must be 2-D (M, K), got shape {hidden.shape}")
    m, k = hidden.shape
    if w13_ref.ndim != 3 or w13_ref.shape[1] != k or w13_ref.shape[2] % 2:
        raise ValueError(f"w13_ref has shape {w13_ref.shape}, expected (E, K = {k}, 2N)")
    e, _, n2 = w13_ref.shape
    if w2_ref.shape != (e, n2 // 2, k):
        raise ValueError(f"w2_ref has shape {w2_ref.shape}, expected (E, N, K) = {(e, n2 // 2, k)}")
    if topk_ids.ndim != 2 or topk_ids.shape[0] != m or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_ids {topk_ids.shape} and topk_weights {topk_weights.shape} must both be "
                         f"(M = {m}, top_k)")
    local = topk_ids.astype(np.int64)
    if expert_map is not None:
        emap = np.asarray(expert_map)
        valid = (local >= 0) & (local < emap.shape[0])
        local = np.where(valid, emap[np.clip(local, 0, emap.shape[0] - 1)], -1)
    local = np.where((local >= 0) & (local < e), local, -1)
    return hidden, topk_weights, local


def moe_reference(hidden, w13_ref, w2_ref, topk_weights, topk_ids, act_dtype=None, expert_map=None) -> np.ndarray:
    """The MoE layer in NumPy: ``out[t] = Σ_j w[t, j] · (silu(g) · u)(hidden[t] @ W13[e]) @ W2[e]``, e = ids[t, j].

    hidden [M, K] (fp16/bf16), w13_ref [E, K, 2N] and w2_ref [E, N, K] float32 exact dequantized weights
    (``QuantizedWeight.w_ref``; gate = the first N columns of W13, up = the last N), topk_weights [M, top_k]
    float32, topk_ids [M, top_k] int. Entries whose expert is not local (``expert_map`` gives -1, or the id is out
    of range) contribute nothing. Rounded to the activation type where the kernels write activations:

      g = rnd(hidden @ W13[e])            GEMM 1 writes its C
      h = rnd(silu(g_gate) · g_up)        the activation kernel writes its output (fp32 math inside)
      y = rnd(w · (h @ W2[e]))            GEMM 2 multiplies by the router weight in fp32, then writes C
      out = rnd(Σ_j y_j)                  the top-k sum adds in fp32, then writes
    """
    hidden, weights, local = _check_routing(hidden, np.asarray(w13_ref), np.asarray(w2_ref), topk_weights,
                                            topk_ids, expert_map)
    act = np.dtype(act_dtype or hidden.dtype)
    a = hidden.astype(np.float32)
    m, top_k = local.shape
    n = w2_ref.shape[1]
    total = np.zeros((m, hidden.shape[1]), np.float32)
    for e in np.unique(local[local >= 0]):
        rows, slots = np.nonzero(local == e)
        g = _round(a[rows] @ w13_ref[e], act)
        h = _round(_silu(g[:, :n]) * g[:, n:], act)
        y = _round(weights[rows, slots, None] * (h @ w2_ref[e]), act)
        np.add.at(total, rows, y)
    return total.astype(act)


UNIT_ROUNDOFF = gemm.UNIT_ROUNDOFF


def moe_error_bound(hidden, w13_ref, w2_ref, topk_weights, topk_ids, act_dtype=None, expert_map=None) -> np.ndarray:
    """Per-element bound on |kernel - moe_reference| (float32 [M, K]), derived from where each side rounds.

    With u the activation type's unit roundoff and a GEMM's error <= (2u + K·2^-22)·(|A| @ |W|)
    (gemm.error_bound_factor: one output rounding, one for the weight rounding that the reference makes and a kernel
    scaling fp32 partial sums does not, and fp32 tensor-core accumulation that drops low bits when aligning products):
      δg  <= e1 = (2u + K·2^-22)·(|a| @ |W13|)
      δh  <= |silu'(g_gate)|·δg_gate·|g_up| + |silu(g_gate)|·δg_up + u·|h|        (SiLU-and-mul, one rounding)
      δy  <= |w|·(δh @ |W2| + (2u + N·2^-22)·(|h| @ |W2|))                     (GEMM 2, router weight in fp32)
      δout <= Σ_j δy_j + 2u·Σ_j |y_j|                    (a path that rounds y before weighting adds one more u)
    Both the kernel and the reference carry such an error, so the bound is doubled.
    """
    hidden, weights, local = _check_routing(hidden, np.asarray(w13_ref), np.asarray(w2_ref), topk_weights,
                                            topk_ids, expert_map)
    act = np.dtype(act_dtype or hidden.dtype)
    u = UNIT_ROUNDOFF[act.name]
    a = np.abs(hidden.astype(np.float32))
    k = hidden.shape[1]
    n = w2_ref.shape[1]
    bound = np.zeros((hidden.shape[0], k), np.float32)
    for e in np.unique(local[local >= 0]):
        rows, slots = np.nonzero(local == e)
        g = hidden[rows].astype(np.float32) @ w13_ref[e]
        e1 = gemm.error_bound_factor(act, k) * (a[rows] @ np.abs(w13_ref[e]))
        gate, up = g[:, :n], g[:, n:]
        sig = 1.0 / (1.0 + np.exp(-gate))
        dsilu = np.abs(sig * (1.0 + gate * (1.0 - sig)))
        h = np.abs(_silu(gate) * up)
        dh = dsilu * e1[:, :n] * (np.abs(up) + e1[:, n:]) + np.abs(_silu(gate)) * e1[:, n:] + u * h
        w2 = np.abs(w2_ref[e])
        w = np.abs(weights[rows, slots, None])
        dy = w * ((dh @ w2) + gemm.error_bound_factor(act, n) * (h @ w2))
        y = w * (h @ w2)
        np.add.at(bound, rows, dy + 2 * u * y)
    return 2 * bound + np.float32(1e-30)


# ---------------------------------------------------------------------------------------------------------------
# Building stacks (tests, notebooks, benchmarks)
# ---------------------------------------------------------------------------------------------------------------
def stack_marlin_weights(experts: Sequence[MarlinWeight]) -> MarlinWeight:
    """E single-layer MarlinWeights of one shape and format -> one stack (host arrays, expert e at index e)."""
    experts = list(experts)
    if not experts:
        raise ValueError("at least one expert is needed")
    first = experts[0]
    for i, w in enumerate(experts):
        if w.num_experts is not None:
            raise ValueError(f"experts[{i}] is already a stack")
        same = (w.size_k, w.size_n, w.group_size, w.weight_type, np.dtype(w.act_dtype), w.has_act_order,
                w.zeros is None)
        want = (first.size_k, first.size_n, first.group_size, first.weight_type, np.dtype(first.act_dtype),
                first.has_act_order, first.zeros is None)
        if same != want:
            raise ValueError(f"experts[{i}] is (K, N, group, type, act, act_order, no zeros) = {same}, "
                             f"experts[0] is {want}")
    stack = (lambda f: None if getattr(first, f) is None else np.stack([np.asarray(getattr(w, f)) for w in experts]))
    return dataclasses.replace(first, qweight=stack("qweight"), scales=stack("scales"), zeros=stack("zeros"),
                               g_idx=stack("g_idx"), perm=stack("perm"), num_experts=len(experts))


def random_expert_stack(num_experts: int, size_k: int, size_n: int, weight_type, group_size: int,
                        act_dtype=np.float16, seed: int = 0) -> tuple[MarlinWeight, np.ndarray]:
    """Fresh randn experts quantized by the reference quantizer. Returns (stack on the host, w_ref [E, K, N] f32)."""
    from workbench.weight import random_marlin_weight

    experts, refs = [], []
    for e in range(num_experts):
        mw, q = random_marlin_weight(size_k, size_n, weight_type, group_size, act_dtype=act_dtype,
                                     seed=seed * 1009 + e)
        experts.append(mw)
        refs.append(q.w_ref)
    return stack_marlin_weights(experts), np.stack(refs)


# ---------------------------------------------------------------------------------------------------------------
# Native kernels of marlin_moe.cu (compiled at first use)
# ---------------------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def moe_kernel_source() -> str:
    """marlin_moe.cu with its local headers (marlin_mainloop.cuh / dequant.cuh / mma.cuh, shared with the dense
    kernel) inlined."""
    return rt.inline_includes(gemm.KERNEL_DIR, MOE_KERNEL_SOURCE)


_module = rt.KernelModule(lambda: moe_kernel_source())


def get_moe_kernel(name_expression: str, device: int, smem_bytes: int = 0):
    """The compiled marlin_moe.cu instantiation on one device (compiled once per process)."""
    return _module.kernel(name_expression, device, smem_bytes)


def _ctype(dtype) -> str:
    return "__half" if np.dtype(dtype) == np.dtype(np.float16) else "__nv_bfloat16"


def silu_and_mul(x, out=None, *, stream=None):
    """out[r, j] = rnd(silu(x[r, j]) · x[r, N + j]) for x [R, 2N] fp16/bf16 on the GPU (fp32 math inside)."""
    cupy = rt.cupy()
    gemm.act_scalar_type(x.dtype)
    if len(x.shape) != 2 or x.shape[1] % 2 or not x.flags["C_CONTIGUOUS"]:
        raise ValueError(f"silu_and_mul takes a contiguous (R, 2N) array, got shape {tuple(x.shape)}")
    rows, n = int(x.shape[0]), int(x.shape[1]) // 2
    if out is None:
        out = cupy.empty((rows, n), dtype=x.dtype)
    if tuple(out.shape) != (rows, n) or out.dtype != x.dtype or not out.flags["C_CONTIGUOUS"]:
        raise ValueError(f"out must be a contiguous ({rows}, {n}) {x.dtype} array, got {tuple(out.shape)} {out.dtype}")
    if rows:
        x_ptr, device = rt.device_pointer(x, "x")
        blocks = min(65535, -(-(rows * n) // 256))
        _launch_helper(f"mwb::silu_and_mul<{_ctype(x.dtype)}>", device, blocks, 256,
                       (x_ptr, rt.device_pointer(out, "out")[0], rows, n), stream)
    return out


def moe_sum(y, top_k: int, out=None, *, weights=None, row_of=None, stream=None):
    """out[t, :] = rnd(Σ_j w[t, j] · y[r(t·top_k + j), :]) in fp32 for y [R, K] fp16/bf16 on the GPU.

    w = 1 when ``weights`` ([M, top_k] float32) is None; r = identity (R = M·top_k) when ``row_of`` is None, else
    ``row_of`` ([M·top_k] int32) names the row of y holding each entry, -1 for an entry that contributes nothing.
    """
    cupy = rt.cupy()
    gemm.act_scalar_type(y.dtype)
    if len(y.shape) != 2 or not y.flags["C_CONTIGUOUS"]:
        raise ValueError(f"y must be a contiguous 2-D array, got shape {tuple(y.shape)}")
    top_k = _int(top_k, "top_k")
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
    if out is None:
        out = cupy.empty((m, k), dtype=y.dtype)
    if tuple(out.shape) != (m, k) or out.dtype != y.dtype or not out.flags["C_CONTIGUOUS"]:
        raise ValueError(f"out must be contiguous ({m}, {k}) {y.dtype}, got {tuple(out.shape)} {out.dtype}")
    if weights is not None and (np.dtype(weights.dtype) != np.float32 or int(weights.size) != entries):
        raise ValueError(f"weights must be float32 with {entries} elements, got {weights.dtype} "
                         f"{tuple(weights.shape)}")
    if m:
        y_ptr, device = rt.device_pointer(y, "y")
        blocks = min(65535, -(-(m * k) // 256))
        _launch_helper(f"mwb::moe_sum<{_ctype(y.dtype)}>", device, blocks, 256,
                       (y_ptr, 0 if weights is None else rt.device_pointer(weights, "weights")[0],
                        0 if row_of is None else rt.device_pointer(row_of, "row_of")[0],
                        rt.device_pointer(out, "out")[0], m, top_k, k, rows), stream)
    return out


def gather_rows(x, rows, *, stream=None):
    """out[i, :] = x[rows[i], :] for x [R, K] fp16/bf16 (K % 8 == 0) and rows [n] int32 on the GPU."""
    cupy = rt.cupy()
    gemm.act_scalar_type(x.dtype)
    if len(x.shape) != 2 or not x.flags["C_CONTIGUOUS"] or int(x.shape[1]) % 8:
        raise ValueError(f"x must be contiguous (R, K) with K % 8 == 0, got shape {tuple(x.shape)}")
    if np.dtype(rows.dtype) != np.int32 or len(rows.shape) != 1:
        raise TypeError(f"rows must be 1-D int32, got {np.dtype(rows.dtype)} {tuple(rows.shape)}")
    n, k = int(rows.shape[0]), int(x.shape[1])
    out = cupy.empty((n, k), dtype=x.dtype)
    if n:
        x_ptr, device = rt.device_pointer(x, "x")
        blocks = min(65535, -(-(n * k // 8) // 256))
        _launch_helper("mwb::gather_rows", device, blocks, 256,
                       (x_ptr, rt.device_pointer(rows, "rows")[0], out.data.ptr, n, k // 8, int(x.shape[0])), stream)
    return out


def add_bias(y, bias, *, stream=None):
    """y[r, :] = rnd(y[r, :] + bias) in fp32, in place; y [R, N], bias [N], same fp16/bf16 dtype, on the GPU."""
    if np.dtype(bias.dtype) != np.dtype(y.dtype) or tuple(bias.shape) != (int(y.shape[1]),):
        raise ValueError(f"bias must be ({int(y.shape[1])},) {y.dtype}, got {tuple(bias.shape)} {bias.dtype}")
    rows, n = (int(s) for s in y.shape)
    if rows:
        y_ptr, device = rt.device_pointer(y, "y")
        blocks = min(65535, -(-(rows * n) // 256))
        _launch_helper(f"mwb::add_bias<{_ctype(y.dtype)}>", device, blocks, 256,
                       (y_ptr, rt.device_pointer(bias, "bias")[0], rows, n), stream)
    return y


ALIGN_MAX_EXPERTS = 1024  # marlin_moe.cu kAlignMaxExperts: the one-block scan gives each thread one expert
ALIGN_THREADS = 1024  # marlin_moe.cu kAlignThreads: the launch must have at least num_experts threads


def moe_align_block_size(topk_ids, block_size: int, num_experts: int, expert_map=None, *, stream=None):
    """Device ``moe_align_block_size`` in one CuPy launch of ``marlin_moe.cu``'s ``mwb::moe_align`` (the Numba
    kernel in ``kernels_numba.moe_align`` runs the same algorithm but pays Numba's per-call host dispatch, ~0.5 ms).

    topk_ids [M, top_k] int32 contiguous CuPy array (ids outside [0, num_experts) are dropped); ``expert_map``
    [num_experts] int32 on the same device (global -> local id, -1 = another device). Returns CuPy int32
    ``(sorted_token_ids [cap], expert_ids [cap / block_size], num_tokens_post_padded [1])``, cap =
    ``aligned_capacity(M·top_k, block_size, num_experts)``; segments, expert ids and the padded count equal
    ``workbench.formats.moe_align.moe_align_block_size``'s (the order inside a segment is not specified). Every
    element of the outputs is written. Bad input raises before anything is allocated or launched.
    """
    from workbench.formats.moe_align import aligned_capacity

    if not _on_gpu(topk_ids):
        raise TypeError(f"topk_ids is not on GPU (got {type(topk_ids).__module__}.{type(topk_ids).__name__}; "
                        f"use a CuPy array)")
    if len(topk_ids.shape) != 2 or not topk_ids.flags["C_CONTIGUOUS"]:
        raise ValueError(f"topk_ids must be a contiguous 2-D (M, top_k) array, got shape {tuple(topk_ids.shape)}")
    if np.dtype(topk_ids.dtype) != np.int32:
        raise TypeError(f"topk_ids dtype = {np.dtype(topk_ids.dtype)} must be int32")
    block_size, num_experts = _int(block_size, "block_size"), _int(num_experts, "num_experts")
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
        if not _on_gpu(expert_map):
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
    cupy = rt.cupy()
    stream_ptr = rt.stream_handle(stream)
    with cupy.cuda.Device(device), rt.cupy_stream(stream_ptr):  # outputs allocated in the launch's stream order
        sorted_ids = cupy.empty(cap, dtype=np.int32)  # (cap,)
        expert_ids = cupy.empty(cap // block_size, dtype=np.int32)  # (cap / block_size,)
        post = cupy.empty(1, dtype=np.int32)  # (1,)
    _launch_helper("mwb::moe_align", device, 1, ALIGN_THREADS,
                   (rt.device_pointer(topk_ids, "topk_ids")[0], numel, num_experts, block_size,
                    0 if expert_map is None else rt.device_pointer(expert_map, "expert_map")[0], sorted_ids.data.ptr,
                    cap, expert_ids.data.ptr, post.data.ptr), stream_ptr)
    return sorted_ids, expert_ids, post


# ---------------------------------------------------------------------------------------------------------------
# The expert stack
# ---------------------------------------------------------------------------------------------------------------
def _on_gpu(x) -> bool:
    # CuPy arrays first: their __cuda_array_interface__ builds a dict on every read
    return type(x) is rt.cupy_array_type() or getattr(x, "__cuda_array_interface__", None) is not None


def _xp(x):
    if _on_gpu(x):
        return rt.cupy()
    return np


def _int(v, name: str) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(v).__name__} {v!r}")
    return int(v)


@dataclasses.dataclass
class ExpertLinear:
    """One expert's column slice of a stack as a dense Marlin layer: ``y = x @ W[:, offset : offset + n] + bias``.

    ``weight`` is a single-layer ``MarlinWeight`` holding contiguous copies of the slice (the dense GEMM reads
    contiguous tiles; a column slice of a Marlin buffer is strided), ``bias`` ([n], act dtype) is added after the
    GEMM (the dense kernel has no bias epilogue), rounding once more to the activation type.
    """

    weight: MarlinWeight
    bias: Any | None
    expert: int
    column_offset: int  # inside the expert

    def __call__(self, x, *, out=None, stream=None):
        y = gemm.marlin_gemm(x, self.weight, c=out, stream=stream)
        if self.bias is not None:
            add_bias(y, self.bias, stream=stream)
        return y


class MarlinExpertStack:
    """E experts' Marlin tiles for one matmul role (seed ``MarlinExpertStack``); arrays on the GPU for the GEMMs.

    ``weight``: a stacked ``MarlinWeight`` (``num_experts`` set; see ``ops.stack_gptq_experts_to_marlin`` and
    ``gemm.upload_weight``). Act-order stacks are not supported by the fused kernel (docs/formats.md, "MoE expert
    stacks": newer vLLM kernels
    dropped it); the batched path runs them through the dense GEMM.
    """

    def __init__(self, weight: MarlinWeight, *, num_streams: int = DEFAULT_STREAMS, sms: int = -1):
        if not isinstance(weight, MarlinWeight):
            raise TypeError(f"weight must be a MarlinWeight, got {type(weight).__name__}")
        if weight.num_experts is None:
            raise ValueError("weight is a single layer; an expert stack needs num_experts (a leading expert axis)")
        e = weight.num_experts
        if tuple(weight.qweight.shape[:1]) != (e,) or tuple(weight.scales.shape[:1]) != (e,):
            raise ValueError(f"weight arrays do not lead with num_experts = {e}: qweight {tuple(weight.qweight.shape)}"
                             f", scales {tuple(weight.scales.shape)}")
        num_streams = _int(num_streams, "num_streams")
        if num_streams < 1:
            raise ValueError(f"num_streams = {num_streams} must be >= 1")
        self.weight = weight
        self.num_streams = num_streams
        self._sms = _int(sms, "sms")
        self._scratch: dict[int, tuple[Any, Any, list]] = {}
        self._events: dict[int, tuple[Any, list]] = {}  # device -> (caller-ready event, one event per stream)
        self._plans: dict[tuple, Any] = {}  # batched-path launches checked once: key -> gemm.PreparedLaunch
        self._plans_for: tuple = ()  # the weight arrays those plans were checked against
        self._fused_plans: dict[tuple, Any] = {}  # fused_moe layer plans with this stack as w13 (_LayerPlan)

    # ---- ferrum-kernels' surface -----------------------------------------------------------------------------------
    @property
    def n_per_expert(self) -> int:
        return self.weight.size_n

    @property
    def k(self) -> int:
        return self.weight.size_k

    @property
    def num_experts(self) -> int:
        return int(self.weight.num_experts)

    @property
    def act_dtype(self) -> np.dtype:
        return np.dtype(self.weight.act_dtype)

    def expert_views(self) -> list[MarlinWeight]:
        """Single-expert views of the stack (no copies), made once."""
        if getattr(self, "_experts", None) is None or self._experts_of is not self.weight:
            self._experts = [self.weight.expert(e) for e in range(self.num_experts)]
            self._experts_of = self.weight
        return self._experts

    def _device(self) -> int:
        qweight = self.weight.qweight
        if type(qweight) is rt.cupy_array_type():
            return qweight.data.device_id
        if not _on_gpu(qweight):
            raise TypeError("the stack's arrays are not on GPU; build it from gemm.upload_weight(weight)")
        return rt.device_pointer(qweight, "weight.qweight")[1]

    def _scratch_for(self, device: int):
        """(workspace [S·sms] int32 zero, c_tmp [S, c_tmp_numel] fp32, streams [S]), made once per device."""
        if device not in self._scratch:
            cupy = rt.cupy()
            sms = gemm.device_properties(device)[1] if self._sms <= 0 else self._sms
            with cupy.cuda.Device(device):
                ws = cupy.zeros(self.num_streams * gemm.workspace_numel(sms), dtype=np.int32)
                c_tmp = cupy.empty((self.num_streams, gemm.c_tmp_numel(sms)), dtype=np.float32)
                streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(self.num_streams)]
            self._scratch[device] = (ws, c_tmp, streams, sms)
        return self._scratch[device]

    def zero_workspace(self, *, stream=None) -> None:
        """Zero every lock counter once before a batch of launches (the kernels leave them zero; this recovers
        from an interrupted launch and is ferrum-kernels' once-per-batch call)."""
        ws = self._scratch_for(self._device())[0]
        rt.cupy().cuda.runtime.memsetAsync(ws.data.ptr, 0, ws.nbytes, rt.stream_handle(stream))

    def check_dispatches(self, input_shape, output_shape, dispatches) -> list[tuple[int, int, int, int]]:
        """Validated dispatches (pure: no GPU). Output row ranges of different dispatches must not overlap: they
        may run at the same time."""
        rows_in, rows_out = int(input_shape[0]), int(output_shape[0])
        num_experts = self.num_experts
        out: list[tuple[int, int, int, int]] = []
        for i, d in enumerate(dispatches):
            if type(d) is tuple and len(d) == 4 and all(type(v) is int for v in d):
                e, r_in, r_out, m = d  # the common case, without a conversion per field
            else:
                if len(d) != 4:
                    raise ValueError(f"dispatches[{i}] = {d!r} is not (expert_idx, in_row_offset, out_row_offset, m)")
                e, r_in, r_out, m = (_int(v, f"dispatches[{i}][{j}]") for j, v in enumerate(d))
            if not 0 <= e < num_experts:
                raise ValueError(f"dispatches[{i}]: expert_idx = {e} is outside [0, {num_experts})")
            if m < 0 or r_in < 0 or r_out < 0:
                raise ValueError(f"dispatches[{i}] = {tuple(d)} has a negative offset or m")
            if r_in + m > rows_in:
                raise ValueError(f"dispatches[{i}]: input rows [{r_in}, {r_in + m}) exceed input rows = {rows_in}")
            if r_out + m > rows_out:
                raise ValueError(f"dispatches[{i}]: output rows [{r_out}, {r_out + m}) exceed output rows = "
                                 f"{rows_out}")
            if m:
                out.append((e, r_in, r_out, m))
        spans = sorted((r_out, r_out + m, i) for i, (_, _, r_out, m) in enumerate(out))
        for (a0, a1, ia), (b0, b1, ib) in zip(spans, spans[1:]):
            if b0 < a1:
                raise ValueError(f"dispatches write overlapping output rows [{a0}, {a1}) and [{b0}, {b1})")
        return out

    def _check_io(self, input, output, out_rows_name: str):
        for name, x in (("input", input), ("output", output)):
            if not _on_gpu(x):
                raise TypeError(f"{name} is not on GPU (got {type(x).__module__}.{type(x).__name__})")
            if len(x.shape) != 2:
                raise ValueError(f"{name} must be 2-D, got shape {tuple(x.shape)}")
            if np.dtype(x.dtype) != self.act_dtype:
                raise TypeError(f"{name} dtype = {np.dtype(x.dtype)} must be the stack's act dtype {self.act_dtype}")
        if int(input.shape[1]) != self.k:
            raise ValueError(f"input has {int(input.shape[1])} columns, the stack's K = {self.k}")
        if int(output.shape[1]) != self.n_per_expert:
            raise ValueError(f"output has {int(output.shape[1])} columns, the stack's n_per_expert = "
                             f"{self.n_per_expert}")
        if not output.flags["C_CONTIGUOUS"]:
            raise ValueError("output is not contiguous")

    def gemm_phase_batched(self, input, dispatches: Sequence[tuple[int, int, int, int]], output, *, stream=None,
                           policy: MoePolicy | None = None):
        """For each ``(e, in_off, out_off, m)``: ``output[out_off:out_off+m] = input[in_off:in_off+m] @ W[e]``.

        input [R_in, K], output [R_out, n_per_expert] (act dtype, on the GPU). Dispatches go round-robin onto
        ``num_streams`` streams that first wait for the caller's stream; the caller's stream then waits for all.

        Every dense-GEMM check runs on the first dispatch of each row count m (on that dispatch's row, expert and
        scratch views); the others launch the same checked problem at their own addresses (row offset x row
        stride, expert x expert stride: every expert and every lane's scratch has the same shape), each address
        re-checked for alignment by ``PreparedLaunch.launch``. No views, records or allocations per dispatch.
        The dense GEMMs run under ``policy.gemm`` (workbench.policy.MoePolicy; None: the default).
        """
        gemm_policy = (policy or _default()).gemm
        self._check_io(input, output, "output")
        work = self.check_dispatches(input.shape, output.shape, dispatches)
        device = self._device()
        ws, c_tmp, streams, sms = self._scratch_for(device)
        if not work:
            return output
        cupy = rt.cupy()
        caller = rt.cupy_stream(rt.stream_handle(stream))
        nd = rt.cupy_array_type()
        w = self.weight
        if w.has_act_order or type(input) is not nd or type(output) is not nd or type(w.qweight) is not nd:
            lanes = self._join_lanes(caller, streams, len(work), device, before=True)
            with cupy.cuda.Device(device):  # per-dispatch views through marlin_gemm: every check every time
                self._batched_through_views(input, work, output, ws, c_tmp, lanes, sms, gemm_policy)
            self._join_lanes(caller, lanes, len(work), device, before=False)
            return output
        for name, x in (("input", input), ("output", output)):
            if x.data.device_id != device:
                raise ValueError(f"{name} is on device {x.data.device_id} but the stack is on device {device}")
        arrays = (w, w.qweight, w.scales, w.zeros, w.weight_type, w.is_k_full, w.size_k, w.size_n, w.act_dtype)
        if len(self._plans_for) != len(arrays) or any(x is not y for x, y in zip(arrays, self._plans_for)):
            self._plans, self._plans_for = {}, arrays  # the weight changed: nothing checked against it holds
        in_base, in_row = input.data.ptr, input.strides[0]
        out_base, out_row = output.data.ptr, output.strides[0]
        qw_base, qw_step = w.qweight.data.ptr, w.qweight.strides[0]
        sc_base, sc_step = w.scales.data.ptr, w.scales.strides[0]
        zp_base, zp_step = (0, 0) if w.zeros is None else (w.zeros.data.ptr, w.zeros.strides[0])
        ws_base, ws_step = ws.data.ptr, gemm.workspace_numel(sms) * 4
        ct_base, ct_step = c_tmp.data.ptr, c_tmp.strides[0]
        lanes = self._join_lanes(caller, streams, len(work), device, before=True)
        lane_ptrs = [s.ptr for s in lanes]
        n_lanes = len(lanes)
        plans = self._plans
        layout = (input.strides, output.strides, input.dtype, device, sms, gemm_policy.token)
        for i, (e, r_in, r_out, m) in enumerate(work):
            lane = i % n_lanes
            prepared = plans.get((m,) + layout)
            if prepared is None:
                prepared = self._plan_dispatch(input, output, e, r_in, r_out, m, ws, c_tmp, lane, sms, lanes[lane],
                                               gemm_policy)
                if len(plans) >= 1024:  # one per row count and layout: bounded for a long-running server
                    plans.clear()
                plans[(m,) + layout] = prepared
            prepared.launch(in_base + r_in * in_row, qw_base + e * qw_step, out_base + r_out * out_row,
                            ct_base + lane * ct_step, sc_base + e * sc_step, zp_base and zp_base + e * zp_step,
                            0, 0, 0, ws_base + lane * ws_step, lane_ptrs[lane])
        self._join_lanes(caller, lanes, len(work), device, before=False)
        return output

    def _plan_dispatch(self, input, output, e, r_in, r_out, m, ws, c_tmp, lane, sms, lane_stream, gemm_policy):
        """gemm.plan_marlin_gemm on this dispatch's views: every check of a dense call, no launch."""
        per_ws = gemm.workspace_numel(sms)
        return gemm.plan_marlin_gemm(input[r_in:r_in + m], self.expert_views()[e], c=output[r_out:r_out + m],
                                     workspace=ws[lane * per_ws:(lane + 1) * per_ws], c_tmp=c_tmp[lane],
                                     stream=lane_stream, sms=sms, policy=gemm_policy)

    def _batched_through_views(self, input, work, output, ws, c_tmp, lanes, sms, gemm_policy):
        per_ws = gemm.workspace_numel(sms)
        experts = self.expert_views()
        for i, (e, r_in, r_out, m) in enumerate(work):
            lane = i % len(lanes)
            gemm.marlin_gemm(input[r_in:r_in + m], experts[e], c=output[r_out:r_out + m],
                             workspace=ws[lane * per_ws:(lane + 1) * per_ws], c_tmp=c_tmp[lane],
                             stream=lanes[lane], sms=sms, policy=gemm_policy)

    def _join_lanes(self, caller, streams, n_work: int, device: int, *, before: bool):
        """before=True: the streams the dispatches use, each made to wait for the caller's stream (one dispatch:
        the caller's stream itself). before=False (``streams`` = those lanes): the caller waits for every lane.
        The events are made once per device and re-recorded (a wait binds to the record made before it)."""
        if before and n_work == 1:
            return [caller]
        if not before and streams == [caller]:
            return streams
        if device not in self._events:
            cupy = rt.cupy()
            with cupy.cuda.Device(device):
                self._events[device] = (cupy.cuda.Event(disable_timing=True),
                                        [cupy.cuda.Event(disable_timing=True) for _ in range(self.num_streams)])
        ready, done = self._events[device]
        if before:
            lanes = streams[:min(n_work, len(streams))]
            ready.record(caller)
            for s in lanes:
                s.wait_event(ready)
            return lanes
        for s, event in zip(streams, done):
            event.record(s)
            caller.wait_event(event)
        return streams

    def gemm_phase_fused(self, input, sorted_token_ids, expert_ids, num_tokens_post_padded, output, prob_m: int,
                         moe_block_size: int, top_k: int, *, topk_weights=None, stream=None,
                         policy: MoePolicy | None = None):
        """One launch: ``output[id] = input[id // top_k] @ W[expert_ids[b]]`` (× ``topk_weights.flat[id]`` when
        given) for every id < prob_m·top_k of every block b < num_tokens_post_padded / moe_block_size with an
        expert id >= 0. Rows of ``output`` no block names are left untouched. Inputs come from
        ``moe_align_block_size``; input [prob_m, K], output [prob_m·top_k, n_per_expert]."""
        return _launch_fused(self, input, sorted_token_ids, expert_ids, num_tokens_post_padded, output,
                             prob_m, moe_block_size, top_k, topk_weights, stream, policy or _default())

    def make_expert_linear(self, expert_offset: int, expert_n: int, bias=None) -> ExpertLinear:
        """Columns ``[expert_offset, expert_offset + expert_n)`` of the stack's concatenated output space
        (expert e owns ``[e·n_per_expert, (e+1)·n_per_expert)``) as a dense layer. Both must be multiples of 64
        (Marlin tiles are 64 columns wide, and every permutation of scales and zero points stays inside one tile,
        so a 64-aligned column slice of each buffer is itself a valid Marlin layer) and stay within one expert.
        The slice is copied to contiguous buffers (the dense GEMM needs contiguous tiles)."""
        off, n = _int(expert_offset, "expert_offset"), _int(expert_n, "expert_n")
        tile = gemm.TILE_N
        if off < 0 or n <= 0 or off % tile or n % tile:
            raise ValueError(f"expert_offset = {off} and expert_n = {n} must be non-negative / positive multiples "
                             f"of {tile} (Marlin tile width)")
        total = self.num_experts * self.n_per_expert
        if off + n > total:
            raise ValueError(f"columns [{off}, {off + n}) exceed the stack's {self.num_experts} x "
                             f"{self.n_per_expert} = {total} columns")
        e, col = divmod(off, self.n_per_expert)
        if col + n > self.n_per_expert:
            raise ValueError(f"columns [{off}, {off + n}) cross the boundary of expert {e} (its columns are "
                             f"[{e * self.n_per_expert}, {(e + 1) * self.n_per_expert}))")
        w = self.weight.expert(e)
        xp = _xp(w.qweight)
        pf = w.weight_type.pack_factor
        qweight = xp.ascontiguousarray(w.qweight[:, col * 16 // pf:(col + n) * 16 // pf])
        scales = xp.ascontiguousarray(w.scales[:, col:col + n])
        zeros = None if w.zeros is None else xp.ascontiguousarray(w.zeros[:, col // pf:(col + n) // pf])
        one = dataclasses.replace(w, qweight=qweight, scales=scales, zeros=zeros, size_n=n)
        if bias is not None:
            bias_arr = xp.asarray(bias)
            if tuple(bias_arr.shape) != (n,):
                raise ValueError(f"bias has shape {tuple(bias_arr.shape)}, expected ({n},)")
            bias = bias_arr.astype(self.act_dtype)
        return ExpertLinear(one, bias, e, col)


# ---------------------------------------------------------------------------------------------------------------
# The MoE layer
# ---------------------------------------------------------------------------------------------------------------
def choose_block_size(m: int, top_k: int, num_experts: int) -> int:
    """Smallest moe_block_size whose expected rows per expert fill at least ~90% of one block (docs/formats.md, "Fused
    MoE layer")."""
    for b in SUPPORTED_BLOCK_SIZES:
        if m * top_k / num_experts / b < 0.9:
            return b
    return SUPPORTED_BLOCK_SIZES[-1]


def _check_layer(hidden, w13: MarlinExpertStack, w2: MarlinExpertStack, topk_weights, topk_ids):
    if not isinstance(w13, MarlinExpertStack) or not isinstance(w2, MarlinExpertStack):
        raise TypeError("w13_stack and w2_stack must be MarlinExpertStack objects")
    if w13.num_experts != w2.num_experts:
        raise ValueError(f"w13 has {w13.num_experts} experts but w2 has {w2.num_experts}")
    if w13.n_per_expert != 2 * w2.k:
        raise ValueError(f"w13 n_per_expert = {w13.n_per_expert} must be 2 x w2's K = {w2.k} (gate and up)")
    if w2.n_per_expert != w13.k:
        raise ValueError(f"w2 n_per_expert = {w2.n_per_expert} must equal the hidden size w13 K = {w13.k}")
    for name, x in (("hidden", hidden), ("topk_weights", topk_weights), ("topk_ids", topk_ids)):
        if not _on_gpu(x):
            raise TypeError(f"{name} is not on GPU (got {type(x).__module__}.{type(x).__name__})")
    if len(hidden.shape) != 2 or int(hidden.shape[1]) != w13.k:
        raise ValueError(f"hidden has shape {tuple(hidden.shape)}, expected (M, {w13.k})")
    if np.dtype(hidden.dtype) != w13.act_dtype or w13.act_dtype != w2.act_dtype:
        raise TypeError(f"hidden dtype = {np.dtype(hidden.dtype)}, stacks {w13.act_dtype} / {w2.act_dtype}: "
                        f"all must match")
    m = int(hidden.shape[0])
    if len(topk_ids.shape) != 2 or int(topk_ids.shape[0]) != m or tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must both "
                         f"be (M = {m}, top_k)")
    if np.dtype(topk_ids.dtype) != np.int32:
        raise TypeError(f"topk_ids dtype = {np.dtype(topk_ids.dtype)} must be int32")
    if np.dtype(topk_weights.dtype) != np.float32:
        raise TypeError(f"topk_weights dtype = {np.dtype(topk_weights.dtype)} must be float32")
    return m, int(topk_ids.shape[1])


def fused_moe(hidden, w13_stack: MarlinExpertStack, w2_stack: MarlinExpertStack, topk_weights, topk_ids, *,
              path: str = "fused", block_size: int | None = None, expert_map=None, stream=None,
              policy: MoePolicy | None = None):
    """An MoE layer: ``out[t] = Σ_j w[t, j] · (silu(gate) · up)(hidden[t] @ W13[e]) @ W2[e]``, e = topk_ids[t, j].

    hidden [M, K] fp16/bf16, topk_weights [M, top_k] float32, topk_ids [M, top_k] int32, all CuPy arrays;
    w13_stack: n_per_expert = 2N (gate columns first), K; w2_stack: n_per_expert = K, k = N. ``expert_map``
    ([E_global] int32, -1 = not on this device) makes topk_ids global ids. Paths:

    * ``"fused"``: moe_align_block_size (CUDA kernel) + two fused Marlin MoE launches + SiLU + top-k sum;
    * ``"batched"``: rows gathered per expert on the host's orders, one dense GEMM per expert over streams;
    * ``"dense_loop"``: the same, one dense GEMM after another on one stream (the baseline).

    The fused path checks everything on the first call with given shapes, dtypes, devices, top_k, block size,
    expert-map layout and stream, then keeps a plan (``_LayerPlan``) on w13: later such calls re-check the stacks
    and hidden's alignment and launch the five kernels straight through the driver. No call synchronises.

    CUDA graphs: a captured call keeps the addresses of its intermediates — the plan's buffers (freed when the stack
    is dropped or its plans are cleared after ``_MAX_PLANS_PER_STACK`` different call signatures) or, on a first
    call, CuPy pool blocks that later allocations may reuse. For graph capture prefer ``gemm_phase_fused`` with
    buffers you own; replaying a captured ``fused_moe`` after its buffers were released is not safe.

    ``policy``: how kernels are chosen and launched (workbench.policy.MoePolicy; None: the default).
    """
    if path not in PATHS:
        raise ValueError(f"path = {path!r} is not one of {PATHS}")
    policy = policy or _default()
    key = None
    if path == "fused" and policy.layer_plans and policy.gemm.direct_launch:
        key = _layer_key(hidden, w13_stack, w2_stack, topk_weights, topk_ids, block_size, expert_map, stream,
                         policy)
        plan = None if key is None else w13_stack._fused_plans.get(key)
        if plan is not None and plan.matches(w13_stack, w2_stack):
            return plan.run(hidden, topk_weights, topk_ids, expert_map)
    m, top_k = _check_layer(hidden, w13_stack, w2_stack, topk_weights, topk_ids)
    cupy = rt.cupy()
    caller = rt.cupy_stream(rt.stream_handle(stream))
    if m == 0:
        return cupy.empty((0, w13_stack.k), dtype=hidden.dtype)
    with caller:
        if path == "fused":
            out = _fused_path(hidden, w13_stack, w2_stack, topk_weights, topk_ids, m, top_k, block_size,
                              expert_map, caller, policy)
            if key is not None and top_k >= 1 and topk_ids.flags["C_CONTIGUOUS"] and (
                    expert_map is None or expert_map.flags["C_CONTIGUOUS"]):  # else the checked path copies them
                # every check passed on these arguments: later calls with the same key launch from a plan
                num_global = w13_stack.num_experts if expert_map is None else int(expert_map.shape[0])
                block = block_size or choose_block_size(m, top_k, num_global)
                plans = w13_stack._fused_plans  # on the stack: its plans (and their buffers) go when it goes
                if len(plans) >= _MAX_PLANS_PER_STACK:
                    plans.clear()
                plans[key] = _LayerPlan(hidden, w13_stack, w2_stack, top_k, block, num_global, expert_map,
                                        caller.ptr, policy)
            return out
        return _grouped_path(hidden, w13_stack, w2_stack, topk_weights, topk_ids, m, top_k, expert_map, caller,
                             batched=(path == "batched"), policy=policy)


def _fused_path(hidden, w13, w2, topk_weights, topk_ids, m, top_k, block_size, expert_map, caller, policy):
    cupy = rt.cupy()
    num_global = w13.num_experts if expert_map is None else int(expert_map.shape[0])
    block = block_size or choose_block_size(m, top_k, num_global)
    emap = None if expert_map is None else cupy.ascontiguousarray(expert_map)  # NumPy maps are uploaded; dtype kept
    sorted_ids, expert_ids, post = moe_align_block_size(cupy.ascontiguousarray(topk_ids), block, num_global, emap,
                                                        stream=caller)
    g1 = cupy.empty((m * top_k, w13.n_per_expert), dtype=hidden.dtype)
    w13.gemm_phase_fused(hidden, sorted_ids, expert_ids, post, g1, m, block, top_k, stream=caller, policy=policy)
    h = silu_and_mul(g1, stream=caller)
    y = cupy.zeros((m * top_k, w2.n_per_expert), dtype=hidden.dtype)  # rows of non-local entries stay 0
    w2.gemm_phase_fused(h, sorted_ids, expert_ids, post, y, m * top_k, block, 1, topk_weights=topk_weights,
                        stream=caller, policy=policy)
    return moe_sum(y, top_k, stream=caller)


def _grouped_path(hidden, w13, w2, topk_weights, topk_ids, m, top_k, expert_map, caller, batched, policy):
    """Sort the (token, slot) entries by expert on the host, gather rows, one dense GEMM per expert."""
    cupy = rt.cupy()
    ids = cupy.asnumpy(topk_ids).reshape(-1).astype(np.int64)  # synchronises: the host builds the dispatches
    if expert_map is not None:
        emap = cupy.asnumpy(expert_map)
        ok = (ids >= 0) & (ids < emap.shape[0])
        ids = np.where(ok, emap[np.clip(ids, 0, emap.shape[0] - 1)], -1)
    ids = np.where((ids >= 0) & (ids < w13.num_experts), ids, -1)
    order = np.argsort(ids, kind="stable")
    order = order[ids[order] >= 0]  # flat entries of local experts, grouped by expert
    experts, counts = np.unique(ids[order], return_counts=True)
    rows = len(order)
    row_of = np.full(m * top_k, -1, np.int32)  # flat entry -> its row in the expert-grouped buffers
    row_of[order] = np.arange(rows, dtype=np.int32)
    if not rows:
        y = cupy.empty((1, w2.n_per_expert), dtype=hidden.dtype)  # never read: every entry has row -1
    else:
        dispatches = []
        start = 0
        for e, c in zip(experts.tolist(), counts.tolist()):
            dispatches.append((e, start, start, c))
            start += c
        a = gather_rows(hidden, cupy.asarray((order // top_k).astype(np.int32)), stream=caller)  # [rows, K]
        g1 = cupy.empty((rows, w13.n_per_expert), dtype=hidden.dtype)
        y = cupy.empty((rows, w2.n_per_expert), dtype=hidden.dtype)
        if batched:
            w13.gemm_phase_batched(a, dispatches, g1, stream=caller, policy=policy)
            h = silu_and_mul(g1, stream=caller)
            w2.gemm_phase_batched(h, dispatches, y, stream=caller, policy=policy)
        else:
            for e, r0, _, c in dispatches:
                gemm.marlin_gemm(a[r0:r0 + c], w13.expert_views()[e], c=g1[r0:r0 + c], stream=caller,
                                 policy=policy.gemm)
            h = silu_and_mul(g1, stream=caller)
            for e, r0, _, c in dispatches:
                gemm.marlin_gemm(h[r0:r0 + c], w2.expert_views()[e], c=y[r0:r0 + c], stream=caller,
                                 policy=policy.gemm)
    return moe_sum(y, top_k, weights=topk_weights, row_of=cupy.asarray(row_of), stream=caller)


# ---------------------------------------------------------------------------------------------------------------
# The fused kernel (kernels_cuda/marlin_moe.cu mwb::marlin_moe)
# ---------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class MoeConfig(gemm.TileGeometry):
    """One instantiation of ``mwb::marlin_moe``; block shape and shared memory from ``gemm.TileGeometry`` (the stage
    layout of kernels_cuda/marlin_mainloop.cuh, shared with the dense kernel)."""

    act: Any  # ScalarType F16 / BF16
    weight: Any  # ScalarType of the weights
    m_blocks: int  # 16-row blocks of one item (moe_block_size <= 16 m_blocks)
    n_tiles: int  # 64-column tiles of one item
    k_warp: int  # k16 tiles per warp per stage
    stages: int
    group_mode: int = gemm.GROUP_GROUPED  # gemm.GROUP_GROUPED or GROUP_CHANNELWISE (no act-order in the fused kernel)
    blocks_per_sm: int = 1  # CTAs per SM the registers are cut for (2: 128 registers, 16-row items only)
    swap: bool = False  # moe_block_size 8: one mma per 16x16 sub-block on the transposed problem

    @property
    def name_expression(self) -> str:
        from workbench.scalar_types import ScalarType

        t = "__half" if self.act is ScalarType.F16 else "__nv_bfloat16"
        return f"mwb::marlin_moe<{t}, {self.weight.abi_code}, {self.m_blocks}, {self.n_tiles}, {self.k_warp}, " \
               f"{self.stages}, {self.group_mode}, {self.blocks_per_sm}, {str(self.swap).lower()}>"


def choose_moe_config(act, weight, moe_block_size: int, size_n: int, size_k: int, group_size: int,
                      items_hint: int, sms: int, smem_limit: int, sm_smem: int = 0,
                      blocks_per_sm: int = -1, policy: MoePolicy | None = None) -> MoeConfig:
    """The first (BN, BK) that divides (N, K); 128 columns only when that still gives every SM an item.

    ``sm_smem``: shared memory per SM (0 = unknown: one CTA per SM). ``blocks_per_sm``: 1 or 2 to force the one- or
    two-CTA kernel (2 only where it exists: 16-row items with a ring that fits half an SM), -1 = the policy's
    ``blocks_per_sm``. ``policy``: workbench.policy.MoePolicy (None: the default).
    """
    p = policy or _default()
    m_blocks = -(-moe_block_size // 16)
    group_mode = gemm.GROUP_CHANNELWISE if group_size < 0 else gemm.GROUP_GROUPED
    shapes = p.small_shapes if m_blocks <= 2 else p.large_shapes
    fits = []
    for n_tiles, k_warp in shapes:
        cfg = MoeConfig(act, weight, m_blocks, n_tiles, k_warp, 4, group_mode,
                        swap=moe_block_size <= min(p.swap_max_block, 8))
        if size_k % cfg.block_k or size_n % cfg.block_n:
            continue
        if group_size > 0 and group_size % cfg.block_k and cfg.block_k % group_size:
            continue
        fits.append(cfg)
    if not fits:
        raise ValueError(f"no fused MoE tile shape divides (size_k, size_n) = ({size_k}, {size_n}); size_k % 128 == 0 "
                         f"and size_n % 64 == 0 always works")
    wide = [c for c in fits if c.n_tiles >= 2 and items_hint * (size_n // c.block_n) >= sms]
    narrow = [c for c in fits if c.n_tiles == 1]
    preferred = wide or narrow or fits
    order = preferred + [c for c in fits if c not in preferred]
    if blocks_per_sm < 0:
        blocks_per_sm = p.blocks_per_sm
    if blocks_per_sm not in (0, 1, 2):
        raise ValueError(f"blocks_per_sm = {blocks_per_sm} must be 0 (automatic), 1 or 2")
    if m_blocks == 1 and sm_smem > 0 and blocks_per_sm != 1:
        half = gemm.two_block_smem(smem_limit, sm_smem)
        two = next((cfg for shape in order for stages in p.two_block_stages
                    for cfg in [dataclasses.replace(shape, stages=stages, blocks_per_sm=2)]
                    if cfg.smem_bytes <= half), None)
        if two is not None and (blocks_per_sm == 2 or (
                weight.bits in p.two_blocks_weight_bits and items_hint * (size_n // two.block_n) > sms)):
            return two
    for shape in order:
        for stages in (p.one_block_stages if m_blocks <= 2 else p.large_stages):
            cfg = dataclasses.replace(shape, stages=stages)
            if cfg.smem_bytes <= smem_limit:
                return cfg
    raise ValueError(f"no fused MoE tile for moe_block_size {moe_block_size} fits {smem_limit} bytes of shared memory")


def _check_int_vector(x, name: str):
    if not _on_gpu(x):
        raise TypeError(f"{name} is not on GPU (got {type(x).__module__}.{type(x).__name__})")
    if np.dtype(x.dtype) != np.int32 or len(x.shape) != 1 or not x.flags["C_CONTIGUOUS"]:
        raise TypeError(f"{name} must be a contiguous 1-D int32 array, got {np.dtype(x.dtype)} {tuple(x.shape)}")


def _launch_fused(stack: MarlinExpertStack, input, sorted_token_ids, expert_ids, num_tokens_post_padded, output,
                  prob_m, moe_block_size, top_k, topk_weights, stream, policy: MoePolicy):
    w = stack.weight
    prob_m, moe_block_size, top_k = (_int(v, n) for v, n in ((prob_m, "prob_m"), (moe_block_size, "moe_block_size"),
                                                             (top_k, "top_k")))
    if moe_block_size not in SUPPORTED_BLOCK_SIZES:
        raise ValueError(f"unsupported moe_block_size={moe_block_size}; one of {SUPPORTED_BLOCK_SIZES}")
    if top_k < 1 or prob_m < 0:
        raise ValueError(f"top_k = {top_k} must be >= 1 and prob_m = {prob_m} >= 0")
    if w.has_act_order:
        raise UnsupportedError("the fused Marlin MoE kernel does not take act-order (g_idx/perm) stacks; use "
                               "gemm_phase_batched")
    stack._check_io(input, output, "output")
    if int(input.shape[0]) != prob_m:
        raise ValueError(f"Shape mismatch: input.size(0) = {int(input.shape[0])}, prob_m = {prob_m}")
    numel = prob_m * top_k
    if int(output.shape[0]) != numel:
        raise ValueError(f"Shape mismatch: c.size(0) = {int(output.shape[0])}, size_m * topk = {numel}")
    if numel >= 2 ** 31:
        raise ValueError(f"prob_m * top_k = {numel} does not fit the kernel's 32-bit row ids")
    item = np.dtype(input.dtype).itemsize
    if prob_m > 0 and int(input.strides[1]) != item:
        raise ValueError("input.stride(1) is not 1")
    lda = int(input.strides[0]) // item if prob_m > 1 else stack.k
    if lda % 8 or lda < stack.k:
        raise ValueError(f"input.stride(0) = {lda} must be >= K = {stack.k} and divisible by 8 (16-byte rows)")
    for name, x in (("sorted_token_ids", sorted_token_ids), ("expert_ids", expert_ids),
                    ("num_tokens_post_padded", num_tokens_post_padded)):
        _check_int_vector(x, name)
    cap = int(sorted_token_ids.shape[0])
    if cap % moe_block_size:
        raise ValueError(f"sorted_token_ids has {cap} entries, not a multiple of moe_block_size = {moe_block_size}")
    if int(expert_ids.shape[0]) != cap // moe_block_size:
        raise ValueError(f"expert_ids has {int(expert_ids.shape[0])} entries, expected sorted_token_ids.size / "
                         f"moe_block_size = {cap // moe_block_size}")
    if int(num_tokens_post_padded.shape[0]) < 1:
        raise ValueError("num_tokens_post_padded is empty")
    if topk_weights is not None:
        if not _on_gpu(topk_weights):
            raise TypeError("topk_weights is not on GPU")
        if np.dtype(topk_weights.dtype) != np.float32 or int(topk_weights.size) != numel or \
                not topk_weights.flags["C_CONTIGUOUS"]:
            raise ValueError(f"topk_weights must be contiguous float32 with prob_m * top_k = {numel} elements, got "
                             f"{np.dtype(topk_weights.dtype)} {tuple(topk_weights.shape)}")
    ng = int(w.scales.shape[1])
    group = -1 if ng == 1 else stack.k // ng
    if ng > 1 and (stack.k % ng or group not in gemm.GROUP_SIZES):
        raise ValueError(f"group size = K / num_groups = {stack.k} / {ng} is not one of {gemm.GROUP_SIZES} or "
                         f"channelwise")
    device = stack._device()
    for name, x in (("input", input), ("output", output), ("sorted_token_ids", sorted_token_ids),
                    ("expert_ids", expert_ids), ("num_tokens_post_padded", num_tokens_post_padded),
                    ("topk_weights", topk_weights)):
        if x is not None and rt.device_pointer(x, name)[1] != device:
            raise ValueError(f"{name} is on device {rt.device_pointer(x, name)[1]} but the stack is on {device}")
    if input.data.ptr % 16:
        raise ValueError("input must be aligned to 16 bytes")
    if numel == 0 or cap == 0:
        return output
    cfg, grid, n_blocks = _fused_grid(stack, device, gemm.act_scalar_type(input.dtype), moe_block_size, numel, cap,
                                      group, policy)
    _launch_fused_phase(cfg, grid, device, policy, (
        input.data.ptr, w.qweight.data.ptr, output.data.ptr, w.scales.data.ptr,
        0 if w.zeros is None else w.zeros.data.ptr, sorted_token_ids.data.ptr, expert_ids.data.ptr,
        num_tokens_post_padded.data.ptr, 0 if topk_weights is None else topk_weights.data.ptr, n_blocks,
        moe_block_size, numel, top_k, stack.n_per_expert, stack.k, lda, group, stack.num_experts),
        rt.stream_handle(stream))
    return output


def _launch_smem(cfg: MoeConfig, device: int, policy: MoePolicy) -> int:
    """The shared memory of a programmatic launch of a fused GEMM: pinned to its planned CTAs per SM, as the dense
    GEMM's (the policy's ``programmatic_pin_occupancy``: a grid placed while the one before runs would otherwise
    stack CTAs on the SMs that grid leaves idle)."""
    if not policy.programmatic_pin_occupancy:
        return cfg.smem_bytes
    key = (cfg.name_expression, device, cfg.blocks_per_sm)
    if key not in _pinned_smem:
        _pinned_smem[key] = gemm.pin_occupancy_of(get_moe_kernel(cfg.name_expression, device, cfg.smem_bytes),
                                                  device, cfg.smem_bytes, cfg.blocks_per_sm)
    return _pinned_smem[key]


_pinned_smem: dict[tuple[str, int, int], int] = {}  # (kernel, device, CTAs per SM) -> _launch_smem's answer


def _launch_fused_phase(cfg: MoeConfig, grid: int, device: int, policy: MoePolicy, values: tuple,
                        stream: int) -> None:
    """One fused GEMM phase on checked arguments: ``values`` in the kernel's parameter order
    (PLAN_ARG_KINDS["marlin_moe"]: addresses, then int32 scalars), launched programmatically (the policy's
    programmatic_launch on sm_90+, shared memory pinned as the dense GEMM's) or plainly. The launch and argument
    block are made once per (kernel, device, grid, form) and reused under a lock (making them costs tens of µs)."""
    programmatic = gemm.programmatic_launches(device, policy.programmatic_launch)
    key = (cfg.name_expression, device, grid, cfg.blocks_per_sm, programmatic,
           programmatic and policy.programmatic_pin_occupancy)
    prepared = _phase_launches.get(key)
    if prepared is None:
        f = _moe_function_ptr(cfg.name_expression, device, cfg.smem_bytes)
        launch = rt.Launch(f, grid, 256, cfg.smem_bytes)
        if programmatic:
            pinned = rt.Launch(f, grid, 256, _launch_smem(cfg, device, policy), programmatic=True)
            launch = pinned if pinned.supported else launch  # (no cuda-python driver bindings: plain)
        prepared = (launch, rt.ArgBlock(PLAN_ARG_KINDS["marlin_moe"]), threading.Lock())
        if len(_phase_launches) >= _MAX_CACHED:
            _phase_launches.clear()
        _phase_launches[key] = prepared
    launch, args, lock = prepared
    with rt.cupy().cuda.Device(device), lock:
        args.set(values)
        rt_launch.launch_kernel(launch, stream, args.address)


def _launch_helper(name_expression: str, device: int, blocks: int, threads: int, values: tuple, stream) -> None:
    """One launch of a marlin_moe.cu helper kernel (align, SiLU, sum, gather, bias; parameters PLAN_ARG_KINDS) on
    checked arguments, through the runtime's launch call."""
    kinds = PLAN_ARG_KINDS[name_expression.split("<")[0].removeprefix("mwb::")]
    args = rt.ArgBlock(kinds)
    args.set(values)
    launch = rt.Launch(_moe_function_ptr(name_expression, device), blocks, threads, 0)
    with rt.cupy().cuda.Device(device):
        rt_launch.launch_kernel(launch, rt.stream_handle(stream), args.address)


# (kernel, device, grid, CTAs per SM, programmatic, pinned) -> (launch, argument block, lock)
_phase_launches: dict[tuple, tuple] = {}


def _fused_grid(stack: MarlinExpertStack, device: int, act, moe_block_size: int, numel: int, cap: int, group: int,
                policy: MoePolicy):
    """(config, grid, n_blocks) of one fused launch on checked arguments (shared by _launch_fused and the layer
    plans, so both launch the same kernel on the same grid)."""
    props = gemm.device_properties(device)  # (cc, SMs, opt-in smem per block, smem per SM)
    sms, smem_limit, sm_smem = props[1], props[2], props[3]
    if stack._sms > 0:
        sms = stack._sms
    n_blocks = cap // moe_block_size
    items_hint = min(n_blocks, numel)
    cfg = cached_moe_config(act, stack.weight.weight_type, moe_block_size, stack.n_per_expert, stack.k, group,
                            items_hint, sms, smem_limit, sm_smem, policy)
    # No CTA waits on another, so a grid larger than what is resident is correct, only slower.
    grid = max(1, min(sms * cfg.blocks_per_sm, items_hint * (stack.n_per_expert // cfg.block_n)))
    return cfg, grid, n_blocks


# ---------------------------------------------------------------------------------------------------------------
# Host cost of fused_moe: a cached kernel configuration, and per-layer plans launched straight through the driver
# ---------------------------------------------------------------------------------------------------------------
_config_cache: dict[tuple, MoeConfig] = {}
_MAX_CACHED = 1024  # entries per cache: a serving loop sees a few dozen shapes; the bound keeps a sweep finite


def cached_moe_config(act, weight, moe_block_size: int, size_n: int, size_k: int, group_size: int, items_hint: int,
                      sms: int, smem_limit: int, sm_smem: int, policy: MoePolicy | None = None) -> MoeConfig:
    """choose_moe_config, remembered per arguments and policy (choose_moe_config costs tens of µs, twice a layer)."""
    policy = policy or _default()
    key = (act, weight, moe_block_size, size_n, size_k, group_size, items_hint, sms, smem_limit, sm_smem, policy)
    cfg = _config_cache.get(key)
    if cfg is None:
        cfg = choose_moe_config(act, weight, moe_block_size, size_n, size_k, group_size, items_hint, sms, smem_limit,
                                sm_smem, policy=policy)
        if len(_config_cache) >= _MAX_CACHED:
            _config_cache.clear()
        _config_cache[key] = cfg
    return cfg


# Parameter lists of the marlin_moe.cu kernels (their argument blocks), 'p' = 64-bit address, 'i' = int32
# (checked against kernels_cuda/marlin_moe.cu by tests/cpu/test_moe_plan.py).
PLAN_ARG_KINDS = {"marlin_moe": "ppppppppp" + "iiiiiiiii", "moe_align": "piiippipp", "silu_and_mul": "ppii",
                  "moe_sum": "ppppiiii", "gather_rows": "pppiii", "add_bias": "ppii"}


def _moe_function_ptr(name_expression: str, device: int, smem_bytes: int = 0) -> int:
    """The CUfunction handle of one marlin_moe.cu instantiation on one device (compiled on first use)."""
    return _module.function_ptr(name_expression, device, smem_bytes)


class _LayerPlan:
    """One fused_moe layer (stacks, shapes, dtypes, devices, top_k, block size, stream, expert-map layout) whose
    every check passed on a first call through the checked path. ``run`` re-checks what the key leaves out (the
    stacks' arrays and fields, hidden's alignment) and then launches align, gate_up, SiLU, down and the top-k sum
    through cuLaunchKernel on argument blocks made once, into intermediates kept per plan (the plan is per stream:
    stream order keeps one call's reads before the next call's writes). No device -> host synchronisation."""

    def __init__(self, hidden, w13: MarlinExpertStack, w2: MarlinExpertStack, top_k: int, block: int,
                 num_global: int, expert_map, stream_ptr: int, policy: MoePolicy):
        from workbench.formats.moe_align import aligned_capacity

        cupy = rt.cupy()
        m, k = (int(s) for s in hidden.shape)
        act = gemm.act_scalar_type(hidden.dtype)
        self.device = device = w13._device()
        self.dtype = hidden.dtype
        self.m, self.k, self.top_k, self.stream = m, k, top_k, stream_ptr
        self.w2 = w2  # keeps id(w2) in the key unique while the plan lives; w13 holds the plan (no cycle with it)
        self.state13, self.state2 = _stack_state(w13), _stack_state(w2)
        numel = m * top_k
        cap = aligned_capacity(numel, block, num_global)
        n13, n2 = w13.n_per_expert, w2.n_per_expert
        item = np.dtype(hidden.dtype).itemsize
        lda = int(hidden.strides[0]) // item if m > 1 else w13.k
        launches = []
        # programmatic dependent launches (the policy's programmatic_launch, sm_90+): each kernel waits for the one
        # before (kernels_cuda/marlin_moe.cu) before touching its data; the GEMMs' shared memory pinned as the dense
        # one's
        programmatic = gemm.programmatic_launches(device, policy.programmatic_launch)
        pinned = {}  # GEMM function -> the shared memory of its programmatic launch (_launch_smem)
        # moe_align: one block of ALIGN_THREADS
        f = _moe_function_ptr("mwb::moe_align", device)
        launches.append((f, 1, ALIGN_THREADS, 0, rt.ArgBlock(PLAN_ARG_KINDS["moe_align"]),
                         ("ids", numel, num_global, block, "emap", "sorted", cap, "experts", "post")))
        for stack, a, c, weights, rows, tk, a_lda in ((w13, "hidden", "g1", 0, m, top_k, lda),
                                                      (w2, "h", "y", "weights", numel, 1, w2.k)):
            ng = int(stack.weight.scales.shape[1])
            group = -1 if ng == 1 else stack.k // ng
            cfg, grid, n_blocks = _fused_grid(stack, device, act, block, rows * tk, cap, group, policy)
            f = _moe_function_ptr(cfg.name_expression, device, cfg.smem_bytes)
            if programmatic:
                pinned[f] = _launch_smem(cfg, device, policy)
            w = stack.weight
            launches.append((f, grid, 256, cfg.smem_bytes, rt.ArgBlock(PLAN_ARG_KINDS["marlin_moe"]),
                             (a, w.qweight.data.ptr, c, w.scales.data.ptr, 0 if w.zeros is None else w.zeros.data.ptr,
                              "sorted", "experts", "post", weights, n_blocks, block, rows * tk, tk,
                              stack.n_per_expert, stack.k, a_lda, group, stack.num_experts)))
            if stack is w13:  # SiLU-and-multiply between the GEMMs
                f = _moe_function_ptr(f"mwb::silu_and_mul<{_ctype(hidden.dtype)}>", device)
                half = n13 // 2
                launches.append((f, min(65535, -(-(numel * half) // 256)), 256, 0,
                                 rt.ArgBlock(PLAN_ARG_KINDS["silu_and_mul"]), ("g1", "h", numel, half)))
        f = _moe_function_ptr(f"mwb::moe_sum<{_ctype(hidden.dtype)}>", device)
        launches.append((f, min(65535, -(-(m * k) // 256)), 256, 0, rt.ArgBlock(PLAN_ARG_KINDS["moe_sum"]),
                         ("y", 0, 0, "out", m, top_k, k, numel)))
        self.y_bytes = numel * n2 * item
        shapes = dict(sorted=((cap,), np.int32), experts=((cap // block,), np.int32), post=((1,), np.int32),
                      g1=((numel, n13), hidden.dtype), h=((numel, n13 // 2), hidden.dtype),
                      y=((numel, n2), hidden.dtype))
        self.shapes = shapes
        total = sum(int(np.prod(s)) * np.dtype(d).itemsize for s, d in shapes.values())
        self.buffers = None
        if total <= policy.plan_max_workspace_bytes:
            with cupy.cuda.Device(device), rt.cupy_stream(stream_ptr):
                self.buffers = {name: cupy.empty(s, dtype=d) for name, (s, d) in shapes.items()}
        fixed = {} if self.buffers is None else {name: b.data.ptr for name, b in self.buffers.items()}
        # per launch: (workbench.cuda.Launch, argument table, [(array, index, name) filled per call], argument
        # block); scalars, weights and kept intermediates are written once here
        self.launches = []
        for f, grid, threads, smem, args, values in launches:
            dynamic = []
            for i, v in enumerate(values):
                array, at = args.slot(i)
                if type(v) is not str:
                    array[at] = v
                elif v in fixed:
                    array[at] = fixed[v]
                else:
                    dynamic.append((array, at, v))
            launch = rt.Launch(f, grid, threads, pinned.get(f, smem) if programmatic else smem,
                               programmatic=programmatic)
            if programmatic and not launch.supported:  # no cuda-python driver bindings: plain launches
                launch = rt.Launch(f, grid, threads, smem)
            self.launches.append((launch, args.address, dynamic, args))
        self._lock = threading.Lock()

    def matches(self, w13, w2) -> bool:
        return _same_state(_stack_state(w13), self.state13) and _same_state(_stack_state(w2), self.state2)

    def run(self, hidden, topk_weights, topk_ids, expert_map):
        a = hidden.data.ptr
        if a % 16:
            raise ValueError("input must be aligned to 16 bytes")
        cupy = rt.cupy()
        runtime = cupy.cuda.runtime
        if runtime.getDevice() != self.device:  # switch only when another device is current
            with cupy.cuda.Device(self.device):
                return self._run(cupy, runtime, a, topk_weights, topk_ids, expert_map)
        return self._run(cupy, runtime, a, topk_weights, topk_ids, expert_map)

    def _run(self, cupy, runtime, a, topk_weights, topk_ids, expert_map):
        stream = self.stream
        if stream == cupy.cuda.get_current_stream().ptr:
            out = cupy.empty((self.m, self.k), dtype=self.dtype)  # (M, K): the caller's, fresh every call
            bufs = self.buffers or {name: cupy.empty(s, dtype=d) for name, (s, d) in self.shapes.items()}
        else:
            with rt.cupy_stream(stream):  # allocated in the launch stream's order
                out = cupy.empty((self.m, self.k), dtype=self.dtype)
                bufs = self.buffers or {name: cupy.empty(s, dtype=d) for name, (s, d) in self.shapes.items()}
        ptrs = {name: b.data.ptr for name, b in bufs.items()}
        ptrs.update(hidden=a, out=out.data.ptr, ids=topk_ids.data.ptr, weights=topk_weights.data.ptr,
                    emap=0 if expert_map is None else expert_map.data.ptr)
        launch_kernel = rt_launch.launch_kernel
        with self._lock:  # the argument blocks are shared by every call of this plan
            # first, so that the five kernels follow each other with nothing between (a programmatic launch after
            # a memset is a plain one): rows of entries no local expert takes stay 0 in the down GEMM's output
            runtime.memsetAsync(ptrs["y"], 0, self.y_bytes, stream)
            for launch, params, dynamic, _ in self.launches:
                for array, at, name in dynamic:
                    array[at] = ptrs[name]
                launch_kernel(launch, stream, params)
        return out


def _stack_state(stack: MarlinExpertStack):
    """What a layer plan read from a stack: (objects compared by identity, values compared by ==)."""
    w = stack.weight
    return ((w, w.qweight, w.scales, w.zeros, w.g_idx, w.perm),
            (w.size_k, w.size_n, w.num_experts, w.weight_type, w.act_dtype, w.group_size, stack._sms,
             tuple(w.qweight.shape), tuple(w.scales.shape), None if w.zeros is None else tuple(w.zeros.shape)))


def _same_state(now, then) -> bool:
    return all(x is y for x, y in zip(now[0], then[0])) and now[1] == then[1]


_MAX_PLANS_PER_STACK = 64  # (M, top_k, stream, ...) combinations of one layer: a serving loop sees a handful


def _array_key(x, array_type):
    """(shape, strides, dtype, device) of a CuPy array; None for anything else (those take the checked path)."""
    if type(x) is not array_type:
        return None
    return x.shape, x.strides, x.dtype, x.data.device_id


def _layer_key(hidden, w13, w2, topk_weights, topk_ids, block_size, expert_map, stream, policy):
    """Everything a layer plan depends on but the stacks' contents (checked by _LayerPlan.matches) and the
    addresses of the per-call arrays (read on every call); None: no plan for these arguments."""
    array_type = rt.cupy_array_type()
    keys = (_array_key(hidden, array_type), _array_key(topk_weights, array_type), _array_key(topk_ids, array_type))
    if None in keys or type(w13) is not MarlinExpertStack or type(w2) is not MarlinExpertStack:
        return None
    if expert_map is None:
        emap = None
    else:
        emap = _array_key(expert_map, array_type)
        if emap is None:  # a NumPy map is uploaded on every call by the checked path
            return None
    stream_ptr = rt.stream_handle(stream)  # after the type checks: no CUDA call for host arrays
    # kept in w13's _fused_plans; a plan holds w2, so id(w2) is not reused while the plan lives
    key = (id(w2),) + keys + (type(block_size), block_size, emap, stream_ptr, policy.token)
    try:
        hash(key)
    except TypeError:  # an unhashable block_size: the checked path
        return None
    return key


# ---------------------------------------------------------------------------------------------------------------
# The default policy, and the old module globals (deprecated: they read and write it for one release)
# ---------------------------------------------------------------------------------------------------------------
_default_policy: MoePolicy = DEFAULT_MOE_POLICY


def _default() -> MoePolicy:
    """The policy of calls that pass none: DEFAULT_MOE_POLICY unless a deprecated module global was set."""
    return _default_policy


install_deprecated_globals(__name__, MOE_GLOBALS, "workbench.policy.DEFAULT_MOE_POLICY")
