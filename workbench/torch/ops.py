"""The ``torch.ops.workbench`` ops: vLLM's names, argument lists and scalar-type ids, on torch tensors.

Mirrors vLLM at commit 7bcae67b5de3f155e70026695285de25d096b801 (``csrc/torch_bindings.cpp``,
``vllm/_custom_ops.py``; docs/torch.md says what was read where). Registered when ``workbench.torch`` is imported:

* ``marlin_gemm`` / ``gptq_marlin_gemm`` (CUDA): C = A @ dequant(B) + b_bias, vLLM's 19 arguments, then workbench's
  keyword-only ``deterministic`` / ``batch_invariant`` (``workbench.gemm.gptq_marlin_gemm``'s modes); ``c`` must be
  None; size_k / size_n are the true sizes, the weight arrays padded to whole tiles (docs/formats.md);
* ``marlin_gemm_out`` / ``gptq_marlin_gemm_out`` (CUDA): the same, writing the given ``c`` (``Tensor(a!) c``);
* ``moe_wna16_marlin_gemm[_out]`` (CUDA): the fused MoE GEMM over moe_align_block_size's blocks, vLLM's 29 arguments,
  then a keyword-only ``batch_invariant``;
* ``moe_align_block_size`` (CPU, CUDA): vLLM's mutating form, filling sorted_token_ids, experts_ids and
  num_tokens_post_pad;
* ``gptq_marlin_repack``, ``awq_marlin_repack`` (CPU, CUDA): checkpoint words -> Marlin tiles (``is_a_8bit`` False);
* ``marlin_permute_scales`` (CPU, CUDA): scales -> Marlin order (vLLM's Python helper, registered here as an op);
* ``marlin_zero_points``, ``awq_to_marlin_zero_points`` (CPU, CUDA): zero points -> Marlin zero points;
* ``marlin_to_gptq_qweight``, ``marlin_to_awq_qweight``, ``marlin_unpermute_scales`` (CPU, CUDA): the inverses.

Layout ops run ``workbench.ops``: the NumPy reference on CPU tensors, the Numba kernels on CUDA tensors (on the
current torch stream, the result copied into a tensor from torch's allocator). The dense GEMM keeps a plan per call
signature and launches the runtime's prepared launch (``workbench.gemm.plan_marlin_gemm``) on the tensors' addresses
and the current torch stream. The MoE GEMM and moe_align call the public CuPy entry points of ``workbench.moe``
through DLPack views, with the current torch stream as CuPy's stream. Outputs, ``a_tmp`` and the partial sums come
from torch's caching allocator (a MoE expert stack's own scratch and moe_align's intermediate arrays still come
from CuPy's pool).

Each op has a fake implementation: output metadata plus every check that reads no values (shapes, dtypes,
devices, the unimplemented arguments), so ``torch.compile(fullgraph=True)`` traces it with a symbolic M and bad input
fails while tracing. Checks that need values (a permutation's entries, the routed token count) run in the kernels.

The module-level functions (``marlin_gemm(...)``, ``gptq_marlin_repack(...)``, ...) are what Python callers use: they
also take a ScalarType object for ``b_q_type``, route a given ``c`` to the ``_out`` op, and skip the dispatcher in
eager mode (``_library.bypass``), as ``torch.ops.workbench.<op>(...)`` itself does (``_library._fast_packet``).
"""
from __future__ import annotations

import collections
from typing import Any

import torch

from workbench import ops as wb_ops
from workbench.formats._checks import check_bits, require
from workbench.formats.moe_align import SUPPORTED_BLOCK_SIZES
from workbench.gemm.checks import group_size_of
from workbench.torch import _tensors as T
from workbench.torch._library import bypass, define, refuse_grad
from workbench.torch.scalar_ids import as_type_id, from_vllm_id

VLLM_COMMIT = "7bcae67b5de3f155e70026695285de25d096b801"
TILE = 16  # Marlin tile height along K (and the 16 rows of a tile row in b_q_weight)

# A symbolic M is at least 2 (Dynamo specializes extents 0 and 1), and every shape rule treats M = 2 as any M > 1:
# the checks written for ints run on this stand-in while the traced graph keeps M symbolic.
REPRESENTATIVE_ROWS = 2


def _is_symbolic(*values) -> bool:
    return any(isinstance(v, torch.SymInt) for v in values)


def _static(value, name: str) -> int:
    """A weight extent (N, K): an int, or a SymInt that is specialized (these are fixed by the weight)."""
    if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    return int(value)


