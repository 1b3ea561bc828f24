"""``fused_moe``: an inference engine's MoE layer on two expert stacks (gate_up -> activation(gate, up) -> down ->
router-weighted sum over top_k; the activation SiLU(gate) * up or gpt-oss's clamped SwiGLU, workbench.moe.activation;
the stacks' own per-expert biases and NVFP4 global scales applied in the GEMMs' epilogues) along one of three paths,
and the per-layer plans that launch its five kernels straight through the driver once a first call passed every
check."""
from __future__ import annotations

import threading

import numpy as np

from workbench import cuda as rt
from workbench import gemm
from workbench.gemm import kernels as gemm_kernels
from workbench.cuda import launch as rt_launch
from workbench.moe import kernels
from workbench.moe.activation import activation_of
from workbench.moe.config import choose_block_size, default_policy
from workbench.moe.fused import fused_grid, launch_smem, zero_slot
from workbench.moe.kernels import (ALIGN_THREADS, PLAN_ARG_KINDS, activation_and_mul, activation_kernel, as_cupy,
                                   contiguous, ctype_name, for_caller, gather_rows, moe_align_block_size, moe_sum,
                                   new_array, on_gpu, pool_of, upload)
from workbench.moe.stack import MarlinExpertStack
from workbench.policy import MoePolicy

_default = default_policy
PATHS = ("fused", "batched", "dense_loop")


