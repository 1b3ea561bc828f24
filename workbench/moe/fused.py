"""One fused MoE GEMM phase (``mwb::marlin_moe``): its checks, its grid, and its launch (programmatic on sm_90+,
shared memory pinned to the planned CTAs per SM as the dense GEMM's), cached per kernel and grid."""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import numpy as np

from workbench import cuda as rt
from workbench.cuda import launch as rt_launch
from workbench.formats.moe_align import SUPPORTED_BLOCK_SIZES
from workbench.gemm import check_bias, check_groups, check_size_k, act_scalar_type, tiled_n
from workbench.gemm import kernels as gemm_kernels
from workbench.moe import kernels
from workbench.moe.config import MoeConfig, cached_moe_config
from workbench.moe.kernels import PLAN_ARG_KINDS, as_int, on_gpu
from workbench.policy import MoePolicy

if TYPE_CHECKING:  # (stack.py imports this module)
    from workbench.moe.stack import MarlinExpertStack

_MAX_CACHED = 1024  # entries per cache: a serving loop sees a few dozen shapes; the bound keeps a sweep finite


class UnsupportedError(NotImplementedError):
    """This backend/build cannot run the requested path (ferrum-kernels' ``unsupported`` error)."""


def check_int_vector(x, name: str):
    if not on_gpu(x):
        raise TypeError(f"{name} is not on GPU (got {type(x).__module__}.{type(x).__name__})")
    if np.dtype(x.dtype) != np.int32 or len(x.shape) != 1 or not x.flags["C_CONTIGUOUS"]:
        raise TypeError(f"{name} must be a contiguous 1-D int32 array, got {np.dtype(x.dtype)} {tuple(x.shape)}")