def _stream_ptr(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream


_SMS: dict[int, int] = {}


def _sms(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]


def make_workspace(device) -> torch.Tensor:
    """A zeroed int32 lock-counter buffer for the GEMMs on ``device`` (vLLM's ``marlin_make_workspace_new``); every
    launch leaves it zero, so one per device and stream can serve every layer."""
    from workbench import gemm

    device = torch.device(device)
    return torch.zeros(gemm.workspace_numel(_sms(device)), dtype=torch.int32, device=device)


_C_TMP: dict[tuple[int, int], torch.Tensor] = {}
DEFAULT_STREAM = 0  # the raw handle of a device's default (legacy) stream


def _c_tmp(device: torch.device, stream_ptr: int, sms: int) -> torch.Tensor:
    """The fp32 partial-sum buffer of one launch, from torch's allocator. On the default stream one buffer per
    (device, SMs) is kept for the process: launches on one stream run in order and can share it (as
    ``gemm.scratch_buffers`` does for CuPy), and no CUDA graph captures or allocates on that stream. On any other
    stream it is a temporary of the call (as vLLM allocates it): a buffer kept there would be made inside a CUDA
    graph's private pool whenever the first call on that stream is under capture or Inductor's CUDA graph trees
    (which refuse a live allocation in their pool that no output owns)."""
    from workbench import gemm

    if stream_ptr != DEFAULT_STREAM:
        return torch.empty(gemm.c_tmp_numel(sms), dtype=torch.float32, device=device)
    key = (device.index, sms)
    if key not in _C_TMP:
        _C_TMP[key] = torch.empty(gemm.c_tmp_numel(sms), dtype=torch.float32, device=device)
    return _C_TMP[key]


# ---------------------------------------------------------------------------------------------------------------
# dense GEMM: marlin_gemm (vLLM's current name), gptq_marlin_gemm (its earlier name), and their _out forms
# ---------------------------------------------------------------------------------------------------------------
GEMM_ARGS = ("Tensor b_q_weight, Tensor? b_bias, Tensor b_scales, Tensor? a_scales, Tensor? global_scale, "
             "Tensor? b_zeros, Tensor? g_idx, Tensor? perm, Tensor workspace, int b_q_type, SymInt size_m, "
             "SymInt size_n, SymInt size_k, bool is_k_full=True, bool use_atomic_add=False, "
             "bool use_fp32_reduce=False, bool is_zp_float=False")
# workbench-only, keyword-only (after vLLM's arguments, which keep their positions): gemm.gptq_marlin_gemm's modes
GEMM_FLAGS = ", *, bool deterministic=False, bool batch_invariant=False"
GEMM_SCHEMA = f"(Tensor a, Tensor? c, {GEMM_ARGS}{GEMM_FLAGS}) -> Tensor"
GEMM_OUT_SCHEMA = f"(Tensor a, Tensor(a!) c, {GEMM_ARGS}{GEMM_FLAGS}) -> ()"


def check_gemm(op: str, a, c, b_q_weight, b_bias, b_scales, a_scales, global_scale, b_zeros, g_idx, perm, workspace,
               b_q_type, size_m, size_n, size_k, is_k_full, use_atomic_add, use_fp32_reduce, is_zp_float, *,
               deterministic=False, batch_invariant=False):
    """Every rule of a dense GEMM call that reads no values; returns the weight ScalarType. The shape, dtype and
    stride rules are ``gemm.check_gemm_shapes``'s (the CuPy entry point's), run on specs of the tensors."""
    from workbench import gemm
    from workbench.gemm.checks import check_reduction

    T.require_cuda(op, "a", a)
    T.require_same_device(op, "a", a, c=c, b_q_weight=b_q_weight, b_scales=b_scales, b_zeros=b_zeros, g_idx=g_idx,
                          perm=perm, workspace=workspace, b_bias=b_bias, a_scales=a_scales, global_scale=global_scale)
    T.require_unimplemented_absent(op, a_scales=a_scales, is_zp_float=is_zp_float)
    _require_flags(op, deterministic=deterministic, batch_invariant=batch_invariant)
    check_reduction(bool(use_atomic_add), bool(deterministic), bool(batch_invariant))
    weight = from_vllm_id(b_q_type)
    size_n, size_k = _static(size_n, "size_n"), _static(size_k, "size_k")
    rows = None
    if _is_symbolic(size_m, a.shape[0]):
        torch._check(a.shape[0] == size_m, lambda: f"Shape mismatch: a.size(0) = {a.shape[0]}, size_m = {size_m}")
        if c is not None:
            torch._check(c.shape[0] == size_m, lambda: f"Shape mismatch: c.size(0) = {c.shape[0]}, size_m = {size_m}")
        rows = REPRESENTATIVE_ROWS
    m = size_m if rows is None else rows
    zeros = None if T.is_empty(b_zeros) else b_zeros
    gemm.check_gemm_shapes(T.spec(a, "a", rows), T.spec(b_q_weight, "b_q_weight"), T.spec(b_scales, "b_scales"),
                           T.spec(zeros, "b_zeros"), T.spec(g_idx, "g_idx"), T.spec(perm, "perm"), weight, m, size_n,
                           size_k, is_k_full, T.spec(c, "c", rows), T.spec(global_scale, "global_scale"))
    if not T.is_empty(b_bias):  # vLLM's b_bias: (size_n,) in a's dtype, added in the kernel's epilogue
        gemm.check_bias(T.spec(b_bias, "b_bias"), size_n, T.numpy_dtype(a.dtype, "a"), name="b_bias")
    if workspace.dtype != torch.int32 or workspace.dim() != 1:
        raise TypeError(f"{op}: workspace must be a 1-D int32 tensor (zeroed lock counters, see make_workspace), "
                        f"got {workspace.dtype} of shape {tuple(workspace.shape)}")
    return weight


def _require_flags(op: str, **flags) -> None:
    for name, value in flags.items():
        if type(value) is not bool:
            raise TypeError(f"{op}: {name} must be a bool, got {type(value).__name__}")


def _gemm_fake(op: str):
    def fake(a, c, b_q_weight, b_bias, b_scales, a_scales, global_scale, b_zeros, g_idx, perm, workspace, b_q_type,
             size_m, size_n, size_k, is_k_full, use_atomic_add, use_fp32_reduce, is_zp_float, *,
             deterministic=False, batch_invariant=False):
        if c is not None:
            raise ValueError(_c_given(op))
        check_gemm(op, a, c, b_q_weight, b_bias, b_scales, a_scales, global_scale, b_zeros, g_idx, perm, workspace,
                   b_q_type, size_m, size_n, size_k, is_k_full, use_atomic_add, use_fp32_reduce, is_zp_float,
                   deterministic=deterministic, batch_invariant=batch_invariant)
        return a.new_empty((size_m, _static(size_n, "size_n")))

    return fake


def _gemm_out_fake(op: str):
    def fake(a, c, *rest, **flags):
        refuse_grad(f"{op}_out", {"a": a, "c": c})
        check_gemm(op, a, c, *rest, **flags)

    return fake


def _c_given(op: str) -> str:
    return (f"{op}: c is given, but torch.ops.workbench.{op} returns a new tensor and declares no write into its "
            f"arguments; call torch.ops.workbench.{op}_out (which declares that it writes c) or the Python "
            f"function workbench.torch.{op}, which routes a given c there")


class _GemmPlan:
    """A dense GEMM call whose every check passed: the runtime's prepared launch for it and what a call needs
    besides the addresses (kept under the key of the call's shapes, strides, dtypes, devices and flags)."""

    __slots__ = ("prepared", "device", "index", "sms", "uses_c_tmp", "act_order", "has_zeros", "has_bias",
                 "c_tmp_default")

    def __init__(self, prepared, device: torch.device, sms: int, uses_c_tmp: bool, act_order: bool, has_zeros: bool,
                 has_bias: bool):
        self.prepared, self.device, self.index, self.sms = prepared, device, device.index, sms
        self.uses_c_tmp, self.act_order, self.has_zeros, self.has_bias = uses_c_tmp, act_order, has_zeros, has_bias
        self.c_tmp_default = 0  # address of the default stream's partial-sum buffer (_c_tmp keeps it)


_GEMM_PLANS: dict[tuple, _GemmPlan] = {}
MAX_GEMM_PLANS = 4096  # a serving loop sees a few dozen shapes; the bound keeps a sweep finite
_TENSOR = torch.Tensor
_FLAG_TYPES = (bool, int)  # flags the key holds as bool(flag), as the plan is made with them


def _meta(x):
    """What the checks read of an optional tensor (an empty one is vLLM's "none", kept apart by its shape)."""
    if x is None:
        return None
    return x.shape, x.stride(), x.dtype, x.get_device()


def _gemm_key(a, c, b_q_weight, b_scales, b_zeros, g_idx, perm, workspace, b_q_type, size_m, size_n, size_k,
              is_k_full, use_atomic_add, use_fp32_reduce, b_bias=None, global_scale=None, deterministic=False,
              batch_invariant=False):
    """The plan key, or None where an argument is not of the cached kind (then every check runs). Exact types for
    the ints: True and 1.0 compare equal to 1 but are checked differently."""
    if (type(size_m) is not int or type(size_n) is not int or type(size_k) is not int or type(b_q_type) is not int
            or type(a) is not _TENSOR or type(b_q_weight) is not _TENSOR or type(b_scales) is not _TENSOR
            or type(workspace) is not _TENSOR or type(is_k_full) not in _FLAG_TYPES
            or type(use_atomic_add) not in _FLAG_TYPES or type(use_fp32_reduce) not in _FLAG_TYPES
            or type(deterministic) is not bool or type(batch_invariant) is not bool):
        return None
    return (a.shape, a.stride(), a.dtype, a.get_device(), b_q_weight.shape, b_q_weight.stride(), b_q_weight.dtype,
            b_q_weight.get_device(), b_scales.shape, b_scales.stride(), b_scales.dtype, b_scales.get_device(),
            workspace.shape, workspace.stride(), workspace.dtype, workspace.get_device(), _meta(c), _meta(b_zeros), _meta(g_idx),
            _meta(perm), _meta(b_bias), b_q_type, size_m, size_n, size_k, bool(is_k_full), bool(use_atomic_add),
            bool(use_fp32_reduce), _meta(global_scale), deterministic, batch_invariant)


def _plan_gemm(op: str, key, a, c, b_q_weight, b_bias, b_scales, a_scales, global_scale, b_zeros, g_idx, perm,
               workspace, b_q_type, size_m, size_n, size_k, is_k_full, use_atomic_add, use_fp32_reduce,
               is_zp_float, deterministic=False, batch_invariant=False) -> _GemmPlan | None:
    """Every check (this surface's, then the runtime's own on views of the tensors), then the prepared launch
    from ``gemm.plan_marlin_gemm``; None for size_m = 0 (nothing to launch)."""
    from workbench import cuda as rt
    from workbench import gemm
    from workbench.weight import MarlinWeight

    weight = check_gemm(op, a, c, b_q_weight, b_bias, b_scales, a_scales, global_scale, b_zeros, g_idx, perm,
                        workspace, b_q_type, size_m, size_n, size_k, is_k_full, use_atomic_add, use_fp32_reduce,
                        is_zp_float, deterministic=deterministic, batch_invariant=batch_invariant)
    if size_m == 0:
        return None
    device = a.device
    act_order = not (T.is_empty(g_idx) and T.is_empty(perm))
    zeros = None if T.is_empty(b_zeros) else b_zeros
    bias = {"bias": rt.as_device_array(b_bias, "b_bias")} if not T.is_empty(b_bias) else {}
    sms = _sms(device)
    uses_c_tmp = bool(use_fp32_reduce) and not use_atomic_add
    stream = _stream_ptr(device)
    out = c if c is not None else torch.empty((size_m, size_n), dtype=a.dtype, device=device)
    c_tmp = _c_tmp(device, stream, sms) if uses_c_tmp else None
    a_tmp = torch.empty((size_m, size_k), dtype=a.dtype, device=device) if act_order else None
    v = (lambda x, name: rt.as_device_array(x, name))
    if b_scales.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu):  # scale bytes: the runtime reads them as uint8
        b_scales = b_scales.view(torch.uint8)
    layer = MarlinWeight(v(b_q_weight, "b_q_weight"), v(b_scales, "b_scales"), v(zeros, "b_zeros"),
                         v(g_idx, "g_idx") if act_order else None, v(perm, "perm") if act_order else None,
                         int(size_k), int(size_n), -1, weight, T.numpy_dtype(a.dtype, "a"), bool(is_k_full))
    prepared = gemm.plan_marlin_gemm(v(a, "a"), layer, c=v(out, "c"), workspace=v(workspace, "workspace"),
                                     c_tmp=v(c_tmp, "c_tmp"), a_tmp=v(a_tmp, "a_tmp"), is_k_full=bool(is_k_full),
                                     use_atomic_add=bool(use_atomic_add), use_fp32_reduce=bool(use_fp32_reduce),
                                     stream=stream, sms=sms, global_scale=v(global_scale, "global_scale"),
                                     deterministic=deterministic, batch_invariant=batch_invariant, **bias)
    plan = _GemmPlan(prepared, device, sms, uses_c_tmp, act_order, zeros is not None, bool(bias))
    if key is not None:
        if len(_GEMM_PLANS) >= MAX_GEMM_PLANS:
            _GEMM_PLANS.clear()
        _GEMM_PLANS[key] = plan
    return plan


