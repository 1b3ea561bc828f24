"""The Hopper kernel family of the dense GEMM: ``kernels_cuda/hopper_gemm.cu`` (wgmma with the dequantized Marlin
weight as the register operand, sm_90a), its tile choice, split-K grid, scratch and launch, and the choice between
the families (``choose_family``) that ``gptq_marlin_gemm`` / ``marlin_gemm`` make through ``family=`` or the
policy's ``kernel_families`` table.

What the family takes today (every other input is a clear error before any launch when the family is forced, and
the mma.sync kernel when the policy's table picked the family): u4b8 weights, fp16 activations, groups of 64 or 128
rows without act-order, N a multiple of 256, on a compute capability 9.0 device. The numerics are those of the
mma.sync kernel's grouped path (the weight rounded to fp16 after its scale, fp32 sums, one rounding of the output):
``workbench.gemm.error_bound_factor(dtype, K)`` bounds its error against the reference.
"""
from __future__ import annotations

import dataclasses
import functools
import threading
from typing import Any

import numpy as np

from workbench import cuda as rt
from workbench.cuda import arrays as rt_arrays
from workbench.cuda.compile import OPTIONS
from workbench.gemm import kernels
from workbench.gemm.checks import act_scalar_type, check_gemm_shapes
from workbench.gemm.geometry import default_policy
from workbench.policy import GemmPolicy
from workbench.scalar_types import ScalarType

FAMILIES = ("mma_sync", "wgmma")
KERNEL_SOURCE = "hopper_gemm.cu"
THREADS = 256            # two warpgroups (kThreads)
BLOCK_N = 256            # problem columns per block (kBlockN)
STAGE_KS = (64, 128)     # k per pipeline stage (STAGE_K)
K_MULTIPLE = 128         # size_k a multiple of the longest stage: every tile of the policy can run every K
GROUP_SIZES = (64, 128)  # grouped scales, one group row per stage at most
_ACT_NAMES = {ScalarType.F16: "__half"}


@functools.lru_cache(maxsize=None)
def kernel_source() -> str:
    return rt.inline_includes(kernels.KERNEL_DIR, KERNEL_SOURCE)


# wgmma.mma_async needs the architecture-specific target (sm_90a); NVRTC builds for it with -arch=sm_90a beside
# the -arch=sm_<device> CuPy adds (NVRTC 13.0 keeps the feature-specific target, either order)
_module = rt.KernelModule(lambda: kernel_source(), options=OPTIONS + ("-arch=sm_90a",))