def _check_layer(hidden, w13: MarlinExpertStack, w2: MarlinExpertStack, topk_weights, topk_ids):
    if not isinstance(w13, MarlinExpertStack) or not isinstance(w2, MarlinExpertStack):
        raise TypeError("w13_stack and w2_stack must be MarlinExpertStack objects")
    if w13.num_experts != w2.num_experts:
        raise ValueError(f"w13 has {w13.num_experts} experts but w2 has {w2.num_experts}")
    if getattr(w13.weight, "gate_up", "") == "interleaved":
        raise ValueError("w13's gate_up rows interleave (gpt-oss's order, as loaded); the MoE reads gate | up halves: "
                         "de-interleave it once at load time (workbench.moe.gpt_oss.deinterleave_marlin_stack, and "
                         "deinterleave_gate_up for its bias)")
    if w13.n_per_expert != 2 * w2.k:
        raise ValueError(f"w13 n_per_expert = {w13.n_per_expert} must be 2 x w2's K = {w2.k} (gate and up)")
    if w2.n_per_expert != w13.k:
        raise ValueError(f"w2 n_per_expert = {w2.n_per_expert} must equal the hidden size w13 K = {w13.k}")
    if w2.k % gemm.A_CHUNK:  # (the SiLU output is (rows, K) contiguous and the down GEMM reads it in 16-byte chunks)
        raise ValueError(f"the intermediate size w2 K = {w2.k} must be a multiple of {gemm.A_CHUNK} in a fused layer "
                         f"(the down GEMM reads the SiLU output's rows in 16-byte chunks)")
    for name, x in (("hidden", hidden), ("topk_weights", topk_weights), ("topk_ids", topk_ids)):
        if not on_gpu(x):
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
              policy: MoePolicy | None = None, batch_invariant: bool = False, activation=None):
    """An MoE layer: ``out[t] = Σ_j w[t, j] · (act(gate, up)(hidden[t] @ W13[e] + b13[e]) @ W2[e] + b2[e])``,
    e = topk_ids[t, j], act = ``activation`` (workbench.moe.activation: None / "silu" = silu(gate) · up; "swigluoai"
    or ``Activation("swigluoai", alpha, limit)`` = gpt-oss's clamped SwiGLU), b13 / b2 the stacks' own bias rows
    (``MarlinExpertStack(..., bias=)``; none: 0), each stack in any of its formats (NVFP4 with its per-expert global
    scales, MXFP4, MXFP8 included: docs/formats.md, "MoE FP4").

    hidden [M, K] fp16/bf16, topk_weights [M, top_k] float32, topk_ids [M, top_k] int32: CuPy arrays, torch CUDA
    tensors. The output and every intermediate come from the pool of
    hidden's framework (torch's caching allocator for a torch ``hidden``, CuPy's pool otherwise: hidden wins when the
    inputs are mixed), and the output is returned in hidden's framework; ``stream`` None: the current stream of
    hidden's framework;
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
    call, pool blocks that later allocations may reuse. For graph capture prefer ``gemm_phase_fused`` with
    buffers you own; replaying a captured ``fused_moe`` after its buffers were released is not safe.

    ``policy``: how kernels are chosen and launched (workbench.policy.MoePolicy; None: the default).

    ``batch_invariant``: token t's output has the same bits whatever M, the other tokens and their routing are
    (every path: the fused one under ``policy.batch_invariant()``, one tile for every block size; the dense ones
    through the dense GEMM's batch-invariant mode). docs/performance.md, "Batch invariance".
    """
    if path not in PATHS:
        raise ValueError(f"path = {path!r} is not one of {PATHS}")
    activation = activation_of(activation)
    policy = policy or _default()
    if batch_invariant:
        policy = policy.batch_invariant()
    given, pool, nd = hidden, "cupy", rt.cupy_array_type()
    if type(hidden) is not nd or type(topk_weights) is not nd or type(topk_ids) is not nd or (
            expert_map is not None and type(expert_map) is not nd):  # (CuPy arrays: no conversion)
        pool = pool_of(hidden)
        if on_gpu(hidden) and stream is None:
            stream = rt.stream_handle(None, pool, rt.device_pointer(hidden, "hidden")[1])
        hidden, topk_weights, topk_ids, expert_map = (as_cupy(x) for x in (hidden, topk_weights, topk_ids,
                                                                           expert_map))
    key = None
    if path == "fused" and policy.layer_plans:
        key = _layer_key(hidden, w13_stack, w2_stack, topk_weights, topk_ids, block_size, expert_map, stream,
                         policy, pool, activation)
        plan = None if key is None else w13_stack._fused_plans.get(key)
        if plan is not None and plan.matches(w13_stack, w2_stack):
            out = plan.run(hidden, topk_weights, topk_ids, expert_map)
            return out if pool == "cupy" else for_caller(out, given)
    m, top_k = _check_layer(hidden, w13_stack, w2_stack, topk_weights, topk_ids)
    caller = rt.cupy_stream(rt.stream_handle(stream))
    if m == 0:
        return for_caller(new_array(pool, (0, w13_stack.k), hidden.dtype, w13_stack._device(), caller.ptr), given)
    with caller:
        if path == "fused":
            out = _fused_path(hidden, w13_stack, w2_stack, topk_weights, topk_ids, m, top_k, block_size,
                              expert_map, caller, policy, pool, activation)
            if key is not None and top_k >= 1 and topk_ids.flags["C_CONTIGUOUS"] and (
                    expert_map is None or expert_map.flags["C_CONTIGUOUS"]):  # else the checked path copies them
                # every check passed on these arguments: later calls with the same key launch from a plan
                num_global = w13_stack.num_experts if expert_map is None else int(expert_map.shape[0])
                block = block_size or choose_block_size(m, top_k, num_global)
                plans = w13_stack._fused_plans  # on the stack: its plans (and their buffers) go when it goes
                if len(plans) >= _MAX_PLANS_PER_STACK:
                    plans.clear()
                plans[key] = _LayerPlan(hidden, w13_stack, w2_stack, top_k, block, num_global, expert_map,
                                        caller.ptr, policy, pool, activation)
            return for_caller(out, given)
        return for_caller(_grouped_path(hidden, w13_stack, w2_stack, topk_weights, topk_ids, m, top_k, expert_map,
                                        caller, batched=(path == "batched"), policy=policy, pool=pool,
                                        batch_invariant=bool(batch_invariant), activation=activation), given)


def _device_copy(x, pool: str, device: int, stream_ptr: int):
    """A device array contiguous (copied from ``pool`` if not), a host one uploaded into ``pool`` (dtype kept)."""
    if on_gpu(x):
        return contiguous(x, pool, stream_ptr)
    return upload(pool, np.asarray(x), device, stream_ptr)