def _gemm_run(op: str, a, c, b_q_weight, b_bias, b_scales, a_scales, global_scale, b_zeros, g_idx, perm, workspace,
              b_q_type, size_m, size_n, size_k, is_k_full, use_atomic_add, use_fp32_reduce, is_zp_float, *,
              deterministic=False, batch_invariant=False):
    """The call's plan (every check on the first call with its shapes, strides, dtypes, devices and flags; the
    unimplemented arguments every call), output and scratch from torch's allocator, then the runtime's prepared
    launch on the tensors' addresses and the current torch stream. Repeated calls re-check only what can change
    under an equal key: the addresses (non-null, 16-byte aligned: ``PreparedLaunch.launch``)."""
    if a_scales is not None or is_zp_float:
        T.require_unimplemented_absent(op, a_scales=a_scales, is_zp_float=is_zp_float)
    key = _gemm_key(a, c, b_q_weight, b_scales, b_zeros, g_idx, perm, workspace, b_q_type, size_m, size_n, size_k,
                    is_k_full, use_atomic_add, use_fp32_reduce, b_bias, global_scale, deterministic, batch_invariant)
    plan = _GEMM_PLANS.get(key) if key is not None else None
    if plan is None:
        plan = _plan_gemm(op, key, a, c, b_q_weight, b_bias, b_scales, a_scales, global_scale, b_zeros, g_idx,
                          perm, workspace, b_q_type, size_m, size_n, size_k, is_k_full, use_atomic_add,
                          use_fp32_reduce, is_zp_float, deterministic, batch_invariant)
        if plan is None:  # size_m = 0
            return c if c is not None else torch.empty((0, size_n), dtype=a.dtype, device=a.device)
    stream = torch._C._cuda_getCurrentRawStream(plan.index)  # (torch.cuda.current_stream builds a Stream object)
    if c is None:
        c = torch.empty((size_m, size_n), dtype=a.dtype, device=plan.device)
    c_tmp, scratch = 0, None
    if plan.uses_c_tmp:
        if stream == DEFAULT_STREAM:
            c_tmp = plan.c_tmp_default
            if not c_tmp:
                c_tmp = plan.c_tmp_default = _c_tmp(plan.device, stream, plan.sms).data_ptr()
        else:
            scratch = _c_tmp(plan.device, stream, plan.sms)  # (held until the launch is enqueued)
            c_tmp = scratch.data_ptr()
    if plan.act_order:
        a_tmp = torch.empty((size_m, size_k), dtype=a.dtype, device=plan.device)
        a_tmp_ptr, g_ptr, p_ptr = a_tmp.data_ptr(), g_idx.data_ptr(), perm.data_ptr()
    else:
        a_tmp_ptr = g_ptr = p_ptr = 0
    plan.prepared.launch(a.data_ptr(), b_q_weight.data_ptr(), c.data_ptr(), c_tmp, b_scales.data_ptr(),
                         b_zeros.data_ptr() if plan.has_zeros else 0, g_ptr, p_ptr, a_tmp_ptr, workspace.data_ptr(),
                         stream, global_scale=global_scale.data_ptr() if plan.prepared.has_global_scale else 0,
                         **({"bias": b_bias.data_ptr()} if plan.has_bias else {}))
    return c


def _gemm_kernels(op: str):
    def functional(a, c, *rest, **flags):
        if c is not None:
            raise ValueError(_c_given(op))
        return _gemm_run(op, a, None, *rest, **flags)

    def out(a, c, *rest, **flags):
        refuse_grad(f"{op}_out", {"a": a, "c": c})
        _gemm_run(op, a, c, *rest, **flags)

    return functional, out


