"""``MarlinExpertStack``: E experts' Marlin tiles for one matmul role in one buffer, run as one dense GEMM per
dispatch over a few streams (``gemm_phase_batched``), as one fused launch (``gemm_phase_fused``), or one expert's
column slice as a dense layer (``make_expert_linear``); and building stacks (``stack_marlin_weights``,
``random_expert_stack``)."""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from workbench import cuda as rt
from workbench import gemm
from workbench.gemm import kernels as gemm_kernels
from workbench.moe import fused
from workbench.moe import microscale as moe_microscale
from workbench.moe.config import default_policy
from workbench.moe.kernels import array_module, as_cupy, as_int, new_array, on_gpu, pool_of
from workbench.policy import MoePolicy
from workbench.weight import MarlinWeight

_default = default_policy
DEFAULT_STREAMS = 4  # concurrent dense GEMMs in the batched path: enough to fill the SMs when each is small


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


@dataclasses.dataclass
class ExpertLinear:
    """One expert's column slice of a stack as a dense Marlin layer: ``y = x @ W[:, offset : offset + n] + bias``.

    ``weight`` is a single-layer ``MarlinWeight`` holding contiguous copies of the slice (the dense GEMM reads
    contiguous tiles; a column slice of a Marlin buffer is strided), ``bias`` ([n], act dtype) is added in the dense
    GEMM's epilogue, in fp32 before its one rounding (gemm.marlin_gemm's ``bias=``).
    """

    weight: MarlinWeight
    bias: Any | None
    expert: int
    column_offset: int  # inside the expert

    def __call__(self, x, *, out=None, stream=None):
        return gemm.marlin_gemm(x, self.weight, c=out, stream=stream, bias=self.bias)