def _fused_path(hidden, w13, w2, topk_weights, topk_ids, m, top_k, block_size, expert_map, caller, policy, pool,
                activation=None):
    num_global = w13.num_experts if expert_map is None else int(expert_map.shape[0])
    block = block_size or choose_block_size(m, top_k, num_global)
    device, s = hidden.data.device_id, caller.ptr
    emap = None if expert_map is None else _device_copy(expert_map, pool, device, s)  # NumPy maps are uploaded
    sorted_ids, expert_ids, post = moe_align_block_size(contiguous(topk_ids, pool, s), block, num_global, emap,
                                                        stream=caller, pool=pool)
    g1 = new_array(pool, (m * top_k, w13.n_per_expert), hidden.dtype, device, s)
    w13.gemm_phase_fused(hidden, sorted_ids, expert_ids, post, g1, m, block, top_k, stream=caller, policy=policy)
    h = activation_and_mul(g1, activation, stream=caller, pool=pool)
    y = new_array(pool, (m * top_k, w2.n_per_expert), hidden.dtype, device, s, zero=True)  # non-local rows stay 0
    w2.gemm_phase_fused(h, sorted_ids, expert_ids, post, y, m * top_k, block, 1, topk_weights=topk_weights,
                        stream=caller, policy=policy)
    return moe_sum(y, top_k, stream=caller, pool=pool)