def _define_gemm(op: str):
    functional, out = _gemm_kernels(op)
    f = define(op, GEMM_SCHEMA, fake=_gemm_fake(op), cpu=functional, cuda=functional)
    o = define(f"{op}_out", GEMM_OUT_SCHEMA, fake=_gemm_out_fake(op), cpu=out, cuda=out, mutates=True)
    return bypass(f, functional), bypass(o, out)


_marlin_gemm, _marlin_gemm_out = _define_gemm("marlin_gemm")
marlin_gemm_functional = _marlin_gemm  # the functional op with every argument given (modules' per-call path)
_gptq_marlin_gemm, _gptq_marlin_gemm_out = _define_gemm("gptq_marlin_gemm")


def marlin_gemm(a, c, b_q_weight, b_bias, b_scales, a_scales, global_scale, b_zeros, g_idx, perm, workspace,
                b_q_type, size_m, size_n, size_k, is_k_full: bool = True, use_atomic_add: bool = False,
                use_fp32_reduce: bool = False, is_zp_float: bool = False, *, deterministic: bool = False,
                batch_invariant: bool = False) -> torch.Tensor:
    """vLLM's ``marlin_gemm``: C (size_m, size_n) = a @ dequant(b_q_weight) (+ ``b_bias``). ``b_q_type``: a vLLM
    scalar-type id, vLLM's ScalarType, or ours (``workbench.scalar_types.ScalarType`` or its label). ``c`` given:
    written and returned. ``b_zeros``/``g_idx``/``perm`` may be None or empty; ``workspace`` from
    ``make_workspace``. size_k / size_n are the true sizes (the arrays are padded to whole tiles: docs/formats.md).
    Keyword-only, workbench's own: ``deterministic`` (bitwise the same output run to run; no atomics) and
    ``batch_invariant`` (row r's bits independent of M and the other rows), as ``workbench.gemm.gptq_marlin_gemm``
    defines them."""
    return _call_gemm(_marlin_gemm, _marlin_gemm_out, a, c, b_q_weight, b_bias, b_scales, a_scales, global_scale,
                      b_zeros, g_idx, perm, workspace, as_type_id(b_q_type), size_m, size_n, size_k, is_k_full,
                      use_atomic_add, use_fp32_reduce, is_zp_float, **_flags(deterministic, batch_invariant))


def gptq_marlin_gemm(a, c, b_q_weight, b_bias, b_scales, a_scales, global_scale, b_zeros, g_idx, perm, workspace,
                     b_q_type, size_m, size_n, size_k, is_k_full: bool = True, use_atomic_add: bool = False,
                     use_fp32_reduce: bool = False, is_zp_float: bool = False, *, deterministic: bool = False,
                     batch_invariant: bool = False) -> torch.Tensor:
    """``marlin_gemm`` under vLLM's earlier name (the name it has at the pinned commit); same arguments."""
    return _call_gemm(_gptq_marlin_gemm, _gptq_marlin_gemm_out, a, c, b_q_weight, b_bias, b_scales, a_scales,
                      global_scale, b_zeros, g_idx, perm, workspace, as_type_id(b_q_type), size_m, size_n, size_k,
                      is_k_full, use_atomic_add, use_fp32_reduce, is_zp_float,
                      **_flags(deterministic, batch_invariant, "gptq_marlin_gemm"))


def _flags(deterministic, batch_invariant, op: str = "marlin_gemm") -> dict:
    """The keyword-only modes a call sets (none when both are off: the schema's defaults). Checked here: the eager
    bypass hands them to the kernel as given, where the dispatcher would have converted them to bool."""
    _require_flags(op, deterministic=deterministic, batch_invariant=batch_invariant)
    flags = {}
    if deterministic is not False:
        flags["deterministic"] = deterministic
    if batch_invariant is not False:
        flags["batch_invariant"] = batch_invariant
    return flags


def _call_gemm(functional, out, a, c, *rest, **flags):
    """A given c goes to the _out op (which declares the write) and is returned; else the functional op."""
    if c is None:
        return functional(a, None, *rest, **flags)
    out(a, c, *rest, **flags)
    return c


# ---------------------------------------------------------------------------------------------------------------
# fused MoE GEMM: moe_wna16_marlin_gemm
# ---------------------------------------------------------------------------------------------------------------
MOE_ARGS = ("Tensor b_q_weight, Tensor? b_bias, Tensor b_scales, Tensor? a_scales, Tensor? global_scale, "
            "Tensor? b_zeros, Tensor? g_idx, Tensor? perm, Tensor workspace, Tensor sorted_token_ids, "
            "Tensor expert_ids, Tensor num_tokens_past_padded, Tensor topk_weights, int moe_block_size, int top_k, "
            "bool mul_topk_weights, int b_q_type, SymInt size_m, SymInt size_n, SymInt size_k, bool is_k_full, "
            "bool use_atomic_add, bool use_fp32_reduce, bool is_zp_float, int thread_k=-1, int thread_n=-1, "
            "int blocks_per_sm=-1, *, bool batch_invariant=False")  # (the last: workbench-only, keyword-only)
MOE_SCHEMA = f"(Tensor a, Tensor? c, {MOE_ARGS}) -> Tensor"
MOE_OUT_SCHEMA = f"(Tensor a, Tensor(a!) c, {MOE_ARGS}) -> ()"
MOE_OP = "moe_wna16_marlin_gemm"