def launch_fused(stack: MarlinExpertStack, input, sorted_token_ids, expert_ids, num_tokens_post_padded, output,
                 prob_m, moe_block_size, top_k, topk_weights, stream, policy: MoePolicy, bias=None):
    w = stack.weight
    prob_m, moe_block_size, top_k = (as_int(v, n) for v, n in ((prob_m, "prob_m"), (moe_block_size, "moe_block_size"),
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
    lda = int(input.strides[0]) // item if prob_m > 1 else -(-stack.k // 8) * 8  # (one row: never used)
    if lda % 8 or lda < stack.k:
        raise ValueError(f"input.stride(0) = {lda} must be >= K = {stack.k} and divisible by 8 (16-byte rows)")
    for name, x in (("sorted_token_ids", sorted_token_ids), ("expert_ids", expert_ids),
                    ("num_tokens_post_padded", num_tokens_post_padded)):
        check_int_vector(x, name)
    cap = int(sorted_token_ids.shape[0])
    if cap % moe_block_size:
        raise ValueError(f"sorted_token_ids has {cap} entries, not a multiple of moe_block_size = {moe_block_size}")
    if int(expert_ids.shape[0]) != cap // moe_block_size:
        raise ValueError(f"expert_ids has {int(expert_ids.shape[0])} entries, expected sorted_token_ids.size / "
                         f"moe_block_size = {cap // moe_block_size}")
    if int(num_tokens_post_padded.shape[0]) < 1:
        raise ValueError("num_tokens_post_padded is empty")
    if topk_weights is not None:
        if not on_gpu(topk_weights):
            raise TypeError("topk_weights is not on GPU")
        if np.dtype(topk_weights.dtype) != np.float32 or int(topk_weights.size) != numel or \
                not topk_weights.flags["C_CONTIGUOUS"]:
            raise ValueError(f"topk_weights must be contiguous float32 with prob_m * top_k = {numel} elements, got "
                             f"{np.dtype(topk_weights.dtype)} {tuple(topk_weights.shape)}")
    ng = int(w.scales.shape[1])
    check_size_k(stack.k, w.weight_type)
    # (the last group may be partial; a microscaled format's are whole, its rules checked when the stack was made)
    group = check_groups(w.weight_type, stack.k, ng, False, True, "scales.size(1)", stack.microscale is not None)
    if bias is None:
        bias = stack.bias  # (the stack's own per-expert bias rows, gpt-oss's: None unless given)
    global_scale = stack.global_scale  # NVFP4: [E] fp32, passed in the zero-point slot (marlin_moe.cu)
    if global_scale is not None and not on_gpu(global_scale):
        raise TypeError("the stack's global_scale is not on GPU")
    if bias is not None:  # per-expert bias rows, added in the epilogue before the router weight
        if not on_gpu(bias):
            raise TypeError("bias is not on GPU")
        check_bias(bias, stack.n_per_expert, input.dtype, "bias", (stack.num_experts,))
    device = stack._device()
    for name, x in (("input", input), ("output", output), ("sorted_token_ids", sorted_token_ids),
                    ("expert_ids", expert_ids), ("num_tokens_post_padded", num_tokens_post_padded),
                    ("topk_weights", topk_weights), ("bias", bias), ("global_scale", global_scale)):
        if x is not None and rt.device_pointer(x, name)[1] != device:
            raise ValueError(f"{name} is on device {rt.device_pointer(x, name)[1]} but the stack is on {device}")
    if input.data.ptr % 16:
        raise ValueError("input must be aligned to 16 bytes")
    if numel == 0 or cap == 0:
        return output
    cfg, grid, n_blocks = fused_grid(stack, device, act_scalar_type(input.dtype), moe_block_size, numel, cap,
                                     group, policy)
    launch_fused_phase(cfg, grid, device, policy, (
        input.data.ptr, w.qweight.data.ptr, output.data.ptr, w.scales.data.ptr,
        zero_slot(stack), sorted_token_ids.data.ptr, expert_ids.data.ptr,
        num_tokens_post_padded.data.ptr, 0 if topk_weights is None else topk_weights.data.ptr,
        0 if bias is None else bias.data.ptr, n_blocks,
        moe_block_size, numel, top_k, stack.n_per_expert, stack.k, lda, group, stack.num_experts),
        rt.stream_handle(stream))
    return output


def zero_slot(stack: MarlinExpertStack) -> int:
    """The kernel's zero-point argument: the zero points' address, NVFP4's per-expert global scales' (which take
    that slot, as in the dense kernel), or 0."""
    w = stack.weight
    if stack.global_scale is not None:
        return rt.device_pointer(stack.global_scale, "global_scale")[0]
    return 0 if w.zeros is None else w.zeros.data.ptr


def launch_smem(cfg: MoeConfig, device: int, policy: MoePolicy) -> int:
    """The shared memory of a programmatic launch of a fused GEMM: pinned to its planned CTAs per SM, as the dense
    GEMM's (the policy's ``programmatic_pin_occupancy``: a grid placed while the one before runs would otherwise
    stack CTAs on the SMs that grid leaves idle)."""
    if not policy.programmatic_pin_occupancy:
        return cfg.smem_bytes
    key = (cfg.name_expression, device, cfg.blocks_per_sm)
    if key not in _pinned_smem:
        kernel = kernels.get_moe_kernel(cfg.name_expression, device, cfg.smem_bytes)
        _pinned_smem[key] = gemm_kernels.pin_occupancy_of(kernel, device, cfg.smem_bytes, cfg.blocks_per_sm)
    return _pinned_smem[key]


_pinned_smem: dict[tuple[str, int, int], int] = {}  # (kernel, device, CTAs per SM) -> launch_smem's answer


def launch_fused_phase(cfg: MoeConfig, grid: int, device: int, policy: MoePolicy, values: tuple,
                       stream: int) -> None:
    """One fused GEMM phase on checked arguments: ``values`` in the kernel's parameter order
    (PLAN_ARG_KINDS["marlin_moe"]: addresses, then int32 scalars), launched programmatically (the policy's
    programmatic_launch on sm_90+, shared memory pinned as the dense GEMM's) or plainly. The launch and argument
    block are made once per (kernel, device, grid, form) and reused under a lock (making them costs more host time
    than a launch)."""
    programmatic = gemm_kernels.programmatic_launches(device, policy.programmatic_launch)
    key = (cfg.name_expression, device, grid, cfg.blocks_per_sm, programmatic,
           programmatic and policy.programmatic_pin_occupancy)
    prepared = _phase_launches.get(key)
    if prepared is None:
        f = kernels.function_ptr(cfg.name_expression, device, cfg.smem_bytes)
        launch = rt.Launch(f, grid, 256, cfg.smem_bytes)
        if programmatic:
            pinned = rt.Launch(f, grid, 256, launch_smem(cfg, device, policy), programmatic=True)
            launch = pinned if pinned.supported else launch  # (no cuda-python driver bindings: plain)
        prepared = (launch, rt.ArgBlock(PLAN_ARG_KINDS["marlin_moe"]), threading.Lock())
        if len(_phase_launches) >= _MAX_CACHED:
            _phase_launches.clear()
        _phase_launches[key] = prepared
    launch, args, lock = prepared
    with rt.cupy().cuda.Device(device), lock:
        args.set(values)
        rt_launch.launch_kernel(launch, stream, args.address)



_phase_launches: dict[tuple, tuple] = {}


def fused_grid(stack: MarlinExpertStack, device: int, act, moe_block_size: int, numel: int, cap: int, group: int,
               policy: MoePolicy):
    """(config, grid, n_blocks) of one fused launch on checked arguments (shared by launch_fused and the layer
    plans, so both launch the same kernel on the same grid)."""
    props = gemm_kernels.device_properties(device)  # (cc, SMs, opt-in smem per block, smem per SM)
    sms, smem_limit, sm_smem = props[1], props[2], props[3]
    if stack._sms > 0:
        sms = stack._sms
    n_blocks = cap // moe_block_size
    items_hint = min(n_blocks, numel)
    e8m0 = stack.microscale is not None and not stack.microscale.global_scale  # MXFP4 / MXFP8: E8M0 codes
    cfg = cached_moe_config(act, stack.weight.weight_type, moe_block_size, stack.n_per_expert, stack.k, group,
                            items_hint, sms, smem_limit, sm_smem, policy, e8m0_scales=e8m0)
    # No CTA waits on another, so a grid larger than what is resident is correct, only slower.
    grid = max(1, min(sms * cfg.blocks_per_sm, items_hint * (tiled_n(stack.n_per_expert) // cfg.block_n)))
    return cfg, grid, n_blocks