def _grouped_path(hidden, w13, w2, topk_weights, topk_ids, m, top_k, expert_map, caller, batched, policy, pool,
                  batch_invariant=False, activation=None):
    """Sort the (token, slot) entries by expert on the host, gather rows, one dense GEMM per expert."""
    cupy = rt.cupy()
    device, s = hidden.data.device_id, caller.ptr
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
        y = new_array(pool, (1, w2.n_per_expert), hidden.dtype, device, s)  # never read: every entry has row -1
    else:
        dispatches = []
        start = 0
        for e, c in zip(experts.tolist(), counts.tolist()):
            dispatches.append((e, start, start, c))
            start += c
        a = gather_rows(hidden, upload(pool, (order // top_k).astype(np.int32), device, s), stream=caller,
                        pool=pool)  # [rows, K]
        g1 = new_array(pool, (rows, w13.n_per_expert), hidden.dtype, device, s)
        y = new_array(pool, (rows, w2.n_per_expert), hidden.dtype, device, s)
        if batched:
            w13.gemm_phase_batched(a, dispatches, g1, stream=caller, policy=policy, pool=pool,
                                   batch_invariant=batch_invariant)
            h = activation_and_mul(g1, activation, stream=caller, pool=pool)
            w2.gemm_phase_batched(h, dispatches, y, stream=caller, policy=policy, pool=pool,
                                  batch_invariant=batch_invariant)
        else:
            h = new_array(pool, (rows, w13.n_per_expert // 2), hidden.dtype, device, s)
            scratch = {}  # (CuPy callers: marlin_gemm's own per-stream scratch, which comes from CuPy's pool)
            if pool == "torch":
                sms = gemm_kernels.device_properties(device)[1]
                ws, c_tmp = (as_cupy(x) for x in gemm.scratch_buffers(device, s, sms, pool))
                scratch = dict(workspace=ws, c_tmp=c_tmp)
            for stack, x, out in ((w13, a, g1), (w2, h, y)):
                a_tmp = None if not stack.weight.has_act_order else new_array(
                    pool, (max(counts.tolist()), stack.k), hidden.dtype, device, s)  # (one stream: reused)
                for e, r0, _, c in dispatches:
                    gemm.marlin_gemm(x[r0:r0 + c], stack.expert_views()[e], c=out[r0:r0 + c], stream=caller,
                                     a_tmp=None if a_tmp is None else a_tmp[:c], policy=policy.gemm,
                                     batch_invariant=batch_invariant, global_scale=stack.expert_global_scale(e),
                                     bias=None if stack.bias is None else stack.bias[e], **scratch)
                if stack is w13:
                    activation_and_mul(g1, activation, h, stream=caller)
    return moe_sum(y, top_k, weights=topk_weights, row_of=upload(pool, row_of, device, s), stream=caller,
                   pool=pool)


class _LayerPlan:
    """One fused_moe layer (stacks, shapes, dtypes, devices, top_k, block size, stream, expert-map layout) whose
    every check passed on a first call through the checked path. ``run`` re-checks what the key leaves out (the
    stacks' arrays and fields, hidden's alignment) and then launches align, gate_up, SiLU, down and the top-k sum
    through cuLaunchKernel on argument blocks made once, into intermediates kept per plan (the plan is per stream:
    stream order keeps one call's reads before the next call's writes). No device -> host synchronisation."""

    def __init__(self, hidden, w13: MarlinExpertStack, w2: MarlinExpertStack, top_k: int, block: int,
                 num_global: int, expert_map, stream_ptr: int, policy: MoePolicy, pool: str = "cupy",
                 activation=None):
        from workbench.formats.moe_align import aligned_capacity

        m, k = (int(s) for s in hidden.shape)
        act = gemm.act_scalar_type(hidden.dtype)
        self.device = device = w13._device()
        self.dtype = hidden.dtype
        self.m, self.k, self.top_k, self.stream = m, k, top_k, stream_ptr
        self.pool = pool  # the framework whose allocator holds the intermediates and outputs
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
        programmatic = gemm_kernels.programmatic_launches(device, policy.programmatic_launch)
        pinned = {}  # GEMM function -> the shared memory of its programmatic launch (launch_smem)
        # moe_align: one block of ALIGN_THREADS
        f = kernels.function_ptr("mwb::moe_align", device)
        launches.append((f, 1, ALIGN_THREADS, 0, rt.ArgBlock(PLAN_ARG_KINDS["moe_align"]),
                         ("ids", numel, num_global, block, "emap", "sorted", cap, "experts", "post")))
        for stack, a, c, weights, rows, tk, a_lda in ((w13, "hidden", "g1", 0, m, top_k, lda),
                                                      (w2, "h", "y", "weights", numel, 1, w2.k)):
            ng = int(stack.weight.scales.shape[1])
            group = gemm.check_groups(stack.weight.weight_type, stack.k, ng, False, True, "scales.size(1)",
                                      stack.microscale is not None)
            cfg, grid, n_blocks = fused_grid(stack, device, act, block, rows * tk, cap, group, policy)
            f = kernels.function_ptr(cfg.name_expression, device, cfg.smem_bytes)
            if programmatic:
                pinned[f] = launch_smem(cfg, device, policy)
            w = stack.weight
            launches.append((f, grid, 256, cfg.smem_bytes, rt.ArgBlock(PLAN_ARG_KINDS["marlin_moe"]),
                             (a, w.qweight.data.ptr, c, w.scales.data.ptr, zero_slot(stack),
                              "sorted", "experts", "post", weights,
                              0 if stack.bias is None else stack.bias.data.ptr, n_blocks, block, rows * tk, tk,
                              stack.n_per_expert, stack.k, a_lda, group, stack.num_experts)))
            if stack is w13:  # the activation between the GEMMs (SiLU-and-multiply or the clamped SwiGLU)
                name, extra = activation_kernel(activation_of(activation), hidden.dtype)
                f = kernels.function_ptr(name, device)
                half = n13 // 2
                kinds = PLAN_ARG_KINDS[name.split("<")[0].removeprefix("mwb::")]
                launches.append((f, min(65535, -(-(numel * half) // 256)), 256, 0,
                                 rt.ArgBlock(kinds), ("g1", "h", numel, half) + extra))
        f = kernels.function_ptr(f"mwb::moe_sum<{ctype_name(hidden.dtype)}>", device)
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
            self.buffers = {name: new_array(pool, s, d, device, stream_ptr) for name, (s, d) in shapes.items()}
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
        if self.pool != "cupy":  # (allocated in the launch stream's order)
            out = new_array(self.pool, (self.m, self.k), self.dtype, self.device, stream)
            bufs = self.buffers or {name: new_array(self.pool, s, d, self.device, stream)
                                    for name, (s, d) in self.shapes.items()}
        elif stream == cupy.cuda.get_current_stream().ptr:
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
    return ((w, w.qweight, w.scales, w.zeros, w.g_idx, w.perm, stack.bias, stack.global_scale),
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


def _layer_key(hidden, w13, w2, topk_weights, topk_ids, block_size, expert_map, stream, policy, pool="cupy",
               activation=None):
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
    key = (id(w2),) + keys + (type(block_size), block_size, emap, stream_ptr, policy.token, pool, activation)
    try:
        hash(key)
    except TypeError:  # an unhashable block_size: the checked path
        return None
    return key