def check_moe_gemm(a, c, b_q_weight, b_bias, b_scales, a_scales, global_scale, b_zeros, g_idx, perm, workspace,
                   sorted_token_ids, expert_ids, num_tokens_past_padded, topk_weights, moe_block_size, top_k,
                   mul_topk_weights, b_q_type, size_m, size_n, size_k, is_k_full, use_atomic_add, use_fp32_reduce,
                   is_zp_float, thread_k, thread_n, blocks_per_sm, *, batch_invariant=False):
    """Every rule of a fused MoE GEMM call that reads no values; returns (weight type, experts, group size). One
    expert's weight, scales and zero points are checked by the dense GEMM's rules (``check_gemm``), the stacks'
    leading extents and the routing tensors here."""
    op = MOE_OP
    T.require_cuda(op, "a", a)
    T.require_same_device(op, "a", a, c=c, sorted_token_ids=sorted_token_ids, expert_ids=expert_ids,
                          num_tokens_past_padded=num_tokens_past_padded, topk_weights=topk_weights,
                          global_scale=global_scale)
    # the fused kernel has no act-order (docs/torch.md)
    T.require_unimplemented_absent(op, g_idx=g_idx, perm=perm)
    _require_flags(op, batch_invariant=batch_invariant)
    for name, x in (("b_q_weight", b_q_weight), ("b_scales", b_scales), ("b_zeros", b_zeros)):
        if not T.is_empty(x) and x.dim() != 3:
            raise ValueError(f"{op}: {name} must be a 3-D stack [E, ...] of expert tensors, got shape "
                             f"{tuple(x.shape)}")
    experts = b_q_weight.shape[0]
    for name, x in (("b_scales", b_scales), ("b_zeros", b_zeros)):
        if not T.is_empty(x) and x.shape[0] != experts:
            raise ValueError(f"{op}: {name} has {x.shape[0]} experts (shape {tuple(x.shape)}), b_q_weight has "
                             f"{experts}")
    if moe_block_size not in SUPPORTED_BLOCK_SIZES:
        raise ValueError(f"{op}: moe_block_size = {moe_block_size} is not one of {SUPPORTED_BLOCK_SIZES}")
    T.require_positive_ints(op, top_k=top_k)
    T.require_int32_vectors(op, " (moe_align_block_size's output)", sorted_token_ids=sorted_token_ids,
                            expert_ids=expert_ids, num_tokens_past_padded=num_tokens_past_padded)
    if mul_topk_weights and (topk_weights.dtype != torch.float32 or not topk_weights.is_contiguous()):
        raise TypeError(f"{op}: topk_weights must be a contiguous float32 tensor, got {topk_weights.dtype} "
                        f"with strides {topk_weights.stride()}")
    zeros = None if T.is_empty(b_zeros) else b_zeros[0]
    if not T.is_empty(b_bias) and (b_bias.dim() != 2 or b_bias.shape[0] != experts):
        raise ValueError(f"{op}: b_bias must be [E = {experts}, size_n] (one bias row per expert), got shape "
                         f"{tuple(b_bias.shape)}")
    bias0 = None if T.is_empty(b_bias) else b_bias[0]  # (one expert's row by the dense rules)
    scale0 = None
    if not T.is_empty(global_scale):  # NVFP4: one fp32 global scale per expert (vLLM's [E])
        if (global_scale.dtype != torch.float32 or tuple(global_scale.shape) not in ((experts,), (experts, 1))
                or not global_scale.is_contiguous()):
            raise ValueError(f"{op}: global_scale must be a contiguous float32 tensor with one value per expert, "
                             f"[E = {experts}] or [E, 1]; got {global_scale.dtype} of shape "
                             f"{tuple(global_scale.shape)}")
        scale0 = global_scale.reshape(-1)[:1]  # (one expert's, by the dense rules)
    weight = check_gemm(op, a, None, b_q_weight[0], bias0, b_scales[0], a_scales, scale0, zeros, None, None,
                        workspace, b_q_type, size_m, size_n, size_k, is_k_full, use_atomic_add, use_fp32_reduce,
                        is_zp_float)
    if c is not None:
        rows = size_m * top_k
        torch._check(c.shape[0] == rows, lambda: f"{op}: c has {c.shape[0]} rows, expected size_m * top_k = {rows}")
        if tuple(c.shape[1:]) != (size_n,) or c.dtype != a.dtype or not c.is_contiguous():
            raise ValueError(f"{op}: c must be a contiguous ({rows}, {size_n}) {a.dtype} tensor, got "
                             f"{c.dtype} of shape {tuple(c.shape)}")
    # (check_gemm accepted the group count: ceil(K / group) rows, the last group possibly partial)
    ng = b_scales.shape[1]
    return weight, experts, -1 if ng == 1 else group_size_of(_static(size_k, "size_k"), ng)


_STACKS: "collections.OrderedDict[tuple, Any]" = collections.OrderedDict()
MAX_STACKS = 256  # expert stacks kept (each holds DLPack views of its tensors, so they stay alive while cached)


def _expert_stack(a, b_q_weight, b_scales, b_zeros, global_scale, weight, experts, group_size, size_n, size_k,
                  is_k_full):
    """A ``moe.MarlinExpertStack`` over the tensors' memory, cached by address and layout (its fused-kernel plans
    and scratch are per stack), until the MoE stack takes torch tensors through ``workbench.cuda``. The stack reads
    the global scales' memory at each launch, so new values at the same address need no new stack."""
    from workbench import moe
    from workbench.weight import MarlinWeight

    key = tuple((x.data_ptr(), tuple(x.shape), x.dtype) if x is not None else None
                for x in (b_q_weight, b_scales, b_zeros, global_scale)) + (weight, a.dtype, is_k_full)
    stack = _STACKS.get(key)
    if stack is None:
        v = T.cupy_view
        if b_scales.element_size() == 1 and b_scales.dtype != torch.uint8:
            # (float8_e4m3fn / float8_e8m0fnu scale bytes: CuPy has no float8 dtype for DLPack; the stack reads
            # 1-byte scales as bytes and takes their format from the weight type and the global scale, as checked)
            b_scales = b_scales.view(torch.uint8)
        mw = MarlinWeight(v(b_q_weight), v(b_scales), v(b_zeros), None, None, int(size_k), int(size_n), group_size,
                          weight, T.numpy_dtype(a.dtype, "a"), bool(is_k_full), num_experts=int(experts))
        stack = moe.MarlinExpertStack(mw, global_scale=v(global_scale))
        if len(_STACKS) >= MAX_STACKS:
            _STACKS.popitem(last=False)
        _STACKS[key] = stack
    _STACKS.move_to_end(key)
    return stack


def _moe_run(a, c, b_q_weight, b_bias, b_scales, a_scales, global_scale, b_zeros, g_idx, perm, workspace,
             sorted_token_ids, expert_ids, num_tokens_past_padded, topk_weights, moe_block_size, top_k,
             mul_topk_weights, b_q_type, size_m, size_n, size_k, is_k_full, use_atomic_add, use_fp32_reduce,
             is_zp_float, thread_k, thread_n, blocks_per_sm, *, batch_invariant=False):
    """Checks, output from torch's allocator (zeroed: rows no block names, e.g. of experts on another device, read
    0), then ``MarlinExpertStack.gemm_phase_fused``. ``use_atomic_add``, ``use_fp32_reduce``, ``thread_k``,
    ``thread_n`` and ``blocks_per_sm`` are vLLM's tuning hints: the workbench kernel chooses its own.
    ``batch_invariant``: ``MarlinExpertStack.gemm_phase_fused``'s (one tile for every block size)."""
    weight, experts, group_size = check_moe_gemm(
        a, c, b_q_weight, b_bias, b_scales, a_scales, global_scale, b_zeros, g_idx, perm, workspace, sorted_token_ids,
        expert_ids, num_tokens_past_padded, topk_weights, moe_block_size, top_k, mul_topk_weights, b_q_type, size_m,
        size_n, size_k, is_k_full, use_atomic_add, use_fp32_reduce, is_zp_float, thread_k, thread_n, blocks_per_sm,
        batch_invariant=batch_invariant)
    if c is None:
        c = torch.zeros((size_m * top_k, size_n), dtype=a.dtype, device=a.device)
    if size_m == 0:
        return c
    stream = _stream_ptr(a.device)
    zeros = None if T.is_empty(b_zeros) else b_zeros
    v = T.cupy_view
    with torch.cuda.device(a.device), T.cupy_stream(stream):
        scale = None if T.is_empty(global_scale) else global_scale.reshape(-1)
        stack = _expert_stack(a, b_q_weight, b_scales, zeros, scale, weight, experts, group_size, size_n, size_k,
                              is_k_full)
        # vLLM sizes sorted_token_ids as numel + E * (block - 1), not always a multiple of the block; the kernel
        # reads only the first num_tokens_post_padded entries, a multiple of the block and never above that size.
        # expert_ids (ceil(size / block) entries in vLLM's sizing) is cut to one entry per whole block to match.
        whole_blocks = sorted_token_ids.shape[0] // int(moe_block_size)
        stack.gemm_phase_fused(v(a), v(sorted_token_ids[:whole_blocks * int(moe_block_size)]),
                               v(expert_ids[:whole_blocks]), v(num_tokens_past_padded),
                               v(c),
                               int(size_m), int(moe_block_size), int(top_k),
                               topk_weights=v(topk_weights) if mul_topk_weights else None, stream=stream,
                               batch_invariant=batch_invariant, bias=None if T.is_empty(b_bias) else v(b_bias))
    return c


