"""The public array API of the dense Marlin GEMM (vLLM names and argument order): ``gptq_marlin_gemm`` on raw
buffers, ``marlin_gemm`` / ``plan_marlin_gemm`` on a ``MarlinWeight``, ``upload_weight``, the shared scratch
buffers, and the numerics a caller compares against (``error_bound_factor``).

The first call of an input layout runs every check (workbench.gemm.checks, then the record's through
``prepare_launch``) and keeps an array plan; later calls with the same layout re-check devices and addresses only.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from workbench import cuda as rt
from workbench.cuda import arrays as rt_arrays
from workbench.gemm import checks
from workbench.gemm import kernels
from workbench.gemm.checks import _is_empty, check_gemm_shapes
from workbench.gemm.geometry import _package as _defaults  # (the package namespace: its _default_policy)
from workbench.gemm.geometry import c_tmp_numel, default_policy, workspace_numel
from workbench.gemm.launch import MAX_PLANS, PreparedLaunch, prepare_launch
from workbench.gemm_abi import MarlinMmBuffers, MarlinMmExecution, MarlinMmRequest
from workbench.policy import GemmPolicy
from workbench.scalar_types import ScalarType

_default = default_policy


# Unit roundoff of the activation types: rounding a value to fp16 / bf16 moves it by at most u |value|.
UNIT_ROUNDOFF = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}


def error_bound_factor(act_dtype, size_k: int, output_roundings: int = 1, weight_rounding: bool = True) -> float:
    """c such that |marlin_gemm(a, W) - a @ w_ref| <= c (|a| @ |w_ref|) elementwise, w_ref the reference dequantized
    weight (workbench.quantize.dequantize) in fp32 with exact products, S = |a| @ |w_ref| bounding every partial sum:
    * ``output_roundings`` x u: the output's rounding to the activation type (the in-C and atomic reductions round
      each contributing block's partial as well: one more per block);
    * u where ``weight_rounding``: w_ref rounds scale x (code - zero) to the activation type, a late-scaling kernel
      (KernelConfig.late_scale) does not (against the unrounded weight: False);
    * K 2^-22: fp32 tensor-core accumulation (Hopper aligns the products before adding, dropping low bits)."""
    u = UNIT_ROUNDOFF[np.dtype(act_dtype).name]
    return (output_roundings + int(weight_rounding)) * u + size_k * 2.0 ** -22



@dataclasses.dataclass(frozen=True)
class _ArrayPlan:
    """A gptq_marlin_gemm call whose every shape/dtype/flag check passed, kept under the key of those inputs."""

    prepared: PreparedLaunch
    device: int
    sms: int
    out_shape: tuple[int, int]
    out_dtype: Any
    uses_c_tmp: bool
    act_order: bool


_array_plans: dict[tuple, _ArrayPlan] = {}
def _meta(x, array_type):
    """(shape, strides, dtype) of an optional array of ``array_type``, None for None; _SLOW for anything else."""
    if x is None:
        return None
    if type(x) is not array_type:
        return _SLOW
    return x.shape, x.strides, x.dtype


_SLOW = object()
_FLAG_TYPES = (bool, int)


def _plan_key(a, b_q_weight, b_scales, b_zeros, g_idx, perm, workspace, b_q_type, size_m, size_n, size_k, is_k_full,
              use_atomic_add, use_fp32_reduce, c, c_tmp, a_tmp, deterministic, sms, policy, batch_invariant=False,
              global_scale=None, bias=None):
    """Everything the checks of gptq_marlin_gemm read except addresses and devices of the other arrays, and the
    policy that chose the plan, or None
    when an input is not of the cached kind (then every check runs). Exact types for the ints: 1.0, True and
    np.int64(1) compare equal to 1 but are checked differently."""
    nd = rt_arrays.cupy_array_type()
    if type(a) is not nd:
        if type(a) is not rt.DeviceArray:
            return None
        nd = rt.DeviceArray  # (views of another framework's arrays, every one of them: _through_views)
    if (type(b_q_weight) is not nd or type(b_scales) is not nd or type(workspace) is not nd
            or type(size_m) is not int or type(size_n) is not int or type(size_k) is not int or type(sms) is not int
            or type(is_k_full) not in _FLAG_TYPES or type(use_atomic_add) not in _FLAG_TYPES
            or type(use_fp32_reduce) not in _FLAG_TYPES or type(deterministic) not in _FLAG_TYPES
            or type(batch_invariant) not in _FLAG_TYPES
            or not isinstance(b_q_type, (str, ScalarType))):
        return None
    optional = (_meta(b_zeros, nd), _meta(g_idx, nd), _meta(perm, nd), _meta(c, nd), _meta(c_tmp, nd),
                _meta(a_tmp, nd), _meta(global_scale, nd), _meta(bias, nd))
    if _SLOW in optional:
        return None
    return (a.shape, a.strides, a.dtype, a.data.device_id, b_q_weight.shape, b_q_weight.strides, b_q_weight.dtype,
            b_scales.shape, b_scales.strides, b_scales.dtype, workspace.shape, workspace.dtype, optional, b_q_type,
            size_m, size_n, size_k, bool(is_k_full), bool(use_atomic_add), bool(use_fp32_reduce),
            bool(deterministic), bool(batch_invariant), sms, policy.token)


def _address_on(x, device: int, name: str) -> int:
    """Address of an optional CuPy array that must live on ``device``."""
    if x is None:
        return 0
    mem = x.data
    if mem.device_id != device:
        raise ValueError(f"{name} is on device {mem.device_id} but A is on device {device}")
    return mem.ptr


def gptq_marlin_gemm(a, b_q_weight, b_scales, b_zeros, g_idx, perm, workspace, b_q_type, size_m: int, size_n: int,
                     size_k: int, is_k_full: bool = True, use_atomic_add: bool = False, use_fp32_reduce: bool = True,
                     *, c=None, c_tmp=None, a_tmp=None, deterministic: bool = False, batch_invariant: bool = False,
                     stream=None, sms: int = -1, policy: GemmPolicy | None = None, family: str | None = None,
                     global_scale=None, bias=None):
    """vLLM's ``gptq_marlin_gemm`` (with the newer ``use_atomic_add``): C = A @ dequant(B) + bias, on CuPy arrays,
    PyTorch CUDA tensors or any ``__cuda_array_interface__`` arrays (Numba's).

    Shapes (docs/formats.md, "Shapes that are not tile multiples"): size_k and size_n are the true sizes (K a
    multiple of the weight's pack factor, any N); the weight's arrays are those of the weight zero-padded to
    ceil(K / 16) rows and ceil(N / 64) * 64 columns, with ceil(K / group) scale rows (the last group may be partial);
    C is (M, size_n). ``bias`` (size_n,) in the activation dtype, or None: vLLM's ``b_bias``, added to the fp32 sums
    in the kernel's epilogue before C's one rounding (no extra pass).

    ``b_zeros``/``g_idx``/``perm`` may be None or empty. ``c`` (M, N) is allocated when None, and so is ``a_tmp``
    for act-order; ``c_tmp`` None takes the per-(device, stream, SMs) buffer of ``scratch_buffers``. Pass ``c``,
    ``c_tmp``/``a_tmp`` and ``workspace`` to keep allocation out of the call (CUDA-graph capture).

    Every check runs on the first call with a given set of shapes, strides, dtypes, flags and device; repeated calls
    with the same ones (CuPy arrays) reuse that verdict and re-check only what can change under equal shapes: the
    device of every array and each address (non-null, 16-byte aligned).

    ``policy``: how the kernel, grid and launch are chosen (workbench.policy.GemmPolicy; None: the default).
    ``family``: "mma_sync" or "wgmma" forces that kernel family (workbench.gemm.hopper); None: the policy's
    ``kernel_families`` table, falling back to mma.sync where the wgmma family cannot run the problem.

    ``deterministic``: bitwise the same output run to run (atomic add refused). ``batch_invariant``: moreover row r
    of C has the same bits for every M, whatever the other rows hold, for every ``sms`` at least the partition's
    blocks per launch and on every stream: one tile and one K partition for every M (the policy's ``invariant_*``
    fields; docs/performance.md, "Batch invariance", says what is and is not guaranteed).

    Microscaled weights (``b_q_type`` fe2m1f, or fe4m3fn with E8M0 scales), as ``workbench.ops`` prepares them:
    ``b_scales`` uint8 scale bytes [K/G, N] (or torch's float8_e4m3fn / float8_e8m0fnu views), and
    * NVFP4: fe2m1f, group 16, S0E5M3 bytes (``nvfp4_marlin_scales``), ``global_scale`` one float32 on the device
      (``nvfp4_marlin_global_scale``: the per-tensor scale with the kernel's exponent correction); fp16 or bf16;
    * MXFP4 / MXFP8: fe2m1f / fe4m3fn, group 32, E8M0 codes (``mx_marlin_scales``), no global scale; bf16 only.

    Frameworks: ``stream=None`` is the current stream of A's framework (``torch.cuda.current_stream()`` for a torch
    tensor, CuPy's otherwise; a torch / CuPy / Numba stream object or a raw handle may be passed), and what the call
    allocates (``c``, ``a_tmp``, the default ``c_tmp``) comes from A's framework's pool: torch's caching allocator for
    torch tensors (``c`` is then a torch tensor), CuPy's pool otherwise. Mixed inputs: A's framework wins.
    """
    if policy is None:
        policy = _defaults["_default_policy"]
    if family is not None or policy.kernel_families:
        from workbench.gemm import hopper
        if family == "wgmma" and (batch_invariant or bias is not None):
            raise ValueError("the wgmma family has no " + ("batch-invariant mode" if batch_invariant else "bias epilogue")
                             + " yet (pass family=None or 'mma_sync')")
        if not batch_invariant and bias is None and hopper.routes_to_wgmma(
                a, b_q_weight, b_scales, g_idx, perm, b_q_type, size_m, size_n, size_k, policy, family):
            return hopper.wgmma_gemm(a, b_q_weight, b_scales, b_zeros, g_idx, perm, b_q_type, size_m, size_n, size_k,
                                     is_k_full, c=c, stream=stream, sms=sms, policy=policy)
    key = _plan_key(a, b_q_weight, b_scales, b_zeros, g_idx, perm, workspace, b_q_type, size_m, size_n, size_k,
                    is_k_full, use_atomic_add, use_fp32_reduce, c, c_tmp, a_tmp, deterministic, sms, policy,
                    batch_invariant, global_scale, bias)
    plan = _array_plans.get(key) if key is not None else None
    if plan is None:
        if type(a) is not rt_arrays.cupy_array_type() and not isinstance(a, rt.DeviceArray) and _on_device(a):
            return _through_views(a, b_q_weight, b_scales, b_zeros, g_idx, perm, workspace, b_q_type, size_m,
                                  size_n, size_k, is_k_full, use_atomic_add, use_fp32_reduce, c, c_tmp, a_tmp,
                                  deterministic, stream, sms, policy, batch_invariant, global_scale, bias)
        return _gptq_marlin_gemm_checked(key, a, b_q_weight, b_scales, b_zeros, g_idx, perm, workspace, b_q_type,
                                         size_m, size_n, size_k, is_k_full, use_atomic_add, use_fp32_reduce, c,
                                         c_tmp, a_tmp, deterministic, stream, sms, policy,
                                         batch_invariant=batch_invariant, global_scale=global_scale, bias=bias)
    device = plan.device
    pointers = (a.data.ptr, _address_on(b_q_weight, device, "b_q_weight"), _address_on(b_scales, device, "b_scales"),
                _address_on(b_zeros, device, "b_zeros") if plan.prepared.has_zero_points else 0,
                _address_on(g_idx, device, "g_idx") if plan.act_order else 0,
                _address_on(perm, device, "perm") if plan.act_order else 0,
                _address_on(workspace, device, "workspace"))
    stream_ptr = rt.stream_handle(stream)
    if c is None or (a_tmp is None and plan.act_order):
        cupy = rt_arrays.cupy()
        if cupy.cuda.runtime.getDevice() != device:
            with cupy.cuda.Device(device):
                c, a_tmp = _outputs(plan, c, a_tmp, cupy)
        else:
            c, a_tmp = _outputs(plan, c, a_tmp, cupy)
    if c_tmp is None and plan.uses_c_tmp:
        c_tmp = scratch_buffers(device, stream_ptr, plan.sms)[1]
    c_ptr = _address_on(c, device, "c")
    c_tmp_ptr = _address_on(c_tmp, device, "c_tmp") if plan.uses_c_tmp else 0
    a_tmp_ptr = _address_on(a_tmp, device, "a_tmp") if plan.act_order else 0
    gs_ptr = _address_on(global_scale, device, "global_scale") if plan.prepared.has_global_scale else 0
    plan.prepared.launch(pointers[0], pointers[1], c_ptr, c_tmp_ptr, pointers[2], pointers[3], pointers[4],
                         pointers[5], a_tmp_ptr, pointers[6], stream_ptr, gs_ptr, _address_on(bias, device, "bias"))
    return c


def _through_views(a, b_q_weight, b_scales, b_zeros, g_idx, perm, workspace, b_q_type, size_m, size_n, size_k,
                   is_k_full, use_atomic_add, use_fp32_reduce, c, c_tmp, a_tmp, deterministic, stream, sms, policy,
                   batch_invariant=False, global_scale=None, bias=None):
    """gptq_marlin_gemm on another framework's arrays: DeviceArray views of them (CuPy's attribute names) through
    the same checks and plan cache, outputs and scratch from A's framework's pool, that framework's stream."""
    framework = rt.framework_of(a)
    view = rt.as_device_array
    va = view(a, "A")
    views = [view(x, name) for x, name in ((b_q_weight, "b_q_weight"), (b_scales, "b_scales"), (b_zeros, "b_zeros"),
                                           (g_idx, "g_idx"), (perm, "perm"), (workspace, "workspace"))]
    device = va.data.device_id
    stream_ptr = rt.stream_handle(stream, framework, device)
    sizes_ok = all(type(v) is int for v in (size_m, size_n, size_k)) and size_m >= 0 and size_n > 0 and size_k > 0
    if c is None and sizes_ok and len(va.shape) == 2:  # (else the checks name the bad value)
        c = rt_arrays.empty(framework, (size_m, size_n), va.dtype, device)
    act_order = any(v is not None and v.size > 0 for v in views[3:5])  # (g_idx, perm: as check_gemm_shapes reads)
    if a_tmp is None and act_order and sizes_ok:
        a_tmp = rt_arrays.empty(framework, (max(size_m, 1), size_k), va.dtype, device)
    if c_tmp is None and use_fp32_reduce and not use_atomic_add and type(sms) is int:
        n_sms = kernels.device_properties(device)[1] if sms <= 0 else sms
        c_tmp = scratch_buffers(device, stream_ptr, n_sms, framework)[1]
    vc = view(c, "c")
    gptq_marlin_gemm(va, *views[:6], b_q_type, size_m, size_n, size_k, is_k_full, use_atomic_add, use_fp32_reduce,
                     c=vc, c_tmp=view(c_tmp, "c_tmp"), a_tmp=view(a_tmp, "a_tmp"), deterministic=deterministic,
                     batch_invariant=batch_invariant, stream=stream_ptr, sms=sms, policy=policy,
                     global_scale=view(global_scale, "global_scale"), bias=view(bias, "bias"))
    return c


def _outputs(plan: _ArrayPlan, c, a_tmp, cupy):
    if c is None:
        c = cupy.empty(plan.out_shape, dtype=plan.out_dtype)
    if a_tmp is None and plan.act_order:
        a_tmp = cupy.empty((max(plan.out_shape[0], 1), plan.prepared.k), dtype=plan.out_dtype)
    return c, a_tmp


def _gptq_marlin_gemm_checked(key, a, b_q_weight, b_scales, b_zeros, g_idx, perm, workspace, b_q_type, size_m,
                              size_n, size_k, is_k_full, use_atomic_add, use_fp32_reduce, c, c_tmp, a_tmp,
                              deterministic, stream, sms, policy, launch: bool = True, batch_invariant=False,
                              global_scale=None, bias=None):
    """Every check, in order, then the launch; the verdict is kept under ``key`` (None: not kept). With ``launch``
    False: the checks only, returning the plan (``plan_marlin_gemm``)."""
    checks.check_reduction(use_atomic_add, deterministic, batch_invariant)
    plan = check_gemm_shapes(a, b_q_weight, b_scales, b_zeros, g_idx, perm, b_q_type, size_m, size_n, size_k,
                             is_k_full, c, global_scale)
    checks.check_bias(bias, size_n, a.dtype)
    if isinstance(sms, bool) or not isinstance(sms, (int, np.integer)):
        raise TypeError(f"sms must be an int, got {type(sms).__name__}")
    a_ptr, device = rt.device_pointer(a, "A")
    device_sms = kernels.device_properties(device)[1]
    sms = device_sms if sms <= 0 else int(sms)
    stream_ptr = rt.stream_handle(stream)
    uses_c_tmp = bool(use_fp32_reduce) and not use_atomic_add
    cupy = rt_arrays.cupy()
    with cupy.cuda.Device(device):
        if c is None:
            c = cupy.empty((size_m, size_n), dtype=a.dtype)
        if c_tmp is None and uses_c_tmp:
            c_tmp = scratch_buffers(device, stream_ptr, sms)[1]
        if a_tmp is None and plan.has_act_order:
            a_tmp = cupy.empty((max(size_m, 1), size_k), dtype=a.dtype)
    checks.check_scratch(plan, workspace, c_tmp, a_tmp, sms, use_fp32_reduce, use_atomic_add)
    pointers = {}
    for name, x in (("b_q_weight", b_q_weight), ("b_scales", b_scales), ("c", c), ("workspace", workspace),
                    ("b_zeros", None if _is_empty(b_zeros) else b_zeros),
                    ("g_idx", g_idx if plan.has_act_order else None), ("perm", perm if plan.has_act_order else None),
                    ("c_tmp", c_tmp if uses_c_tmp else None), ("global_scale", global_scale),
                    ("a_tmp", a_tmp if plan.has_act_order else None), ("bias", bias)):
        if x is None:
            pointers[name] = 0
            continue
        ptr, dev = rt.device_pointer(x, name)
        if dev != device:
            raise ValueError(f"{name} is on device {dev} but A is on device {device}")
        pointers[name] = ptr
    if size_m == 0:
        if not launch:
            raise ValueError("size_m = 0: nothing to plan")
        return c
    request = MarlinMmRequest(
        weight_type=plan.weight, act_type=plan.act,
        buffers=MarlinMmBuffers(a=a_ptr, b=pointers["b_q_weight"], c=pointers["c"], c_tmp=pointers["c_tmp"],
                                b_scales=pointers["b_scales"], zero_points=pointers["b_zeros"],
                                group_index=pointers["g_idx"], permutation=pointers["perm"],
                                a_tmp=pointers["a_tmp"], workspace=pointers["workspace"],
                                global_scale=pointers["global_scale"]),
        problem=plan.problem, scale_type=plan.scale,
        execution=MarlinMmExecution(device=device, stream=stream_ptr, sms=sms,
                                    has_act_order=plan.has_act_order, is_k_full=plan.is_k_full,
                                    use_atomic_add=use_atomic_add, use_fp32_reduce=use_fp32_reduce,
                                    deterministic=deterministic, batch_invariant=bool(batch_invariant)),
    )
    record = request.into_launch()
    record.b_bias = pointers["bias"] or None  # (vLLM's b_bias field of the record; MarlinMmBuffers has none)
    prepared = prepare_launch(record, policy=policy)  # every record-level rule (check_launch) on this first call
    array_plan = _ArrayPlan(prepared, device, sms, (size_m, size_n), np.dtype(a.dtype), uses_c_tmp,
                            plan.has_act_order)
    if key is not None:
        if len(_array_plans) >= MAX_PLANS:
            _array_plans.clear()
        _array_plans[key] = array_plan
    if not launch:
        return array_plan
    ptr = record.pointer
    prepared.launch(ptr("a"), ptr("b"), ptr("c"), ptr("c_tmp"), ptr("b_scales"), ptr("zero_points"),
                    ptr("group_index"), ptr("permutation"), ptr("a_tmp"), ptr("workspace"), stream_ptr,
                    ptr("global_scale"), ptr("b_bias"))
    return c


# ---------------------------------------------------------------------------------------------------------------
# MarlinWeight convenience
# ---------------------------------------------------------------------------------------------------------------
def upload_weight(weight):
    """A copy of a ``MarlinWeight`` whose arrays live on the current CuPy device (a microscaled layer's
    ``global_scale`` too)."""
    cupy = rt_arrays.cupy()
    up = (lambda x: None if x is None else cupy.asarray(np.ascontiguousarray(x)))
    extra = {}
    if getattr(weight, "global_scale", None) is not None:
        extra["global_scale"] = up(weight.global_scale)
    return dataclasses.replace(weight, qweight=up(weight.qweight), scales=up(weight.scales), zeros=up(weight.zeros),
                               g_idx=up(weight.g_idx), perm=up(weight.perm), **extra)


_scratch: dict[tuple[int, int, int, str], tuple[Any, Any]] = {}


def scratch_buffers(device: int, stream_ptr: int, sms: int, framework: str = "cupy"):
    """(workspace, c_tmp) kept per (device, stream, sms, framework): launches on one stream run in order, so they can
    share the lock counters (left zero) and the partial-sum buffer; concurrent streams get their own. Allocated from
    ``framework``'s pool ("torch": PyTorch's caching allocator, so a graph a torch caller captures keeps memory
    that pool owns; else CuPy's)."""
    key = (device, stream_ptr, sms, framework)
    if key not in _scratch:
        _scratch[key] = (rt_arrays.empty(framework, workspace_numel(sms), np.int32, device, zero=True),
                         rt_arrays.empty(framework, c_tmp_numel(sms), np.float32, device))
    return _scratch[key]


def marlin_gemm(a, weight, *, c=None, is_k_full: bool | None = None, use_atomic_add: bool = False,
                use_fp32_reduce: bool = True, deterministic: bool = False, workspace=None, c_tmp=None, a_tmp=None,
                stream=None, sms: int = -1, policy: GemmPolicy | None = None, batch_invariant: bool = False,
                family: str | None = None, global_scale=None, bias=None):
    """C = a @ dequant(weight) (+ ``bias``, (weight.size_n,) in a's dtype, added before C's rounding) for a
    ``MarlinWeight`` on the GPU (see ``upload_weight``). a: (M, K) CuPy array or
    another framework's (see gptq_marlin_gemm: streams and allocations follow a's framework).

    Numerics: fp32 accumulation, one rounding to the activation type at the end. Most integer-weight kernels at
    M <= 16 (``KernelConfig.late_scale``; not act-order groups) apply the scales to fp32 partial sums, so the weight is
    never rounded to the activation type there: results may differ from a @ (the rounded dequantized weight) by one
    rounding more, towards the exact product. ``batch_invariant`` (see gptq_marlin_gemm) never late-scales.

    ``global_scale``: NVFP4's one float32 on the device (default: the weight's own, for a microscaled layer as
    ``workbench.load`` returns it)."""
    if getattr(weight, "num_experts", None) is not None:
        raise ValueError("weight is a stack of experts; pick one with weight.expert(e) (or run the stack through "
                         "workbench.moe.MarlinExpertStack)")
    nd = rt_arrays.cupy_array_type()
    for field in ("qweight", "scales"):
        x = getattr(weight, field)
        if type(x) is not nd and not _on_device(x):
            raise TypeError(f"weight.{field} is not on GPU; call workbench.gemm.upload_weight(weight) once first")
    if type(a) is nd:
        device, framework = a.data.device_id, "cupy"
    else:
        device, framework = rt.device_pointer(a, "A")[1], rt.framework_of(a)
    stream_ptr = rt.stream_handle(stream, framework, device)
    if workspace is None or (c_tmp is None and use_fp32_reduce and not use_atomic_add):
        n_sms = kernels.device_properties(device)[1] if sms <= 0 else sms
        ws, ct = scratch_buffers(device, stream_ptr, n_sms, framework)
        workspace = ws if workspace is None else workspace
        c_tmp = ct if c_tmp is None else c_tmp
    k_full = weight.is_k_full if is_k_full is None else is_k_full
    size_m = int(a.shape[0]) if len(a.shape) == 2 else -1
    if global_scale is None:  # a microscaled layer (workbench.load's MicroscaleMarlinWeight) carries NVFP4's
        global_scale = getattr(weight, "global_scale", None)
    return gptq_marlin_gemm(a, weight.qweight, weight.scales, weight.zeros, weight.g_idx, weight.perm, workspace,
                            weight.weight_type, size_m, weight.size_n, weight.size_k, is_k_full=k_full,
                            use_atomic_add=use_atomic_add, use_fp32_reduce=use_fp32_reduce, c=c, c_tmp=c_tmp,
                            a_tmp=a_tmp, deterministic=deterministic, batch_invariant=batch_invariant,
                            stream=stream_ptr, sms=sms, policy=policy, family=family, global_scale=global_scale,
                            bias=bias)


def _on_device(x) -> bool:
    try:
        rt.as_device_array(x, "x")
    except TypeError:
        return False
    return True


def plan_marlin_gemm(a, weight, *, c, workspace, c_tmp=None, a_tmp=None, is_k_full: bool | None = None,
                     use_atomic_add: bool = False, use_fp32_reduce: bool = True, deterministic: bool = False,
                     stream=None, sms: int = -1, policy: GemmPolicy | None = None,
                     batch_invariant: bool = False, global_scale=None, bias=None) -> PreparedLaunch:
    """Every check ``marlin_gemm`` makes on these arrays, without launching: the ``PreparedLaunch`` that runs the
    same problem on any addresses (``launch``). For callers that launch many GEMMs of one shape at row or expert
    offsets of buffers already checked once (``MoE.gemm_phase_batched``); M > 0. ``bias``: checked here as
    marlin_gemm checks it; its address (or another of the same shape) goes to ``launch(..., bias=address)``."""
    if getattr(weight, "num_experts", None) is not None:
        raise ValueError("weight is a stack of experts; pick one with weight.expert(e)")
    size_m = int(a.shape[0]) if len(a.shape) == 2 else -1
    k_full = weight.is_k_full if is_k_full is None else is_k_full
    return _gptq_marlin_gemm_checked(None, a, weight.qweight, weight.scales, weight.zeros, weight.g_idx, weight.perm,
                                     workspace, weight.weight_type, size_m, weight.size_n, weight.size_k, k_full,
                                     use_atomic_add, use_fp32_reduce, c, c_tmp, a_tmp, deterministic, stream, sms,
                                     policy or _default(), launch=False, batch_invariant=batch_invariant,
                                     global_scale=global_scale, bias=bias).prepared