@dataclasses.dataclass(frozen=True)
class WgmmaConfig:
    """One instantiation of ``hopper_gemm``: activation type, weight code, rows of A per block, whether the two
    warpgroups split those rows (else each stage's k16 steps), pipeline stages, k per stage."""

    act: ScalarType
    weight: ScalarType
    block_m: int
    split_m: bool
    stages: int
    stage_k: int = 64

    def __post_init__(self):
        if self.stage_k not in STAGE_KS:
            raise ValueError(f"stage_k = {self.stage_k}: one of {STAGE_KS}")

    @property
    def name_expression(self) -> str:
        return (f"mwb::hopper::hopper_gemm<{_ACT_NAMES[self.act]}, {self.weight.abi_code}, {self.block_m}, "
                f"{'true' if self.split_m else 'false'}, {self.stages}, {self.stage_k}>")

    @property
    def smem_bytes(self) -> int:
        """Tile::kSmemBytes: the stage ring or the epilogue's fp32 tile, whichever is larger, + 1 KiB to align."""
        stage = self.block_m * 128 * (self.stage_k // 64) + self.stage_k // 16 * 4 * 512 + 1024
        red = self.block_m * (BLOCK_N + 4) * 4
        return max(self.stages * stage, red) + 1024


def choose_config(act: ScalarType, weight: ScalarType, size_m: int, policy: GemmPolicy) -> WgmmaConfig:
    for max_m, (block_m, split_m, stages, stage_k) in policy.wgmma_tiles:
        if max_m is None or size_m <= max_m:
            return WgmmaConfig(act, weight, int(block_m), bool(split_m), int(stages), int(stage_k))
    raise ValueError(f"GemmPolicy.wgmma_tiles = {policy.wgmma_tiles!r} has no row for M = {size_m} (end it with "
                     f"a max M of None)")


def grid(size_m: int, size_n: int, size_k: int, block_m: int, sms: int, policy: GemmPolicy,
         stage_k: int = 64) -> tuple[int, int, int]:
    """(column blocks, row tiles, K splits): K is split until about one block per SM runs, each split keeping at
    least ``policy.wgmma_min_split_stages`` 64-row k steps (whole stages of ``stage_k``)."""
    n_blocks, m_tiles = size_n // BLOCK_N, -(-size_m // block_m)
    stages = size_k // stage_k
    policy_stages = max(1, policy.wgmma_min_split_stages * 64 // stage_k)
    blocks = n_blocks * m_tiles
    splits = max(1, min(sms // blocks, stages // policy_stages))
    return n_blocks, m_tiles, splits


def unsupported(act: ScalarType, weight: ScalarType, size_n: int, size_k: int, group_size: int, act_order: bool,
                lda: int, cc: int) -> str | None:
    """Why the wgmma family cannot run this problem (None: it can)."""
    if cc != 90:
        return f"the wgmma family needs an sm_90a device (compute capability 9.0); this one is {cc // 10}.{cc % 10}"
    if weight != ScalarType.U4B8:
        return f"the wgmma family takes u4b8 weights so far, not {weight}"
    if act not in _ACT_NAMES:
        return f"the wgmma family takes fp16 activations so far, not {act}"
    if act_order:
        return "the wgmma family has no act-order (g_idx / perm) path"
    if group_size not in GROUP_SIZES:
        return f"the wgmma family takes groups of {' or '.join(map(str, GROUP_SIZES))} rows, not {group_size}"
    if size_n % BLOCK_N:
        return f"the wgmma family needs size_n a multiple of {BLOCK_N}, got {size_n}"
    if size_k % K_MULTIPLE:
        return f"the wgmma family needs size_k a multiple of {K_MULTIPLE}, got {size_k}"
    if lda % 8:
        return f"the wgmma family needs A's row stride a multiple of 8 elements, got {lda}"
    return None


def choose_family(device: int, size_m: int, policy: GemmPolicy | None = None, family: str | None = None) -> str:
    """``family`` when given (one of FAMILIES), else the first row of ``policy.kernel_families`` whose minimum
    compute capability and M range hold on ``device``, else "mma_sync"."""
    if family is not None:
        if family not in FAMILIES:
            raise ValueError(f"family = {family!r}: one of {', '.join(FAMILIES)} (or None: the policy's choice)")
        return family
    policy = policy or default_policy()
    if not policy.kernel_families:
        return "mma_sync"
    cc = kernels.device_properties(device)[0]
    for min_cc, lo, hi, fam in policy.kernel_families:
        if cc >= min_cc and lo <= size_m <= hi:
            return fam
    return "mma_sync"


def routes_to_wgmma(a, b_q_weight, b_scales, g_idx, perm, b_q_type, size_m, size_n, size_k, policy: GemmPolicy,
                    family: str | None) -> bool:
    """Whether gptq_marlin_gemm hands this call to the wgmma family: forced (``family="wgmma"``: wgmma_gemm then
    names what it cannot run), or picked by the policy's table for a problem the family can run (anything else,
    bad input included, stays with the mma.sync path and its checks)."""
    device = rt.device_pointer(a, "A")[1]
    if choose_family(device, size_m, policy, family) != "wgmma":
        return False
    if family == "wgmma":
        return True
    try:
        a, b_scales, g_idx, perm = (rt.as_device_array(x, name) for x, name in
                                    ((a, "A"), (b_scales, "b_scales"), (g_idx, "g_idx"), (perm, "perm")))
        act = act_scalar_type(a.dtype)
        groups = int(b_scales.shape[0])
        group = size_k // groups if groups > 1 else -1
        act_order = any(x is not None and int(np.prod(x.shape)) > 0 for x in (g_idx, perm))
        lda = int(a.strides[0]) // np.dtype(a.dtype).itemsize if size_m > 1 else size_k
        return unsupported(act, ScalarType.parse(b_q_type), size_n, size_k, group, act_order, lda,
                           kernels.device_properties(device)[0]) is None and size_m > 0
    except (TypeError, ValueError, AttributeError, IndexError, ZeroDivisionError):
        return False


@dataclasses.dataclass
class _Plan:
    config: WgmmaConfig
    launch: Any        # rt.Launch
    args: Any          # rt.ArgBlock
    lock: threading.Lock
    device: int
    grid: tuple
    partial_floats: int
    counters: int
    out_shape: tuple
    out_dtype: Any
    lda: int


@dataclasses.dataclass(frozen=True)
class Scratch:
    """The split-K buffers of one stream: fp32 partial tiles and the per-tile arrival counters (left zero by every
    launch), in ``framework``'s arrays, with their element counts (torch's ``size`` is a method)."""

    partial: Any
    counters: Any
    partial_floats: int
    n_counters: int


_plans: dict[tuple, _Plan] = {}
_scratch: dict[tuple, Scratch] = {}
_MAX_PLANS = 256


def _scratch_for(device: int, stream_ptr: int, framework: str, floats: int, counters: int) -> Scratch:
    """Scratch of at least these sizes for launches on one stream (in order, so they share it), grown as needed."""
    key = (device, stream_ptr, framework)
    have = _scratch.get(key)
    if have is None or have.partial_floats < floats or have.n_counters < counters:
        floats = max(1, floats, have.partial_floats if have else 0)
        counters = max(1, counters, have.n_counters if have else 0)
        have = Scratch(rt_arrays.empty(framework, floats, np.float32, device),
                       rt_arrays.empty(framework, counters, np.int32, device, zero=True), floats, counters)
        _scratch[key] = have
    return have


def _plan(a, b_q_weight, b_scales, b_zeros, g_idx, perm, b_q_type, size_m, size_n, size_k, is_k_full, c, sms,
          policy: GemmPolicy) -> _Plan:
    shapes = check_gemm_shapes(a, b_q_weight, b_scales, b_zeros, g_idx, perm, b_q_type, size_m, size_n, size_k,
                               is_k_full, c)
    _, device = rt.device_pointer(a, "A")
    cc, device_sms, smem_limit, _ = kernels.device_properties(device)
    reason = unsupported(shapes.act, shapes.weight, size_n, size_k, shapes.group_size, shapes.has_act_order,
                         shapes.lda, cc)
    if reason is not None:
        raise ValueError(reason)
    if size_m <= 0:
        raise ValueError(f"size_m = {size_m}: the wgmma family needs M >= 1")
    config = choose_config(shapes.act, shapes.weight, size_m, policy)
    if config.smem_bytes > smem_limit:
        raise ValueError(f"wgmma tile {config} needs {config.smem_bytes} bytes of shared memory; the device allows "
                         f"{smem_limit}")
    sms = device_sms if sms <= 0 else int(sms)
    g = grid(size_m, size_n, size_k, config.block_m, sms, policy, config.stage_k)
    fn = _module.function_ptr(config.name_expression, device, config.smem_bytes)
    tiles = g[0] * g[1]
    return _Plan(config, rt.Launch(fn, g, THREADS, config.smem_bytes), rt.ArgBlock("ppppppiiiii"), threading.Lock(),
                 device, g, tiles * g[2] * config.block_m * BLOCK_N if g[2] > 1 else 0, tiles,
                 (size_m, size_n), np.dtype(a.dtype), shapes.lda)


def wgmma_gemm(a, b_q_weight, b_scales, b_zeros, g_idx, perm, b_q_type, size_m: int, size_n: int, size_k: int,
               is_k_full: bool = True, *, c=None, stream=None, sms: int = -1, policy: GemmPolicy | None = None):
    """C = A @ dequant(B) by the wgmma family, the arguments as ``gptq_marlin_gemm``'s (CuPy arrays, torch tensors
    or ``__cuda_array_interface__`` arrays). Every check runs on the first call of a layout; a problem the family
    cannot run is a ValueError naming why (see ``unsupported``)."""
    policy = policy or default_policy()
    framework = rt.framework_of(a)
    c_given = c
    # another framework's arrays: views with CuPy's attribute names (outputs still come from that framework's pool)
    a, b_q_weight, b_scales, b_zeros, g_idx, perm, c = (
        rt.as_device_array(x, name) for x, name in ((a, "A"), (b_q_weight, "b_q_weight"), (b_scales, "b_scales"),
                                                   (b_zeros, "b_zeros"), (g_idx, "g_idx"), (perm, "perm"), (c, "c")))
    key = (type(a), tuple(a.shape), tuple(a.strides), str(a.dtype), tuple(b_q_weight.shape),
           tuple(b_scales.shape), str(b_scales.dtype), None if b_zeros is None else tuple(b_zeros.shape),
           None if g_idx is None else tuple(g_idx.shape), None if perm is None else tuple(perm.shape),
           str(b_q_type), size_m, size_n, size_k, bool(is_k_full), sms, policy.token,
           a.data.device_id)
    plan = _plans.get(key)
    if plan is None:
        plan = _plan(a, b_q_weight, b_scales, b_zeros, g_idx, perm, b_q_type, size_m, size_n, size_k, is_k_full, c,
                     sms, policy)
        if len(_plans) >= _MAX_PLANS:
            _plans.clear()
        _plans[key] = plan
    device = plan.device
    stream_ptr = rt.stream_handle(stream, framework, device)
    if c is None:
        c = c_given = rt_arrays.empty(framework, plan.out_shape, plan.out_dtype, device)
    elif (tuple(c.shape) != plan.out_shape or np.dtype(c.dtype) != plan.out_dtype
          or not c.flags["C_CONTIGUOUS"]):
        raise ValueError(f"c has shape {tuple(c.shape)}, dtype {c.dtype}, contiguous {c.flags['C_CONTIGUOUS']}; "
                         f"expected a contiguous {plan.out_shape} array of {plan.out_dtype}")
    scratch = _scratch_for(device, stream_ptr, framework, plan.partial_floats, plan.counters)
    partial, counters = scratch.partial, scratch.counters
    ptrs = []
    for x, name in ((a, "A"), (b_q_weight, "b_q_weight"), (c, "c"), (partial, "partial"), (counters, "counters"),
                    (b_scales, "b_scales")):
        ptr, dev = rt.device_pointer(x, name)
        if dev != device:
            raise ValueError(f"{name} is on device {dev} but A is on device {device}")
        if ptr % 16:
            raise ValueError(f"{name} address {ptr:#x} is not 16-byte aligned")
        ptrs.append(ptr)
    with plan.lock:
        plan.args.set(ptrs + [size_m, size_n, size_k, plan.lda, size_k // b_scales.shape[0]])
        rt.launch_kernel(plan.launch, stream_ptr, plan.args.address)
    return c_given


def precompile(configs, device: int = 0) -> None:
    """Compile instantiations ahead (tests, bench)."""
    for cfg in configs:
        _module.kernel(cfg.name_expression, device, cfg.smem_bytes)