def _moe_fake(a, c, b_q_weight, b_bias, b_scales, a_scales, global_scale, b_zeros, g_idx, perm, workspace,
              sorted_token_ids, expert_ids, num_tokens_past_padded, topk_weights, moe_block_size, top_k,
              mul_topk_weights, b_q_type, size_m, size_n, size_k, is_k_full, use_atomic_add, use_fp32_reduce,
              is_zp_float, thread_k, thread_n, blocks_per_sm, *, batch_invariant=False):
    if c is not None:
        raise ValueError(_c_given(MOE_OP))
    check_moe_gemm(a, c, b_q_weight, b_bias, b_scales, a_scales, global_scale, b_zeros, g_idx, perm, workspace,
                   sorted_token_ids, expert_ids, num_tokens_past_padded, topk_weights, moe_block_size, top_k,
                   mul_topk_weights, b_q_type, size_m, size_n, size_k, is_k_full, use_atomic_add, use_fp32_reduce,
                   is_zp_float, thread_k, thread_n, blocks_per_sm, batch_invariant=batch_invariant)
    return a.new_empty((size_m * top_k, _static(size_n, "size_n")))


def _moe_out_fake(a, c, *rest, **flags):
    refuse_grad(f"{MOE_OP}_out", {"a": a, "c": c})
    check_moe_gemm(a, c, *rest, **flags)


def _moe_functional(a, c, *rest, **flags):
    if c is not None:
        raise ValueError(_c_given(MOE_OP))
    return _moe_run(a, None, *rest, **flags)


def _moe_out(a, c, *rest, **flags):
    refuse_grad(f"{MOE_OP}_out", {"a": a, "c": c})
    _moe_run(a, c, *rest, **flags)


_moe_gemm = bypass(define(MOE_OP, MOE_SCHEMA, fake=_moe_fake, cpu=_moe_functional, cuda=_moe_functional),
                   _moe_functional)
_moe_gemm_out = bypass(define(f"{MOE_OP}_out", MOE_OUT_SCHEMA, fake=_moe_out_fake, cpu=_moe_out, cuda=_moe_out,
                              mutates=True), _moe_out)


def moe_wna16_marlin_gemm(a, c, b_q_weight, b_bias, b_scales, a_scales, global_scale, b_zeros, g_idx, perm,
                          workspace, sorted_token_ids, expert_ids, num_tokens_past_padded, topk_weights,
                          moe_block_size: int, top_k: int, mul_topk_weights: bool, b_q_type, size_m, size_n, size_k,
                          is_k_full: bool = True, use_atomic_add: bool = False, use_fp32_reduce: bool = False,
                          is_zp_float: bool = False, thread_k: int = -1, thread_n: int = -1,
                          blocks_per_sm: int = -1, *, batch_invariant: bool = False) -> torch.Tensor:
    """vLLM's ``moe_wna16_marlin_gemm``: ``c[id] = a[id // top_k] @ dequant(W[expert_ids[b]])`` (× topk_weights.flat[id]
    when ``mul_topk_weights``) for the ids of every block b; c is (size_m * top_k, size_n). Stacks lead with the
    expert axis: b_q_weight [E, K/16, N*16/pf], b_scales [E, ng, N], b_zeros [E, ng, N/pf] (K, N padded to whole
    tiles as the dense GEMM's, docs/formats.md). ``batch_invariant`` (keyword-only, workbench's own): one tile for
    every block size, so a row's bits do not depend on how many tokens were routed with it."""
    args = [b_q_weight, b_bias, b_scales, a_scales, global_scale, b_zeros, g_idx, perm, workspace, sorted_token_ids,
            expert_ids, num_tokens_past_padded, topk_weights, moe_block_size, top_k, mul_topk_weights,
            as_type_id(b_q_type), size_m, size_n, size_k, is_k_full, use_atomic_add, use_fp32_reduce, is_zp_float,
            thread_k, thread_n, blocks_per_sm]
    _require_flags(MOE_OP, batch_invariant=batch_invariant)  # (as _flags: the eager bypass does not convert)
    flags = {"batch_invariant": True} if batch_invariant else {}
    if c is None:
        return _moe_gemm(a, None, *args, **flags)
    _moe_gemm_out(a, c, *args, **flags)
    return c


# ---------------------------------------------------------------------------------------------------------------
# moe_align_block_size (vLLM's mutating form)
# ---------------------------------------------------------------------------------------------------------------
ALIGN_SCHEMA = ("(Tensor topk_ids, int num_experts, int block_size, Tensor(a!) sorted_token_ids, "
                "Tensor(b!) experts_ids, Tensor(c!) num_tokens_post_pad, Tensor? maybe_expert_map=None) -> ()")


def max_num_tokens_padded(numel, num_experts: int, block_size: int):
    """vLLM's size for sorted_token_ids: every expert may leave block_size - 1 slots of its last block empty."""
    return numel + num_experts * (block_size - 1)


def check_align(topk_ids, num_experts, block_size, sorted_token_ids, experts_ids, num_tokens_post_pad,
                maybe_expert_map) -> None:
    """Every rule of a moe_align_block_size call that reads no values."""
    op = "moe_align_block_size"
    T.require_same_device(op, "topk_ids", topk_ids, sorted_token_ids=sorted_token_ids, experts_ids=experts_ids,
                          num_tokens_post_pad=num_tokens_post_pad, maybe_expert_map=maybe_expert_map)
    if topk_ids.dim() != 2 or topk_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{op}: topk_ids must be a 2-D (M, top_k) int32 or int64 tensor, got {topk_ids.dtype} of "
                        f"shape {tuple(topk_ids.shape)}")
    T.require_positive_ints(op, num_experts=num_experts, block_size=block_size)
    T.require_int32_vectors(op, "", sorted_token_ids=sorted_token_ids, experts_ids=experts_ids,
                            num_tokens_post_pad=num_tokens_post_pad)
    need = max_num_tokens_padded(topk_ids.numel(), num_experts, block_size)
    torch._check(sorted_token_ids.shape[0] >= need, lambda: (
        f"{op}: sorted_token_ids has {sorted_token_ids.shape[0]} entries, fewer than max_num_tokens_padded = "
        f"topk_ids.numel() + num_experts * (block_size - 1) = {need}"))
    blocks = (need + block_size - 1) // block_size
    torch._check(experts_ids.shape[0] >= blocks, lambda: (
        f"{op}: experts_ids has {experts_ids.shape[0]} entries, fewer than ceil(max_num_tokens_padded / "
        f"block_size) = {blocks}"))
    require(num_tokens_post_pad.shape[0] >= 1, f"{op}: num_tokens_post_pad must have at least one entry")
    if maybe_expert_map is not None and (tuple(maybe_expert_map.shape) != (num_experts,)
                                         or maybe_expert_map.dtype != torch.int32):
        raise ValueError(f"{op}: maybe_expert_map must be an int32 ({num_experts},) tensor (global -> local expert "
                         f"id, -1 = elsewhere), got {maybe_expert_map.dtype} of shape "
                         f"{tuple(maybe_expert_map.shape)}")