class MarlinExpertStack:
    """E experts' Marlin tiles for one matmul role (seed ``MarlinExpertStack``); arrays on the GPU for the GEMMs.

    ``weight``: a stacked ``MarlinWeight`` (``num_experts`` set; see ``ops.stack_gptq_experts_to_marlin`` and
    ``gemm.upload_weight``). Act-order stacks are not supported by the fused kernel (docs/formats.md, "MoE expert
    stacks": newer vLLM kernels
    dropped it); the batched path runs them through the dense GEMM. The arrays may be CuPy arrays or torch CUDA
    tensors (viewed as CuPy arrays once, here: ``weight`` holds the views).
    """

    def __init__(self, weight: MarlinWeight, *, num_streams: int = DEFAULT_STREAMS, sms: int = -1, global_scale=None,
                 bias=None):
        if not isinstance(weight, MarlinWeight):
            raise TypeError(f"weight must be a MarlinWeight, got {type(weight).__name__}")
        if weight.num_experts is None:
            raise ValueError("weight is a single layer; an expert stack needs num_experts (a leading expert axis)")
        e = weight.num_experts
        if tuple(weight.qweight.shape[:1]) != (e,) or tuple(weight.scales.shape[:1]) != (e,):
            raise ValueError(f"weight arrays do not lead with num_experts = {e}: qweight {tuple(weight.qweight.shape)}"
                             f", scales {tuple(weight.scales.shape)}")
        num_streams = as_int(num_streams, "num_streams")
        if num_streams < 1:
            raise ValueError(f"num_streams = {num_streams} must be >= 1")
        if any(type(getattr(weight, f)) is not rt.cupy_array_type() and on_gpu(getattr(weight, f))
               for f in ("qweight", "scales", "zeros", "g_idx", "perm")):
            weight = dataclasses.replace(weight, **{f: as_cupy(getattr(weight, f))
                                                    for f in ("qweight", "scales", "zeros", "g_idx", "perm")})
        self.weight = weight
        # The microscaled formats (docs/formats.md, "MoE FP4"): NVFP4 / MXFP4 / MXFP8 by the scales' dtype and group
        # (workbench.gemm.checks' MICROSCALE_RULES, the dense rules), NVFP4's per-expert fp32 global scales ([E] or
        # [E, 1]: the weight's own where it carries them, workbench.load's MicroscaleMarlinWeight) and the stack's
        # per-expert bias rows ([E, n_per_expert], act dtype: gpt-oss's experts carry them), checked here once.
        if global_scale is None:
            global_scale = getattr(weight, "global_scale", None)
        self.microscale, self.global_scale = moe_microscale.check_stack(weight, as_cupy(global_scale))
        if bias is not None:
            bias = as_cupy(bias)
            if not on_gpu(bias):
                raise TypeError("bias is not on GPU (upload it with the stack's arrays)")
            gemm.check_bias(bias, weight.size_n, np.dtype(weight.act_dtype), "bias", (e,))
        self.bias = bias
        self._dense_global_scales = None  # expert_global_scale's aligned copy, made on first use
        self.num_streams = num_streams
        self._sms = as_int(sms, "sms")
        self._scratch: dict[tuple[int, str], tuple[Any, Any, list, int]] = {}  # (device, pool) -> _scratch_for
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

    def expert_global_scale(self, e: int):
        """NVFP4: expert e's global scale as the dense GEMM takes one (a [1] float32 view, 16-byte aligned: the dense
        kernel reads it through its zero-point slot, whose address the launch checks for 16-byte alignment); None
        otherwise. The aligned copy ([E, 4] float32, value in column 0) is made once per stack, synchronously."""
        if self.global_scale is None:
            return None
        if self._dense_global_scales is None:
            cupy = rt.cupy()
            with cupy.cuda.Device(self._device()):
                padded = cupy.zeros((self.num_experts, 4), dtype=np.float32)
                padded[:, 0] = self.global_scale.reshape(-1)
                cupy.cuda.get_current_stream().synchronize()
            self._dense_global_scales = padded
        return self._dense_global_scales[e, :1]

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
        if not on_gpu(qweight):
            raise TypeError("the stack's arrays are not on GPU; build it from gemm.upload_weight(weight)")
        return rt.device_pointer(qweight, "weight.qweight")[1]

    def _scratch_for(self, device: int, pool: str = "cupy", stream_ptr: int | None = None):
        """(workspace [S·sms] int32 zero, c_tmp [S, c_tmp_numel] fp32, streams [S], sms), made once per device and
        pool (the framework whose allocator holds them: kernels.pool_of), on ``stream_ptr`` (None: CuPy's current)."""
        key = (device, pool)
        if key not in self._scratch:
            cupy = rt.cupy()
            sms = gemm_kernels.device_properties(device)[1] if self._sms <= 0 else self._sms
            if stream_ptr is None:
                stream_ptr = rt.stream_handle(None)
            ws = new_array(pool, self.num_streams * gemm.workspace_numel(sms), np.int32, device, stream_ptr,
                           zero=True)
            c_tmp = new_array(pool, (self.num_streams, gemm.c_tmp_numel(sms)), np.float32, device, stream_ptr)
            with cupy.cuda.Device(device):
                streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(self.num_streams)]
            self._scratch[key] = (ws, c_tmp, streams, sms)
        return self._scratch[key]

    def zero_workspace(self, *, stream=None) -> None:
        """Zero every lock counter once before a batch of launches (the kernels leave them zero; this recovers
        from an interrupted launch and is ferrum-kernels' once-per-batch call)."""
        device = self._device()
        stream_ptr = rt.stream_handle(stream)
        for (dev, _), (ws, *_) in list(self._scratch.items()) or [((device, "cupy"), self._scratch_for(device))]:
            if dev == device:
                rt.cupy().cuda.runtime.memsetAsync(ws.data.ptr, 0, ws.nbytes, stream_ptr)

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
                e, r_in, r_out, m = (as_int(v, f"dispatches[{i}][{j}]") for j, v in enumerate(d))
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
            if not on_gpu(x):
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
                           policy: MoePolicy | None = None, pool: str | None = None, batch_invariant: bool = False,
                           bias=None):
        """For each ``(e, in_off, out_off, m)``: ``output[out_off:out_off+m] = input[in_off:in_off+m] @ W[e]``
        (``+ bias[e]`` with ``bias`` [E, n_per_expert] in the act dtype, added in the dense GEMM's epilogue).

        input [R_in, K], output [R_out, n_per_expert] (act dtype, on the GPU). Dispatches go round-robin onto
        ``num_streams`` streams that first wait for the caller's stream; the caller's stream then waits for all.

        Every dense-GEMM check runs on the first dispatch of each row count m (on that dispatch's row, expert and
        scratch views); the others launch the same checked problem at their own addresses (row offset x row
        stride, expert x expert stride: every expert and every lane's scratch has the same shape), each address
        re-checked for alignment by ``PreparedLaunch.launch``. No views, records or allocations per dispatch.
        The dense GEMMs run under ``policy.gemm`` (workbench.policy.MoePolicy; None: the default). CuPy arrays or
        torch tensors; the scratch (lock counters, partial sums, act-order's permuted activations) comes from ``pool``
        (None: input's framework's); ``stream`` None: the current stream of input's framework. ``batch_invariant``:
        the dense GEMM's batch-invariant mode for every dispatch.
        """
        gemm_policy = (policy or _default()).gemm
        invariant = bool(batch_invariant)
        given, framework, nd = output, "cupy", rt.cupy_array_type()
        if type(input) is not nd or type(output) is not nd:
            framework = pool_of(input)
            input, output = as_cupy(input), as_cupy(output)
        pool = pool or framework
        self._check_io(input, output, "output")
        if bias is None:
            bias = self.bias  # (the stack's own bias rows: None unless given)
        if bias is not None:
            bias = as_cupy(bias)
            gemm.check_bias(bias, self.n_per_expert, self.act_dtype, "bias", (self.num_experts,))
        work = self.check_dispatches(input.shape, output.shape, dispatches)
        device = self._device()
        stream_ptr = rt.stream_handle(stream, framework, device)
        ws, c_tmp, streams, sms = self._scratch_for(device, pool, stream_ptr)
        if not work:
            return given
        cupy = rt.cupy()
        caller = rt.cupy_stream(stream_ptr)
        w = self.weight
        # (microscaled stacks through the per-dispatch views: marlin_gemm takes each expert's global scale)
        if w.has_act_order or type(input) is not nd or type(output) is not nd or type(w.qweight) is not nd or \
                self.microscale is not None:
            lanes = self._join_lanes(caller, streams, len(work), device, before=True)
            # act-order gathers each dispatch's rows into a_tmp: one buffer per lane (lanes run concurrently)
            a_tmp = None if not w.has_act_order else new_array(
                pool, (len(lanes), max(m for *_, m in work), self.k), input.dtype, device, stream_ptr)
            with cupy.cuda.Device(device):  # per-dispatch views through marlin_gemm: every check every time
                self._batched_through_views(input, work, output, ws, c_tmp, a_tmp, lanes, sms, gemm_policy,
                                            invariant, bias)
            self._join_lanes(caller, lanes, len(work), device, before=False)
            return given
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
        layout = (input.strides, output.strides, input.dtype, device, sms, gemm_policy.token, invariant, bias is None)
        b_base, b_step = (0, 0) if bias is None else (bias.data.ptr, bias.strides[0])
        for i, (e, r_in, r_out, m) in enumerate(work):
            lane = i % n_lanes
            prepared = plans.get((m,) + layout)
            if prepared is None:
                prepared = self._plan_dispatch(input, output, e, r_in, r_out, m, ws, c_tmp, lane, sms, lanes[lane],
                                               gemm_policy, invariant, None if bias is None else bias[e])
                if len(plans) >= 1024:  # one per row count and layout: bounded for a long-running server
                    plans.clear()
                plans[(m,) + layout] = prepared
            prepared.launch(in_base + r_in * in_row, qw_base + e * qw_step, out_base + r_out * out_row,
                            ct_base + lane * ct_step, sc_base + e * sc_step, zp_base and zp_base + e * zp_step,
                            0, 0, 0, ws_base + lane * ws_step, lane_ptrs[lane],
                            bias=b_base and b_base + e * b_step)
        self._join_lanes(caller, lanes, len(work), device, before=False)
        return given

    def _plan_dispatch(self, input, output, e, r_in, r_out, m, ws, c_tmp, lane, sms, lane_stream, gemm_policy,
                       batch_invariant=False, bias=None):
        """gemm.plan_marlin_gemm on this dispatch's views: every check of a dense call, no launch."""
        per_ws = gemm.workspace_numel(sms)
        return gemm.plan_marlin_gemm(input[r_in:r_in + m], self.expert_views()[e], c=output[r_out:r_out + m],
                                     workspace=ws[lane * per_ws:(lane + 1) * per_ws], c_tmp=c_tmp[lane],
                                     stream=lane_stream, sms=sms, policy=gemm_policy,
                                     batch_invariant=batch_invariant, bias=bias)

    def _batched_through_views(self, input, work, output, ws, c_tmp, a_tmp, lanes, sms, gemm_policy,
                               batch_invariant=False, bias=None):
        per_ws = gemm.workspace_numel(sms)
        experts = self.expert_views()
        for i, (e, r_in, r_out, m) in enumerate(work):
            lane = i % len(lanes)
            gemm.marlin_gemm(input[r_in:r_in + m], experts[e], c=output[r_out:r_out + m],
                             workspace=ws[lane * per_ws:(lane + 1) * per_ws], c_tmp=c_tmp[lane],
                             a_tmp=None if a_tmp is None else a_tmp[lane, :m], stream=lanes[lane], sms=sms,
                             policy=gemm_policy, batch_invariant=batch_invariant,
                             bias=None if bias is None else bias[e], global_scale=self.expert_global_scale(e))

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
                         policy: MoePolicy | None = None, batch_invariant: bool = False, bias=None):
        """One launch: ``output[id] = input[id // top_k] @ W[expert_ids[b]]`` (× ``topk_weights.flat[id]`` when
        given) for every id < prob_m·top_k of every block b < num_tokens_post_padded / moe_block_size with an
        expert id >= 0 (``bias`` [E, n_per_expert] in the act dtype: ``(input @ W[e] + bias[e]) × weight``, added
        in the epilogue before the one rounding; None: the stack's own, if any). NVFP4 stacks: ``(gs[e] · (input @
        W[e]) + bias[e]) × weight``, gs the stack's per-expert global scales, on the fp32 sums. Rows of ``output`` no block names are left untouched. Inputs come from
        ``moe_align_block_size``; input [prob_m, K], output [prob_m·top_k, n_per_expert]. CuPy arrays or torch tensors
        (nothing is allocated); ``stream`` None: the current stream of input's framework. ``batch_invariant``: under
        ``policy.batch_invariant()`` (one tile for every block size: a row's bits do not depend on it)."""
        given = output
        policy = policy or _default()
        if batch_invariant:
            policy = policy.batch_invariant()
        if type(input) is not rt.cupy_array_type():
            stream = rt.stream_handle(stream, pool_of(input), rt.device_pointer(input, "input")[1]) \
                if on_gpu(input) else stream
            input, sorted_token_ids, expert_ids, num_tokens_post_padded, output, topk_weights, bias = (
                as_cupy(x) for x in (input, sorted_token_ids, expert_ids, num_tokens_post_padded, output,
                                     topk_weights, bias))
        fused.launch_fused(self, input, sorted_token_ids, expert_ids, num_tokens_post_padded, output, prob_m,
                           moe_block_size, top_k, topk_weights, stream, policy, bias)
        return given

    def make_expert_linear(self, expert_offset: int, expert_n: int, bias=None) -> ExpertLinear:
        """Columns ``[expert_offset, expert_offset + expert_n)`` of the stack's concatenated output space
        (expert e owns ``[e·n_per_expert, (e+1)·n_per_expert)``) as a dense layer. Both must be multiples of 64
        (Marlin tiles are 64 columns wide, and every permutation of scales and zero points stays inside one tile,
        so a 64-aligned column slice of each buffer is itself a valid Marlin layer) and stay within one expert.
        The slice is copied to contiguous buffers (the dense GEMM needs contiguous tiles)."""
        off, n = as_int(expert_offset, "expert_offset"), as_int(expert_n, "expert_n")
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
        xp = array_module(w.qweight)
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