def _fill_align(sorted_token_ids, experts_ids, num_tokens_post_pad, ref_sorted, ref_experts, ref_post, numel):
    """Copy an alignment (sorted ids, expert ids, count; any array type torch converts) into the caller's buffers:
    the reference's arrays are at least as long as vLLM's buffers need, and every slot past the used ones is a
    sentinel (``numel``) or expert 0."""
    n, b = sorted_token_ids.shape[0], experts_ids.shape[0]
    sorted_token_ids.fill_(numel)
    experts_ids.zero_()
    k = min(n, ref_sorted.shape[0])
    sorted_token_ids[:k].copy_(ref_sorted[:k])
    k = min(b, ref_experts.shape[0])
    experts_ids[:k].copy_(ref_experts[:k])
    num_tokens_post_pad[:1].copy_(ref_post[:1])


def _align_cpu(topk_ids, num_experts, block_size, sorted_token_ids, experts_ids, num_tokens_post_pad,
               maybe_expert_map=None):
    from workbench.formats import moe_align

    check_align(topk_ids, num_experts, block_size, sorted_token_ids, experts_ids, num_tokens_post_pad,
                maybe_expert_map)
    ref = moe_align.moe_align_block_size(T.to_numpy(topk_ids), block_size, num_experts,
                                         T.to_numpy(maybe_expert_map))
    _fill_align(sorted_token_ids, experts_ids, num_tokens_post_pad, *(T.from_numpy(r) for r in ref), topk_ids.numel())


def _align_cuda(topk_ids, num_experts, block_size, sorted_token_ids, experts_ids, num_tokens_post_pad,
                maybe_expert_map=None):
    from workbench import moe

    check_align(topk_ids, num_experts, block_size, sorted_token_ids, experts_ids, num_tokens_post_pad,
                maybe_expert_map)
    ids = topk_ids.to(torch.int32).contiguous()  # the CUDA kernel reads int32 (a copy only for int64 / strided ids)
    stream = _stream_ptr(topk_ids.device)
    v = T.cupy_view
    with torch.cuda.device(topk_ids.device), T.cupy_stream(stream):
        out = moe.moe_align_block_size(v(ids), block_size, num_experts, v(maybe_expert_map), stream=stream)
        out = [torch.from_dlpack(x) for x in out]
    _fill_align(sorted_token_ids, experts_ids, num_tokens_post_pad, *out, topk_ids.numel())


def _align_fake(topk_ids, num_experts, block_size, sorted_token_ids, experts_ids, num_tokens_post_pad,
                maybe_expert_map=None):
    check_align(topk_ids, num_experts, block_size, sorted_token_ids, experts_ids, num_tokens_post_pad,
                maybe_expert_map)


def _align_impl(topk_ids, *rest):
    return (_align_cuda if topk_ids.device.type == "cuda" else _align_cpu)(topk_ids, *rest)


_moe_align = bypass(define("moe_align_block_size", ALIGN_SCHEMA, fake=_align_fake, cpu=_align_cpu, cuda=_align_cuda,
                           mutates=True), _align_impl)


def moe_align_block_size(topk_ids, num_experts: int, block_size: int, sorted_token_ids, experts_ids,
                         num_tokens_post_pad, expert_map=None) -> None:
    """vLLM's ``moe_align_block_size``: group the routed (token, slot) entries by expert into blocks of block_size
    rows, writing the caller's buffers (``allocate_align_buffers`` makes them). Segment contents equal
    ``workbench.formats.moe_align.moe_align_block_size``'s; the order inside a segment is not specified."""
    _moe_align(topk_ids, num_experts, block_size, sorted_token_ids, experts_ids, num_tokens_post_pad, expert_map)


def allocate_align_buffers(topk_ids: torch.Tensor, num_experts: int, block_size: int):
    """(sorted_token_ids, experts_ids, num_tokens_post_pad) sized as vLLM sizes them, on topk_ids' device."""
    need = max_num_tokens_padded(topk_ids.numel(), num_experts, block_size)
    kw = {"dtype": torch.int32, "device": topk_ids.device}
    return (torch.empty(need, **kw), torch.empty((need + block_size - 1) // block_size, **kw),
            torch.empty(1, **kw))


# ---------------------------------------------------------------------------------------------------------------
# layout ops: repacks, scale permutation, zero points and their inverses (workbench.ops on either device)
# ---------------------------------------------------------------------------------------------------------------
def _marlin_words(size_k, size_n, bits):
    return (size_k // TILE, size_n * TILE // (32 // check_bits(bits)))


def _packed_along_n(rows, size_n, bits):
    return (rows, size_n // (32 // check_bits(bits)))


def _device_operand(name: str, x: torch.Tensor):
    """A CUDA tensor as the Numba kernels take it: an empty perm is no perm, and bfloat16 (which torch's
    ``__cuda_array_interface__`` does not export) travels as its uint16 bit patterns, the raw-bits dtype the layout
    ops take for 16-bit scales (they move values, never compute on them)."""
    if name == "perm" and x.numel() == 0:
        return None
    x = x.detach()  # torch's __cuda_array_interface__ refuses a tensor that autograd tracks
    return x.view(torch.uint16) if x.dtype == torch.bfloat16 else x


def _layout_op(name: str, schema: str, run, out_meta, tensors: tuple[str, ...]):
    """Register a layout op. ``run(xs, a, **backend)`` calls ``workbench.ops`` with the op's arguments ``a`` (a dict;
    the tensor arguments replaced by ``xs``: NumPy arrays on CPU, the tensors themselves on CUDA), ``out_meta(a)`` ->
    (shape, torch dtype) for the fake; ``tensors`` names the tensor arguments, the first deciding the device. An
    ``is_a_8bit`` argument (vLLM's layout for 8-bit activations) must be False: no workbench kernel takes it yet."""
    names = [p.split()[-1].split("=")[0] for p in schema[1:schema.index(")")].split(", ")]

    def split(args):
        a = dict(zip(names, args))
        xs = [a[t] for t in tensors]
        T.require_same_device(name, tensors[0], xs[0], **dict(zip(tensors[1:], xs[1:])))
        T.require_unimplemented_absent(name, is_a_8bit=bool(a.get("is_a_8bit", False)))
        for k in ("size_k", "size_n"):
            a[k] = _static(a[k], k)
        return xs, a

    def cpu(*args):
        xs, a = split(args)
        return T.from_numpy(run([T.to_numpy(x) for x in xs], a, backend="numpy"))

    def cuda(*args):
        xs, a = split(args)
        with torch.cuda.device(xs[0].device):
            result = run([_device_operand(t, x) for t, x in zip(tensors, xs)], a, backend="numba",
                         stream=_stream_ptr(xs[0].device))
            out = T.from_device_array(result, xs[0])
        if xs[0].dtype in (torch.float16, torch.bfloat16) and out.dtype in (torch.int16, torch.uint16):
            out = out.view(xs[0].dtype)  # the Numba kernels move 16-bit scales as their raw bits
        return out

    def fake(*args):
        xs, a = split(args)
        shape, dtype = out_meta(a)
        return xs[0].new_empty(shape, dtype=dtype)

    def impl(*args):
        return (cuda if args[0].device.type == "cuda" else cpu)(*args)

    return bypass(define(name, schema, fake=fake, cpu=cpu, cuda=cuda), impl)


_gptq_marlin_repack = _layout_op(
    "gptq_marlin_repack",
    "(Tensor b_q_weight, Tensor perm, SymInt size_k, SymInt size_n, int num_bits, bool is_a_8bit=False) -> Tensor",
    lambda xs, a, **kw: wb_ops.gptq_marlin_repack(xs[0], xs[1], a["size_k"], a["size_n"], a["num_bits"], **kw),
    lambda a: (_marlin_words(a["size_k"], a["size_n"], a["num_bits"]), torch.int32), ("b_q_weight", "perm"))
_awq_marlin_repack = _layout_op(
    "awq_marlin_repack",
    "(Tensor b_q_weight, SymInt size_k, SymInt size_n, int num_bits, bool is_a_8bit=False) -> Tensor",
    lambda xs, a, **kw: wb_ops.awq_marlin_repack(xs[0], a["size_k"], a["size_n"], a["num_bits"], **kw),
    lambda a: (_marlin_words(a["size_k"], a["size_n"], a["num_bits"]), torch.int32), ("b_q_weight",))
_marlin_permute_scales = _layout_op(
    "marlin_permute_scales",
    "(Tensor s, SymInt size_k, SymInt size_n, int group_size, bool is_a_8bit=False) -> Tensor",
    lambda xs, a, **kw: wb_ops.marlin_permute_scales(xs[0], a["size_k"], a["size_n"], a["group_size"], **kw),
    lambda a: (tuple(a["s"].shape), a["s"].dtype), ("s",))
_marlin_unpermute_scales = _layout_op(
    "marlin_unpermute_scales", "(Tensor s, SymInt size_k, SymInt size_n, int group_size) -> Tensor",
    lambda xs, a, **kw: wb_ops.marlin_unpermute_scales(xs[0], a["size_k"], a["size_n"], a["group_size"], **kw),
    lambda a: (tuple(a["s"].shape), a["s"].dtype), ("s",))
_marlin_zero_points = _layout_op(
    "marlin_zero_points", "(Tensor zp, SymInt size_k, SymInt size_n, int num_bits) -> Tensor",
    lambda xs, a, **kw: wb_ops.marlin_zero_points(xs[0], a["size_k"], a["size_n"], a["num_bits"], **kw),
    lambda a: (_packed_along_n(a["zp"].shape[0], a["size_n"], a["num_bits"]), torch.int32), ("zp",))
_awq_to_marlin_zero_points = _layout_op(
    "awq_to_marlin_zero_points", "(Tensor q_zp_packed, SymInt size_k, SymInt size_n, int num_bits) -> Tensor",
    lambda xs, a, **kw: wb_ops.awq_to_marlin_zero_points(xs[0], a["size_k"], a["size_n"], a["num_bits"], **kw),
    lambda a: (_packed_along_n(a["q_zp_packed"].shape[0], a["size_n"], a["num_bits"]), torch.int32),
    ("q_zp_packed",))
_marlin_to_gptq_qweight = _layout_op(
    "marlin_to_gptq_qweight",
    "(Tensor marlin_q, Tensor perm, SymInt size_k, SymInt size_n, int num_bits) -> Tensor",
    lambda xs, a, **kw: wb_ops.marlin_to_gptq_qweight(xs[0], xs[1], a["size_k"], a["size_n"], a["num_bits"], **kw),
    lambda a: ((a["size_k"] // (32 // check_bits(a["num_bits"])), a["size_n"]), torch.int32), ("marlin_q", "perm"))
_marlin_to_awq_qweight = _layout_op(
    "marlin_to_awq_qweight", "(Tensor marlin_q, SymInt size_k, SymInt size_n, int num_bits) -> Tensor",
    lambda xs, a, **kw: wb_ops.marlin_to_awq_qweight(xs[0], a["size_k"], a["size_n"], a["num_bits"], **kw),
    lambda a: (_packed_along_n(a["size_k"], a["size_n"], a["num_bits"]), torch.int32), ("marlin_q",))


def _empty_perm(b_q_weight):
    return torch.empty(0, dtype=torch.int32, device=b_q_weight.device)


def gptq_marlin_repack(b_q_weight, perm, size_k, size_n, num_bits: int, is_a_8bit: bool = False) -> torch.Tensor:
    """GPTQ qweight int32 [K/pf, N] -> Marlin int32 [K/16, N*16/pf]; ``perm`` (int32 [K], or None / empty: no
    act-order): Marlin row k takes checkpoint row perm[k]."""
    return _gptq_marlin_repack(b_q_weight, _empty_perm(b_q_weight) if perm is None else perm, size_k, size_n,
                               num_bits, is_a_8bit)


def awq_marlin_repack(b_q_weight, size_k, size_n, num_bits: int, is_a_8bit: bool = False) -> torch.Tensor:
    """AWQ qweight int32 [K, N/pf] (interleaved along N) -> Marlin int32 [K/16, N*16/pf]."""
    return _awq_marlin_repack(b_q_weight, size_k, size_n, num_bits, is_a_8bit)


def marlin_permute_scales(s, size_k, size_n, group_size: int, is_a_8bit: bool = False) -> torch.Tensor:
    """Scales [ng, N] -> Marlin order (vLLM's ``marlin_utils.marlin_permute_scales``)."""
    return _marlin_permute_scales(s, size_k, size_n, group_size, is_a_8bit)


def marlin_unpermute_scales(s, size_k, size_n, group_size: int) -> torch.Tensor:
    """Inverse of marlin_permute_scales."""
    return _marlin_unpermute_scales(s, size_k, size_n, group_size)


def marlin_zero_points(zp, size_k, size_n, num_bits: int) -> torch.Tensor:
    """Zero-point codes [ng, N] (integer dtype) -> Marlin zero points int32 [ng, N/pf]."""
    return _marlin_zero_points(zp, size_k, size_n, num_bits)


def awq_to_marlin_zero_points(q_zp_packed, size_k, size_n, num_bits: int) -> torch.Tensor:
    """AWQ qzeros int32 [ng, N/pf] -> Marlin zero points int32 [ng, N/pf]."""
    return _awq_to_marlin_zero_points(q_zp_packed, size_k, size_n, num_bits)


def marlin_to_gptq_qweight(marlin_q, perm, size_k, size_n, num_bits: int) -> torch.Tensor:
    """Inverse of gptq_marlin_repack (``perm`` None / empty: no act-order)."""
    return _marlin_to_gptq_qweight(marlin_q, _empty_perm(marlin_q) if perm is None else perm, size_k, size_n,
                                   num_bits)


def marlin_to_awq_qweight(marlin_q, size_k, size_n, num_bits: int) -> torch.Tensor:
    """Inverse of awq_marlin_repack."""
    return _marlin_to_awq_qweight(marlin_q, size_k, size_n, num_bits)
