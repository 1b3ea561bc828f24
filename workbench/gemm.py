"""Native Marlin GEMM (``kernels_cuda/marlin_gemm.cu``), compiled at first use through ``cupy.RawModule``.

Three entry points, each one layer on top of the next:

* ``launch_marlin_mm(record)`` — the launch-record ABI (docs/formats.md, "Launch record"): a ``MarlinLaunch`` record
  of raw device pointers
  (``workbench.gemm_abi``). Checks everything a record can say (types, flags, sizes, alignment) and launches.
  No allocation and no host synchronisation: capturable in a CUDA graph.
* ``gptq_marlin_gemm(a, b_q_weight, b_scales, b_zeros, g_idx, perm, workspace, b_q_type, size_m, size_n, size_k,
  ...)`` — vLLM's op and argument order, on CuPy arrays. Checks every shape, dtype and device rule (docs/formats.md,
  "Host checks")
  before building the record.
* ``marlin_gemm(a, weight)`` — the convenience form over a ``MarlinWeight`` whose arrays are on the GPU
  (``upload_weight``).

Scratch buffers (all int32/fp32 on the GPU): ``workspace`` (≥ ``sms`` lock counters, zero, left zero by every
launch), ``c_tmp`` (fp32 partial sums, ≥ ``c_tmp_numel(sms)``), ``a_tmp`` (act-order activations, ≥ M·K).

Residency: in the fp32 (default) and in-C reductions a block may wait for another block's count, so every block of
a launch must be able to become resident. The grid never exceeds ``sms`` × the blocks per SM the driver reports,
and in practice a GPU dispatches all of a grid's blocks before a later grid's (not a documented guarantee; the
lock-ordered reduction of the public Marlin kernel relies on the same), so kernels on other streams delay a launch
without starving it; where SMs are partitioned (MPS limits, green contexts), pass ``sms`` no larger than the
partition.
Atomic-add mode never waits; nor do the thread-block cluster sums (sm_90+, fp32 reduction, slices split over two
blocks: ``cluster_blocks``), where a slice's blocks are one cluster the hardware schedules together.
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import math
import pathlib
import threading
from typing import Any

import numpy as np

from workbench.gemm_abi import (
    ABI_VERSION, ACT_TYPES, FLAG_DETERMINISTIC, FLAG_HAS_ACT_ORDER, FLAG_HAS_ZERO_POINTS, FLAG_IS_K_FULL,
    FLAG_USE_ATOMIC_ADD, FLAG_USE_FP32_REDUCE, GEMM_WEIGHT_TYPES, KNOWN_FLAGS, MarlinLaunch, MarlinMmBuffers,
    MarlinMmExecution, MarlinMmProblem, MarlinMmRequest,
)
from workbench import cuda as rt
from workbench import gemm_checks as checks
from workbench.cuda import arrays as rt_arrays
from workbench.cuda import launch as rt_launch
from workbench.gemm_checks import GROUP_SIZES, TILE_K, TILE_N
from workbench.policy import DEFAULT_GEMM_POLICY, GEMM_GLOBALS, GemmPolicy, install_deprecated_globals
from workbench.scalar_types import ScalarType

KERNEL_DIR = pathlib.Path(__file__).resolve().parent.parent / "kernels_cuda"
KERNEL_SOURCE = "marlin_gemm.cu"

THREADS = 256
MAX_BLOCK_M = 64  # rows of one block tile (4 m16 blocks)
MAX_BLOCK_N = 256

REDUCE_IN_C, REDUCE_FP32, REDUCE_ATOMIC = 0, 1, 2  # kernels_cuda/marlin_gemm.cu ReduceMode
GROUP_CHANNELWISE, GROUP_GROUPED, GROUP_PER_ROW = 0, 1, 2  # kernels_cuda/marlin_mainloop.cuh GroupMode


# ---------------------------------------------------------------------------------------------------------------
# Kernel configurations
# ---------------------------------------------------------------------------------------------------------------
class TileGeometry:
    """Block shape and shared memory of one kernel instantiation, from its template arguments (``weight``,
    ``m_blocks``, ``n_tiles``, ``k_warp``, ``stages``, ``group_mode``). Mirrors ``mwb::Geometry`` in
    kernels_cuda/marlin_mainloop.cuh, the stage layout both the dense (KernelConfig) and the fused MoE kernel
    (workbench.moe.MoeConfig) use."""

    @property
    def per_row_groups(self) -> bool:
        return self.group_mode == GROUP_PER_ROW

    @property
    def block_m(self) -> int:
        return 16 * self.m_blocks

    @property
    def block_n(self) -> int:
        return 64 * self.n_tiles

    @property
    def block_k(self) -> int:
        return 16 * self.k_warp * (8 // self.n_tiles)

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory; mirrors ``Geometry::kSmemBytes``."""
        pack = 32 // self.weight.bits
        kt = self.k_warp * (8 // self.n_tiles)
        a = self.block_m * self.block_k // 8
        b = kt * self.n_tiles * (16 * 64 // pack // 4)
        scale_rows = max(1, self.block_k // 32)
        s = scale_rows * self.block_n // 8
        z = scale_rows * self.block_n // pack // 4 if self.weight.has_zero_points else 0
        g = self.block_k // 4 if self.group_mode == GROUP_PER_ROW else 0
        warps_per_n = 8 // self.n_tiles  # the warp-fold buffer: fold_buffer_floats(n_tiles) / 4
        red = (warps_per_n // 2) * self.n_tiles * 1024 // 4 if warps_per_n > 1 else 0
        return 16 * (self.stages * (a + b + s + z + g) + red)

    @property
    def plain(self) -> bool:
        """Weights without zero points or act-order groups (several policy rules were measured for these only)."""
        return not self.weight.has_zero_points and self.group_mode != GROUP_PER_ROW

    @property
    def late_scale(self) -> bool:
        """Whether the kernel applies the scales to fp32 partial sums instead of to each dequantized weight (mirrors
        ``WarpLoop::kLateScale`` and ``late_scale_pays`` in kernels_cuda/marlin_mainloop.cuh). Two kernels that differ
        here round differently: their outputs are not bitwise equal even where the partition is the same."""
        fits = self.swap == 1 or (self.blocks_per_sm == 1 and (self.swap == 2 or self.k_warp >= 2))
        return self.m_blocks == 1 and self.group_mode != GROUP_PER_ROW and self.weight is not ScalarType.FE4M3FN \
            and fits


@dataclasses.dataclass(frozen=True)
class KernelConfig(TileGeometry):
    """One instantiation of ``mwb::marlin_gemm`` (its template arguments) and the geometry they imply."""

    act: ScalarType
    weight: ScalarType
    m_blocks: int  # 16-row blocks per block tile (1..4)
    n_tiles: int  # 64-column tiles per block tile (1, 2, 4)
    k_warp: int  # k16 tiles per warp per pipeline stage
    stages: int
    group_mode: int  # GROUP_CHANNELWISE, GROUP_GROUPED or GROUP_PER_ROW (act-order on a K shard, through g_idx)
    blocks_per_sm: int = 1  # resident blocks per SM the kernel's registers are cut for (template argument MIN_BLOCKS)
    # 8-row halves of the operand-swapped loop (template argument SWAP; 0: row layout): 1 for M <= 8 (one mma per
    # 16x16 sub-block instead of two), 2 for M <= 16 (the policy's only with swap_max_m = 16); bools read as 0 / 1
    swap: int = 0
    cluster: int = 1  # > 1: blocks per thread-block cluster, slices summed in shared memory (marlin_gemm_cluster)

    @property
    def name_expression(self) -> str:
        t = "__half" if self.act is ScalarType.F16 else "__nv_bfloat16"
        args = (f"{t}, {self.weight.abi_code}, {self.m_blocks}, {self.n_tiles}, {self.k_warp}, {self.stages}, "
                f"{self.group_mode}, {self.blocks_per_sm}, {int(self.swap)}")
        if self.cluster > 1:
            return f"mwb::marlin_gemm_cluster<{args}, {self.cluster}>"
        return f"mwb::marlin_gemm<{args}>"


# (n_tiles, k_warp) -> (thread_k, thread_n) = (block_k, block_n): every tile the kernel instantiates. Which ones a
# launch tries, and in what order, is the policy's (workbench.policy.GemmPolicy).
_THREAD_SHAPES = {(2, 4): (256, 128), (2, 2): (128, 128), (1, 1): (128, 64), (4, 2): (64, 256), (2, 1): (64, 128),
                  (1, 2): (256, 64), (1, 4): (512, 64), (2, 8): (512, 128)}


def thread_shapes() -> dict[tuple[int, int], tuple[int, int]]:
    return dict(_THREAD_SHAPES)


RESERVED_SMEM_PER_BLOCK = 1024  # shared memory the system takes per resident block on sm_80 / sm_90
# What a block needs beside its dynamic shared memory when planning blocks per SM: the system's reserve plus room for
# the kernel's static shared memory.
SMEM_RESERVED_PER_BLOCK = RESERVED_SMEM_PER_BLOCK + 64


def two_block_smem(smem_limit: int, sm_smem: int) -> int:
    """Dynamic shared memory one block may take when two share an SM of ``sm_smem`` bytes (the dense and the fused
    MoE kernels' two-block variants)."""
    return min(smem_limit, sm_smem // 2 - SMEM_RESERVED_PER_BLOCK)


def pairs_possible(compute_capability: int, fp32_reduce: bool, policy: GemmPolicy | None = None) -> bool:
    """Whether choose_config may take the pair policy for a launch (``pair_clusters``, sm_90+, fp32 reduction)."""
    return (policy or _default()).pair_clusters and compute_capability >= 90 and fp32_reduce


def swap_halves(size_m: int, plain: bool = True, policy: GemmPolicy | None = None) -> int:
    """KernelConfig.swap for M rows under the policy's ``swap_max_m``: 8-row halves of the swapped loop, 0 for the
    row layout. ``plain``: weights without zero points or act-order groups (KernelConfig.plain; the 16-row form's
    two-block kernels spill with them)."""
    most = (policy or _default()).swap_max_m
    return 1 if size_m <= min(most, 8) else 2 if plain and size_m <= min(most, 16) else 0


def choose_config(act: ScalarType, weight: ScalarType, size_m: int, size_n: int, size_k: int, group_size: int,
                  per_row_groups: bool, smem_limit: int, thread_k: int = -1, thread_n: int = -1,
                  sm_smem: int = 0, sms: int = 0, pairs: bool = False,
                  policy: GemmPolicy | None = None) -> KernelConfig:
    """The first thread shape that divides (K, N) and fits shared memory; ValueError naming the shape otherwise.

    ``pairs`` (the launch can sum slices in clusters of two: sm_90+, fp32 reduction, see ``pairs_possible``): for
    M <= 16, the one-block-per-SM configuration whose slices, two blocks each, fill the ``sms`` SMs comes first
    (the policy's ``pair_*`` fields). 4-bit rows-layout kernels with groups of >= 128 rows at M = 9..16 try the
    512 x 128 tile first, in pairs and then alone (``rows_wide_first``).
    Else, for M <= 16 (one m16 block) and 4-bit weights, a configuration that lets two blocks share an SM
    (``sm_smem`` = shared memory per SM; 0 = unknown; kernel cut to 128 registers) is preferred when each of the 2
    ``sms`` blocks then gets at least ``two_blocks_min_steps`` pipeline steps (``sms`` = 0: unknown, not checked).
    """
    p = policy or _default()
    m_blocks = min(4, max(1, math.ceil(size_m / 16)))
    group_mode = GROUP_PER_ROW if per_row_groups else (GROUP_CHANNELWISE if group_size == -1 else GROUP_GROUPED)
    # kernels of weights without zero points or act-order groups (swapped: their own thresholds below)
    plain = not weight.has_zero_points and not per_row_groups
    variant = dict(swap=swap_halves(size_m, plain, p))
    plain_swap = bool(variant["swap"]) and plain
    order = p.small_m_shapes if m_blocks <= 2 else p.large_m_shapes
    if m_blocks == 1 and weight.bits == 8:
        order = p.eight_bit_one_m_block_shapes
    rows_wide_tile = tuple(p.rows_wide_tile)
    wide_rows = (p.rows_wide_first and m_blocks == 1 and weight.bits == 4 and not variant["swap"]
                 and not per_row_groups and group_size >= 128)
    wide_first = (rows_wide_tile,) if wide_rows else ()  # (tried by the pairs and alone, never by the last resort)
    stage_order = (p.two_m_block_stages if m_blocks == 2 else p.large_m_stages) if m_blocks > 1 else \
        p.one_block_stages(weight.bits)

    def shapes(shape_order=order):
        for n_tiles, k_warp in shape_order:
            tk, tn = _THREAD_SHAPES[(n_tiles, k_warp)]
            if (thread_k, thread_n) != (-1, -1) and (tk, tn) != (thread_k, thread_n):
                continue
            if size_k % tk or size_n % tn:
                continue
            if group_size > 0 and not per_row_groups and group_size % tk and tk % group_size:
                continue
            if (n_tiles, k_warp) == rows_wide_tile and size_k // tk < p.rows_wide_min_steps:
                continue
            yield n_tiles, k_warp

    half_smem = two_block_smem(smem_limit, sm_smem)  # per block, two blocks per SM

    def pair_choice() -> KernelConfig | None:
        """The pair policy: slices of two blocks each, summed in clusters of two."""
        first = next(shapes(wide_first + order), None)
        # long pairs (past the step limits) for the first-choice shape
        long_pairs = act in p.pair_long_acts and (plain or (p.pair_long_zero_points and not per_row_groups))
        pair_shapes = p.four_bit_pair_shapes if weight.bits == 4 else order
        for n_tiles, k_warp in shapes(wide_first + pair_shapes):
            tk, tn = _THREAD_SHAPES[(n_tiles, k_warp)]
            slices = size_n // tn
            if not p.pair_min_fill * sms <= 2 * slices <= sms:
                continue
            steps = size_k // tk // 2  # per block
            if (n_tiles, k_warp) == rows_wide_tile and steps < p.rows_wide_min_steps:
                continue
            # (rows layout: only where late scaling flushes once per stage, i.e. a group spans a warp's k16 tiles)
            one_flush = variant["swap"] or group_size < 0 or group_size >= 16 * k_warp
            long_ok = long_pairs and (n_tiles, k_warp) == first and one_flush
            if steps >= 1 and (steps <= (p.pair_max_steps if plain else p.pair_max_steps_not_plain) or long_ok):
                stages_here = p.pair_stage_order(weight.bits, (n_tiles, k_warp), bool(variant["swap"]), stage_order)
                pair = next((cfg for stages in stages_here
                             for cfg in [KernelConfig(act, weight, m_blocks, n_tiles, k_warp, stages, group_mode,
                                                      **variant)] if cfg.smem_bytes <= smem_limit), None)
                if pair is not None:
                    return pair
            break  # only the first shape whose pairs fill the SMs
        # Two blocks per SM in pairs, where no tile's pairs fill the SMs one block each but the first-choice tile's
        # fill pair_two_block_min_fill.. of them two blocks each (swapped 4-bit kernels without zero points;
        # returned with cluster = 2, so grid_blocks gives each slice two blocks).
        if first is not None and plain_swap and act in p.two_block_pair_acts \
                and weight.bits in p.two_blocks_weight_bits and sm_smem > 0:
            n_tiles, k_warp = first
            tk, tn = _THREAD_SHAPES[first]
            if p.pair_two_block_min_fill * sms <= size_n // tn <= sms and size_k // tk >= 2:
                return next((cfg for stages in p.two_block_pair_stages
                             for cfg in [KernelConfig(act, weight, m_blocks, n_tiles, k_warp, stages, group_mode,
                                                      blocks_per_sm=2, cluster=2, **variant)]
                             if cfg.smem_bytes <= half_smem), None)
        # 8-bit fp16 kernels at M = 9..16 (rows layout): the first tile whose slices fill the SMs so, two blocks per
        # SM in pairs where one fits half an SM (pair_two_block_eight_bit_rows).
        if p.pair_two_block_eight_bit_rows and weight.bits == 8 and not variant["swap"] and plain \
                and act is ScalarType.F16 and sm_smem > 0:
            for n_tiles, k_warp in shapes():
                tk, tn = _THREAD_SHAPES[(n_tiles, k_warp)]
                # (at most pair_max_steps per block, as the one-block pairs: no longer range was measured)
                steps = size_k // tk
                if not (p.pair_two_block_min_fill * sms <= size_n // tn <= sms and 2 <= steps <= 2 * p.pair_max_steps):
                    continue
                two = next((cfg for stages in p.two_block_pair_stages
                            for cfg in [KernelConfig(act, weight, m_blocks, n_tiles, k_warp, stages, group_mode,
                                                     blocks_per_sm=2, cluster=2, **variant)]
                            if cfg.smem_bytes <= half_smem), None)
                if two is not None:
                    return two
        return None

    if pairs and p.pair_clusters and m_blocks == 1 and sms > 0:
        pair = pair_choice()
        if pair is not None:
            return pair
    if wide_rows:  # (before the two-block kernels: rows_wide_first)
        wide = next((cfg for n_tiles, k_warp in shapes(wide_first) for stages in p.rows_wide_stages
                     for cfg in [KernelConfig(act, weight, m_blocks, n_tiles, k_warp, stages, group_mode, **variant)]
                     if cfg.smem_bytes <= smem_limit), None)
        if wide is not None:
            return wide
    if m_blocks == 1 and sm_smem > 0 and weight.bits in p.two_blocks_weight_bits:
        two = next((cfg for n_tiles, k_warp in shapes() for stages in p.two_block_stages
                    for cfg in [KernelConfig(act, weight, m_blocks, n_tiles, k_warp, stages, group_mode,
                                             blocks_per_sm=2, **variant)] if cfg.smem_bytes <= half_smem), None)
        if two is not None:
            steps = (size_n // two.block_n) * (size_k // two.block_k)
            min_steps = p.two_blocks_min_steps_swap if plain_swap else p.two_blocks_min_steps
            if sms <= 0 or steps >= min_steps * 2 * sms:
                return two
    tried = []
    for n_tiles, k_warp in order:
        tk, tn = _THREAD_SHAPES[(n_tiles, k_warp)]
        if (thread_k, thread_n) != (-1, -1) and (tk, tn) != (thread_k, thread_n):
            continue
        tried.append((tk, tn))
        if size_k % tk or size_n % tn:
            continue
        if group_size > 0 and not per_row_groups and group_size % tk and tk % group_size:
            continue
        for stages in stage_order:
            cfg = KernelConfig(act, weight, m_blocks, n_tiles, k_warp, stages, group_mode, **variant)
            if cfg.smem_bytes <= smem_limit:
                return cfg
    raise ValueError(
        f"Invalid thread config: no (thread_k, thread_n) in {tried or [(thread_k, thread_n)]} divides "
        f"(size_k, size_n) = ({size_k}, {size_n}) within {smem_limit} bytes of shared memory; "
        f"size_k % 128 == 0 and size_n % 64 == 0 always works")


def pipeline_steps(cfg: KernelConfig, size_m: int, size_n: int, size_k: int) -> int:
    """The kernel's (slice, k step) iterations: m chunks x column slices x k steps per slice."""
    return math.ceil(size_m / cfg.block_m) * (size_n // cfg.block_n) * (size_k // cfg.block_k)


def grid_blocks(cfg: KernelConfig, size_m: int, size_n: int, size_k: int, sms: int, blocks_per_sm: int = 0,
                policy: GemmPolicy | None = None) -> int:
    """Blocks launched: at most as many as can be resident at once (every block must be: in the in-C and fp32
    reductions blocks wait on others' counts), fewer when the problem has fewer (slice, k) iterations.

    The kernel splits the T = slices x KI iterations evenly over the grid G. With G = slices x s (s <= KI), block
    c s + j covers [c KI + floor(j KI / s), c KI + floor((j + 1) KI / s)): every block stays inside one slice, so it
    finishes one slice instead of two (a block straddling two slices stops its pipeline mid-range to fold its warps
    and store and count in its partial, and sums its last slice's partials at the end). Chosen (``align_slices``)
    unless it lengthens the longest range by more than ``aligned_max_longer`` (x, one block per SM or swapped
    two-block kernels without zero points or act-order; one-block swapped kernels: ``aligned_max_longer_swap``;
    other two-block kernels: not at all) + ``aligned_extra_steps``. A configuration that choose_config returned with
    ``cluster`` > 1 (a pair policy choice) gets the aligned grid of that many blocks per slice wherever they fit.
    """
    p = policy or _default()
    chunks = math.ceil(size_m / cfg.block_m)
    slices = chunks * (size_n // cfg.block_n)
    ki = size_k // cfg.block_k
    iterations = slices * ki
    max_grid = sms * (blocks_per_sm or cfg.blocks_per_sm)
    striped = max(1, min(max_grid, iterations))
    if p.align_slices and slices <= max_grid:
        splits = min(ki, max_grid // slices)
        if cfg.cluster > 1 and cfg.cluster <= splits:  # chosen as a pair (choose_config): cluster blocks per slice
            return slices * cfg.cluster
        if max_grid <= sms:
            longer = p.aligned_max_longer_swap if cfg.swap else p.aligned_max_longer
        else:
            longer = p.aligned_max_longer if cfg.swap and cfg.plain and p.aligned_swap_two_blocks else 1.0
        if math.ceil(ki / splits) <= math.ceil(iterations / striped) * longer + p.aligned_extra_steps:
            return slices * splits
    return striped


KERNEL_CLUSTER_SIZES = (2, 4, 8)  # what marlin_gemm_cluster takes: the blocks share a partial's float4s evenly


def cluster_blocks(cfg: KernelConfig, size_m: int, size_n: int, size_k: int, grid: int, compute_capability: int,
                   fp32_reduce: bool, enabled: bool | None = None, sizes: tuple[int, ...] | None = None,
                   policy: GemmPolicy | None = None) -> int:
    """Blocks per cluster for a launch of ``cfg`` on ``grid`` blocks: s when the grid gives each slice s blocks of its
    own (slice-aligned; s in ``sizes``, default the policy's ``cluster_sizes``; s <= the slice's pipeline steps, so
    no block is idle: every block must reach the cluster barriers), 16-row tiles, the fp32 reduction and sm_90+;
    else 1 (no cluster). ``enabled``: None = the policy's ``cluster_sums``.

    In a cluster a slice's blocks add their partials through each other's shared memory, in the fp32 reduction's
    order (the output is bitwise the same), instead of C_tmp slots, a lock and the first contributor's wait."""
    p = policy or _default()
    if not ((p.cluster_sums if enabled is None else enabled) and compute_capability >= 90 and fp32_reduce
            and cfg.m_blocks == 1):
        return 1
    slices = math.ceil(size_m / cfg.block_m) * (size_n // cfg.block_n)
    s, rest = divmod(grid, slices)
    allowed = p.cluster_sizes if sizes is None else sizes
    return s if rest == 0 and s in allowed and s in KERNEL_CLUSTER_SIZES and s <= size_k // cfg.block_k else 1


def c_tmp_numel(sms: int) -> int:
    """fp32 elements of ``c_tmp`` that fit every configuration: two partial slots per block (a block shares at most
    two slices: the one it starts in and the one it ends in) of at most 64 x 256 (one block per SM) or 16 x 256
    (two blocks per SM, M <= 16)."""
    return 2 * sms * max(MAX_BLOCK_M * MAX_BLOCK_N, MAX_BLOCKS_PER_SM * 16 * MAX_BLOCK_N)


MAX_BLOCKS_PER_SM = 2


def workspace_numel(sms: int) -> int:
    """int32 lock counters: one per block (a slice shared by blocks locks on the block holding its end), up to
    MAX_BLOCKS_PER_SM blocks per SM."""
    return MAX_BLOCKS_PER_SM * sms


# ---------------------------------------------------------------------------------------------------------------
# Compilation (workbench.cuda's one compile path, cached per process and on disk)
# ---------------------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def kernel_source() -> str:
    """marlin_gemm.cu with its local headers inlined (KERNEL_DIR is read here: A/B runs point it elsewhere)."""
    return rt.inline_includes(KERNEL_DIR, KERNEL_SOURCE)


# every instantiation's kernel, CUfunction handle and (on_load) blocks per SM the driver keeps resident
_module = rt.KernelModule(lambda: kernel_source(), on_load=lambda kernel, smem: _resident_blocks(kernel, smem))


def get_kernel(name_expression: str, device: int, smem_bytes: int = 0):
    """The compiled kernel for one template instantiation on one device (compiled once per process)."""
    return _module.kernel(name_expression, device, smem_bytes)


def function_ptr(name_expression: str, device: int, smem_bytes: int = 0) -> int:
    """The CUfunction handle of one instantiation on one device (compiling it first if needed)."""
    return _module.function_ptr(name_expression, device, smem_bytes)


def _driver_apis():
    """CuPy's driver and runtime bindings (a function, so that CPU tests can stand in for them)."""
    from cupy_backends.cuda.api import driver, runtime

    return driver, runtime


def _resident_blocks(kernel, smem_bytes: int) -> int:
    """Blocks of THREADS threads the driver can keep resident per SM with this shared memory (1 if unknown).

    The query is a driver-API call: it needs a current context in the calling thread. precompile() loads kernels in
    fresh worker threads, where CuPy's device switch alone may leave none current; the query then failed, the
    fallback said 1, and two-block kernels ran on half their grid (H200, 8192 x 28672 M = 1: 61.6 instead of 54.4
    µs; round-6 device call 4). cudaFree(0) binds the device's primary context to the thread first."""
    try:
        driver, runtime = _driver_apis()
        if not driver.ctxGetCurrent():
            runtime.free(0)
        return max(1, int(driver.occupancyMaxActiveBlocksPerMultiprocessor(kernel.kernel.ptr, THREADS, smem_bytes)))
    except Exception:  # pragma: no cover - older CuPy: be conservative (every block must be resident)
        return 1


def resident_blocks(name_expression: str, device: int) -> int:
    return _module.loaded.get((name_expression, device)) or 1


def programmatic_launches(device: int, programmatic: bool | None = None) -> bool:
    """Whether launches on ``device`` are programmatic dependent launches: ``programmatic`` (None: the default
    GemmPolicy's ``programmatic_launch``) on an sm_90+ device. The dense GEMM's and the MoE kernels' (workbench/moe.py).

    A programmatic launch lets a kernel's blocks be scheduled while the kernel before it in the stream finishes; they
    fetch their first weight stage at once and wait (griddepcontrol.wait, kernels_cuda/mma.cuh) before they read the
    activations or write anything, and every kernel lets the next one start so (griddepcontrol.launch_dependents). It
    pays only where the kernel before triggers it; after any other kernel the launch behaves as a plain one. Needs
    cuda-python's driver bindings (cuLaunchKernelEx), else launches stay plain."""
    if programmatic is None:
        programmatic = _default().programmatic_launch
    return programmatic and device_properties(device)[0] >= 90


def pinned_smem(smem_bytes: int, blocks_per_sm: int, sm_smem: int, reserved_per_block: int) -> int:
    """The least dynamic shared memory >= smem_bytes (a multiple of 128 bytes) with which no more than
    ``blocks_per_sm`` blocks fit in an SM's ``sm_smem`` bytes, each block also taking ``reserved_per_block``."""
    least = sm_smem // (blocks_per_sm + 1) - reserved_per_block + 1  # blocks_per_sm + 1 of these overflow the SM
    return max(smem_bytes, -(-least // 128) * 128)


def pin_occupancy_of(kernel, device: int, smem_bytes: int, blocks_per_sm: int) -> int:
    """Dynamic shared memory for a launch of a compiled kernel (a CuPy function) that keeps at most
    ``blocks_per_sm`` of its blocks on an SM (the policy's ``programmatic_pin_occupancy``: a programmatic launch places
    a grid's blocks in whatever SM space the grid before leaves free, so a kernel planned at b blocks per SM that fits
    more would run some SMs stacked): ``smem_bytes`` where no more fit already,
    else pinned_smem's amount, the kernel's shared memory limit raised to it and the driver's occupancy query checking
    it. ``smem_bytes`` where the pinned amount is over the per-block limit or the query disagrees (the launch is then
    as unpinned)."""
    with rt_arrays.cupy().cuda.Device(device):
        if _resident_blocks(kernel, smem_bytes) <= blocks_per_sm:
            return smem_bytes
    _, _, smem_limit, sm_smem = device_properties(device)
    pinned = pinned_smem(smem_bytes, blocks_per_sm, sm_smem, RESERVED_SMEM_PER_BLOCK)
    if pinned > smem_limit:
        return smem_bytes
    with rt_arrays.cupy().cuda.Device(device):
        if pinned > max(48 * 1024, kernel.max_dynamic_shared_size_bytes):
            kernel.max_dynamic_shared_size_bytes = pinned
        return pinned if _resident_blocks(kernel, pinned) == blocks_per_sm else smem_bytes


_cluster_occupancy: dict[tuple[str, int, int], int] = {}


def resident_clusters(cfg: KernelConfig, device: int, grid: int) -> int:
    """Clusters of a cluster kernel the device keeps resident at once (cuOccupancyMaxActiveClusters through
    cuda-python), cached; a large number where the query is unavailable (then the plan keeps its clusters: they are
    never needed for correctness, only for speed). A GPC holds whole clusters only, so this can be below SMs /
    cluster size."""
    key = (cfg.name_expression, device, grid)
    if key not in _cluster_occupancy:
        try:
            from cuda.bindings import driver as drv

            kernel = get_kernel(cfg.name_expression, device, cfg.smem_bytes)
            config = drv.CUlaunchConfig()
            config.gridDimX, config.gridDimY, config.gridDimZ = grid, 1, 1
            config.blockDimX, config.blockDimY, config.blockDimZ = THREADS, 1, 1
            config.sharedMemBytes = cfg.smem_bytes
            err, active = drv.cuOccupancyMaxActiveClusters(drv.CUfunction(int(kernel.kernel.ptr)), config)
            _cluster_occupancy[key] = int(active) if err == drv.CUresult.CUDA_SUCCESS and active > 0 else 1 << 30
        except Exception:  # pragma: no cover - no cuda-python, or a driver without the query
            _cluster_occupancy[key] = 1 << 30
    return _cluster_occupancy[key]


def precompile(configs, device: int = 0, workers: int = 8) -> None:
    """Compile many instantiations in parallel threads (NVRTC runs outside the GIL); used by tests and bench."""
    from concurrent.futures import ThreadPoolExecutor

    todo = {(c.name_expression, c.smem_bytes) for c in configs}
    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(lambda nc: get_kernel(nc[0], device, nc[1]), sorted(todo)))


@functools.lru_cache(maxsize=None)
def device_properties(device: int) -> tuple[int, int, int, int]:
    """(compute capability as 10*major+minor, SM count, opt-in shared memory per block, shared memory per SM)."""
    cupy = rt_arrays.cupy()
    props = cupy.cuda.runtime.getDeviceProperties(device)
    return (10 * props["major"] + props["minor"], props["multiProcessorCount"],
            props["sharedMemPerBlockOptin"], props["sharedMemPerMultiprocessor"])


def config_for(act, weight, size_m: int, size_n: int, size_k: int, group_size: int, per_row_groups: bool,
               device: int = 0, policy: GemmPolicy | None = None) -> KernelConfig:
    """choose_config with the device's limits, for the default (fp32) reduction: the tile a launch on that device
    will use under ``policy`` (its cluster size follows the grid: cluster_blocks)."""
    cc, sms, smem_limit, sm_smem = device_properties(device)
    return choose_config(ScalarType.parse(act) if not isinstance(act, ScalarType) else act, weight, size_m, size_n,
                         size_k, group_size, per_row_groups, smem_limit, sm_smem=sm_smem, sms=sms,
                         pairs=pairs_possible(cc, True, policy), policy=policy)


# ---------------------------------------------------------------------------------------------------------------
# The record-level launch (docs/formats.md, "Launch record")
# ---------------------------------------------------------------------------------------------------------------
def _err(message: str) -> ValueError:
    return ValueError(message)


_TYPE_BY_CODE = {t.abi_code: t for t in ScalarType}


def check_launch(launch: MarlinLaunch, compute_capability: int, device_sms: int, smem_limit: int, sm_smem: int = 0,
                 policy: GemmPolicy | None = None) -> tuple[KernelConfig, int, int]:
    """Every rule a record can be checked against without knowing buffer extents (the rules of
    workbench.gemm_checks, plus the record's own fields), then the configuration ``policy`` chooses. Returns
    (config, sms, grid)."""
    if not isinstance(launch, MarlinLaunch):
        raise TypeError(f"expected a MarlinLaunch record, got {type(launch).__name__}")
    if launch.abi_version != ABI_VERSION:
        raise _err(f"abi_version = {launch.abi_version} is not supported (this build speaks {ABI_VERSION})")
    if launch.struct_size != ctypes.sizeof(MarlinLaunch):
        raise _err(f"struct_size = {launch.struct_size} does not match sizeof(MarlinLaunch) = "
                   f"{ctypes.sizeof(MarlinLaunch)}")
    if launch.flags & ~KNOWN_FLAGS:
        raise _err(f"flags = {launch.flags:#x} has unknown bits {launch.flags & ~KNOWN_FLAGS:#x}")
    codes = _TYPE_BY_CODE
    act = codes.get(launch.a_type)
    if act not in ACT_TYPES:
        raise _err(f"a_type = {launch.a_type} is not an activation type (f16 = 1, bf16 = 2)")
    if launch.c_type != launch.a_type or launch.scale_type != launch.a_type:
        raise _err(f"c_type = {launch.c_type} and scale_type = {launch.scale_type} must equal a_type = "
                   f"{launch.a_type} (16-bit activations)")
    weight = codes.get(launch.b_type)
    if weight not in GEMM_WEIGHT_TYPES:
        raise _err(f"b_type = {launch.b_type} is not a Marlin weight type "
                   f"({', '.join(f'{t} = {t.abi_code}' for t in GEMM_WEIGHT_TYPES)})")
    for name in ("a_scales", "b_bias", "global_scale"):
        if launch.pointer(name):
            raise _err(f"{name} is not supported with 16-bit activations (pass null)")
    m, n, k, lda = launch.prob_m, launch.prob_n, launch.prob_k, launch.lda
    checks.check_sizes(m, n, k)
    checks.check_row_stride(lda, k, "lda")
    flags = launch.flags
    has_zp = bool(flags & FLAG_HAS_ZERO_POINTS)
    if has_zp != bool(launch.pointer("zero_points")):
        raise _err(f"HAS_ZERO_POINTS flag = {has_zp} disagrees with zero_points = {launch.pointer('zero_points'):#x}")
    checks.check_zero_points(has_zp, weight)
    act_order = bool(flags & FLAG_HAS_ACT_ORDER)
    k_full = bool(flags & FLAG_IS_K_FULL)
    if act_order != bool(launch.pointer("group_index")) or act_order != bool(launch.pointer("permutation")):
        raise _err(f"HAS_ACT_ORDER flag = {act_order} needs group_index and permutation "
                   f"(got {launch.pointer('group_index'):#x}, {launch.pointer('permutation'):#x})")
    ng, gs = launch.num_groups, launch.group_size
    checks.check_act_order(weight, act_order, k_full, ng)
    checks.check_groups(weight, k, ng, act_order, k_full)
    if ng == 1:  # (the record carries the group size beside the count: they must agree)
        if gs not in (-1, k):
            raise _err(f"group_size = {gs} with num_groups = 1 must be -1 (channelwise) or size_k = {k}")
    elif gs != k // ng:
        raise _err(f"group_size = {gs} is not size_k / num_groups = {k} / {ng} = {k // ng}")
    atomic = bool(flags & FLAG_USE_ATOMIC_ADD)
    checks.check_reduction(atomic, bool(flags & FLAG_DETERMINISTIC))
    if compute_capability < 80:
        raise _err(f"the Marlin kernels need sm_80 or newer; device {launch.device} is sm_{compute_capability}")
    fp32_reduce = bool(flags & FLAG_USE_FP32_REDUCE) and not atomic
    checks.check_pointers({name: launch.pointer(name) for name in _POINTER_NAMES}, uses_c_tmp=fp32_reduce,
                          has_zero_points=has_zp, act_order=act_order)
    sms = launch.sms if launch.sms > 0 else device_sms
    if sms > device_sms:
        raise _err(f"sms = {sms} exceeds the device's {device_sms} SMs (blocks must all be resident)")
    per_row = act_order and not k_full
    group_size = -1 if ng == 1 else gs
    fp32_reduce = bool(flags & FLAG_USE_FP32_REDUCE) and not atomic
    cfg = choose_config(act, weight, max(m, 1), n, k, group_size, per_row, smem_limit,
                        launch.thread_k_init, launch.thread_n_init, sm_smem=sm_smem, sms=sms,
                        pairs=pairs_possible(compute_capability, fp32_reduce, policy), policy=policy)
    checks.check_pipeline_steps(pipeline_steps(cfg, max(m, 1), n, k))
    grid = grid_blocks(cfg, max(m, 1), n, k, sms, policy=policy)
    cluster = cluster_blocks(cfg, max(m, 1), n, k, grid, compute_capability, fp32_reduce, policy=policy)
    # cluster_blocks decides (a pair choice comes back from choose_config with cluster = 2; kept only where it applies)
    return dataclasses.replace(cfg, cluster=cluster), sms, grid


_POINTER_NAMES = ("a", "b", "c", "c_tmp", "b_scales", "zero_points", "group_index", "permutation", "a_tmp",
                  "workspace")  # what gemm_checks.check_pointers reads
_POINTER_FIELDS = tuple(f for f, t in MarlinLaunch._fields_ if t is ctypes.c_void_p)
_SCALARS_OFFSET = MarlinLaunch.prob_m.offset  # the record's non-pointer tail: sizes, types, device, sms, flags

# The argument blocks below, as 'p' (64-bit address) / 'i' (int32) per kernel parameter.
KERNEL_ARG_KINDS = {"marlin_gemm": "pppppppp" + "iiiiii" + "iiiiiiii", "permute_cols": "ppp" + "iii"}


def fast_div_plan(divisor: int) -> tuple[int, int]:
    """(magic, shift) for kernels_cuda/marlin_gemm.cu fast_div: n // divisor == (n * magic) >> shift for every
    0 <= n < 2**31, with shift = 31 + ceil(log2 divisor) and magic = ceil(2**shift / divisor) < 2**32, returned as
    the int32 with magic's bits (the kernel reads it back as unsigned)."""
    if not 1 <= divisor < 2**31:
        raise ValueError(f"fast_div_plan: divisor {divisor} is not in [1, 2**31)")
    shift = 31 + (divisor - 1).bit_length()
    magic = -(-(1 << shift) // divisor)
    return (magic - (1 << 32) if magic >= 1 << 31 else magic), shift


class PreparedLaunch:
    """One validated launch with everything but the addresses and the stream decided: kernel handle, grid, shared
    memory, scalar arguments, reduction mode. Built once per (shapes, dtypes, flags, device) from a record that
    passed ``check_launch``; ``launch`` then only checks the addresses (non-null where needed, 16-byte aligned) and
    launches: no allocation, no host synchronisation, no record.

    The kernel's arguments live in a workbench.cuda.ArgBlock reused by every call (a lock keeps two threads from
    interleaving fill and launch; the launch copies the block before it returns), launched through workbench.cuda's
    one launch call as a plain or (the policy's programmatic_launch, sm_90+) programmatic launch."""

    def __init__(self, launch: MarlinLaunch, cfg: KernelConfig, sms: int, grid: int,
                 policy: GemmPolicy | None = None):
        policy = self.policy = policy or _default()
        m, n, k = launch.prob_m, launch.prob_n, launch.prob_k
        flags = launch.flags
        self.device = launch.device
        self.cfg, self.sms, self.m, self.n, self.k = cfg, sms, m, n, k
        self.act_order = bool(flags & FLAG_HAS_ACT_ORDER)
        self.atomic = bool(flags & FLAG_USE_ATOMIC_ADD)
        self.uses_c_tmp = bool(flags & FLAG_USE_FP32_REDUCE) and not self.atomic
        self.has_zero_points = bool(flags & FLAG_HAS_ZERO_POINTS)
        self.mode = REDUCE_ATOMIC if self.atomic else (REDUCE_FP32 if flags & FLAG_USE_FP32_REDUCE else REDUCE_IN_C)
        self.group_size = -1 if launch.num_groups == 1 else launch.group_size
        self.lda = launch.lda
        self.smem = cfg.smem_bytes
        self.c_bytes = m * n * 2  # the atomic mode sums into C: zeroed first
        self.grid = grid  # (final once the kernel's residency is known: set_grid)
        self._lock = threading.Lock()
        self._kernel = self._permute = None
        self._function = self._permute_function = 0
        if m > 0:
            get_kernel(cfg.name_expression, self.device, self.smem)
            resident = resident_blocks(cfg.name_expression, self.device)
            if resident < cfg.blocks_per_sm:  # the driver keeps fewer blocks resident than planned: launch fewer
                self.grid = grid_blocks(cfg, m, n, k, sms, resident, policy=policy)
                if cfg.cluster > 1:  # (sm_90+ and fp32: the planned grid had clusters) the new grid's, if any
                    cfg = self.cfg = dataclasses.replace(
                        cfg, cluster=cluster_blocks(cfg, m, n, k, self.grid, 90, True, policy=policy))
            if cfg.cluster > 1 and self.grid // cfg.cluster > resident_clusters(cfg, self.device, self.grid):
                # clusters that do not all fit at once run in a second wave (the H200 keeps 30 clusters of 4 of a
                # one-block-per-SM kernel, not the 32 a 128-block grid needs: bench/cluster_occupancy.py); the same
                # grid sums in global memory instead
                cfg = self.cfg = dataclasses.replace(cfg, cluster=1)
            self._kernel = get_kernel(cfg.name_expression, self.device, self.smem)
            self._function = function_ptr(cfg.name_expression, self.device, self.smem)
            if self.act_order:
                name = f"mwb::permute_cols<{'__half' if cfg.act is ScalarType.F16 else '__nv_bfloat16'}>"
                self._permute = get_kernel(name, self.device)
                self._permute_function = function_ptr(name, self.device)
        # (8,) u64 addresses then (14,) i32 scalars: mwb::marlin_gemm's parameter list (KERNEL_ARG_KINDS, checked
        # against the source by tests/cpu)
        self._args = rt.ArgBlock(KERNEL_ARG_KINDS["marlin_gemm"])
        self._ptrs, self._ints, self._args_address = self._args.ptrs, self._args.ints, self._args.address
        self._ints[:] = self._kernel_ints()
        # permute_cols(A, perm, out, prob_m, prob_k, lda): (3,) u64 + (3,) i32
        self._perm_args = rt.ArgBlock(KERNEL_ARG_KINDS["permute_cols"])
        self._perm_args.ints[:] = (m, k, self.lda)
        self.launch_smem = self.smem  # what a programmatic launch asks for (pinned_smem)
        self.programmatic = m > 0 and programmatic_launches(self.device, policy.programmatic_launch)
        if self.programmatic and policy.programmatic_pin_occupancy:
            self.launch_smem = pin_occupancy_of(self._kernel, self.device, self.smem, cfg.blocks_per_sm)
        self._main = self._gather = None
        if m > 0:
            self._main = rt.Launch(self._function, self.grid, THREADS, self.launch_smem,
                                   programmatic=self.programmatic)
            self.programmatic = self.programmatic and self._main.supported  # (no driver bindings: plain)
            if self.act_order:  # (the gather before it stays a plain launch)
                self._gather = rt.Launch(self._permute_function, m, THREADS, 0)

    def _kernel_ints(self) -> list[int]:
        """The kernel's int32 arguments: problem, group size, reduction mode, then its division plan for this grid
        (the block ranges' steps per block, quotient and remainder, and fast_div_plan of the grid, of the k steps per
        slice and of the slices per m16 chunk)."""
        cfg, m, n, k = self.cfg, self.m, self.n, self.k
        kernel_lda = k if self.act_order else self.lda  # act-order runs on the gathered M x K copy in a_tmp
        head = [m, n, k, kernel_lda, self.group_size, self.mode]
        if m == 0:  # (never launched)
            return head + [0] * 8
        steps = pipeline_steps(cfg, m, n, k)
        return head + [steps // self.grid, steps % self.grid, *fast_div_plan(self.grid),
                       *fast_div_plan(k // cfg.block_k), *fast_div_plan(n // cfg.block_n)]

    def set_grid(self, blocks: int) -> None:
        """Launch ``blocks`` blocks instead of the planned grid (bench/sweep_gemm.py's forced grids): the kernel's
        division plan and the programmatic launch's configuration, built for the planned grid, follow."""
        self.grid = int(blocks)
        if self.m > 0:
            self._ints[:] = self._kernel_ints()
            self._main.set_grid(self.grid)

    def launch(self, a: int, b: int, c: int, c_tmp: int, scales: int, zero_points: int, group_index: int,
               permutation: int, a_tmp: int, workspace: int, stream: int) -> None:
        """Launch on raw addresses (ints, 0 = none) and a raw stream handle; ValueError before launching if one is
        null where the plan needs it or not 16-byte aligned."""
        if (a | b | c | c_tmp | scales | zero_points | group_index | permutation | a_tmp) & 15 or not (
                a and b and c and scales and workspace and (c_tmp or not self.uses_c_tmp)
                and (zero_points or not self.has_zero_points)
                and ((group_index and permutation and a_tmp) or not self.act_order)):
            self._refuse(dict(a=a, b=b, c=c, c_tmp=c_tmp, b_scales=scales, zero_points=zero_points,
                              group_index=group_index, permutation=permutation, a_tmp=a_tmp, workspace=workspace))
        if self.m == 0:
            return
        if not self.has_zero_points:
            zero_points = 0
        if not self.uses_c_tmp:
            c_tmp = 0
        if not self.act_order:
            group_index = 0
        cupy = rt_arrays.cupy()
        runtime = cupy.cuda.runtime
        if runtime.getDevice() != self.device:  # switch only when another device is current
            with cupy.cuda.Device(self.device):
                self._launch(a, b, c, c_tmp, scales, zero_points, group_index, permutation, a_tmp, workspace,
                             stream, runtime)
        else:
            self._launch(a, b, c, c_tmp, scales, zero_points, group_index, permutation, a_tmp, workspace, stream,
                         runtime)

    def _launch(self, a, b, c, c_tmp, scales, zero_points, group_index, permutation, a_tmp, workspace, stream,
                runtime):
        if self.atomic:
            runtime.memsetAsync(c, 0, self.c_bytes, stream)
        if not self.policy.direct_launch:
            self._launch_cupy(a, b, c, c_tmp, scales, zero_points, group_index, permutation, a_tmp, workspace,
                              stream)
            return
        launch = rt_launch.launch_kernel
        with self._lock:
            if self.act_order:
                pp = self._perm_args.ptrs
                pp[0], pp[1], pp[2] = a, permutation, a_tmp
                launch(self._gather, stream, self._perm_args.address)
                a = a_tmp
            p = self._ptrs
            p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7] = (a, b, c, c_tmp, scales, zero_points, group_index,
                                                              workspace)
            launch(self._main, stream, self._args_address)

    def _launch_cupy(self, a, b, c, c_tmp, scales, zero_points, group_index, permutation, a_tmp, workspace,
                     stream):
        s = rt.cupy_stream(stream)
        if self.act_order:
            self._permute((self.m,), (THREADS,), (_p(a), _p(permutation), _p(a_tmp), np.int32(self.m),
                                                  np.int32(self.k), np.int32(self.lda)), stream=s)
            a = a_tmp  # (the kernel's lda argument is then K: _kernel_ints)
        self._kernel((self.grid,), (THREADS,),
                     (_p(a), _p(b), _p(c), _p(c_tmp), _p(scales), _p(zero_points), _p(group_index), _p(workspace),
                      *(np.int32(v) for v in self._ints)),
                     shared_mem=self.smem, stream=s)

    def _refuse(self, pointers: dict[str, int]) -> None:
        checks.check_pointers(pointers, uses_c_tmp=self.uses_c_tmp, has_zero_points=self.has_zero_points,
                              act_order=self.act_order)
        raise AssertionError("refused a launch without a reason")  # pragma: no cover - the checks above mirror it


_MAX_PLANS = 4096  # cached plans per cache (a serving loop sees a few dozen shapes; the bound keeps a sweep finite)
_prepared: dict[tuple, PreparedLaunch] = {}


def _record_key(launch: MarlinLaunch) -> tuple:
    """Everything check_launch reads except addresses: the record's scalar tail and which pointers are null."""
    return (bytes(launch)[_SCALARS_OFFSET:],) + tuple(not getattr(launch, f) for f in _POINTER_FIELDS)


def prepare_launch(launch: MarlinLaunch, *, config: KernelConfig | None = None, grid: int | None = None,
                   policy: GemmPolicy | None = None) -> PreparedLaunch:
    """check_launch on the device's properties, then the prepared launch (cached per record layout and policy).

    ``config`` / ``grid`` force the kernel configuration and the number of blocks instead of choose_config /
    grid_blocks (bench/sweep_gemm.py times the alternatives): checked by ``_prepare_forced``, never cached."""
    if not isinstance(launch, MarlinLaunch):
        raise TypeError(f"expected a MarlinLaunch record, got {type(launch).__name__}")
    policy = policy or _default()
    if config is not None or grid is not None:
        return _prepare_forced(launch, config, grid, policy)
    key = (_record_key(launch), policy)
    prepared = _prepared.get(key)
    if prepared is None:
        cc, device_sms, smem_limit, sm_smem = device_properties(launch.device)
        cfg, sms, grid = check_launch(launch, cc, device_sms, smem_limit, sm_smem, policy)
        prepared = PreparedLaunch(launch, cfg, sms, grid, policy)
        if len(_prepared) >= _MAX_PLANS:
            _prepared.clear()
        _prepared[key] = prepared
    return prepared


def _prepare_forced(launch: MarlinLaunch, config: KernelConfig | None, grid: int | None,
                    policy: GemmPolicy) -> PreparedLaunch:
    """prepare_launch with a forced configuration and/or grid: every rule of check_launch, then ValueError unless the
    configuration is one the kernel computes this problem correctly with (same types and group mode, tile divides
    (K, N) and the group size, swap 1 / 2 only for M <= 8 / 16, two blocks per SM only with 16-row tiles, shared
    memory fits)
    and every block of the grid can be resident (the in-C and fp32 reductions wait on other blocks; the scratch buffers
    hold sms x blocks_per_sm blocks)."""
    cc, device_sms, smem_limit, sm_smem = device_properties(launch.device)
    default, sms, _ = check_launch(launch, cc, device_sms, smem_limit, sm_smem, policy)
    cfg = default if config is None else config
    if not isinstance(cfg, KernelConfig):
        raise TypeError(f"config must be a KernelConfig, got {type(cfg).__name__}")
    m, n, k = max(launch.prob_m, 1), launch.prob_n, launch.prob_k
    if (cfg.act, cfg.weight, cfg.group_mode) != (default.act, default.weight, default.group_mode):
        raise _err(f"config (act, weight, group_mode) = ({cfg.act}, {cfg.weight}, {cfg.group_mode}) does not match "
                   f"the problem's ({default.act}, {default.weight}, {default.group_mode})")
    if (cfg.n_tiles, cfg.k_warp) not in _THREAD_SHAPES or not 1 <= cfg.m_blocks <= 4:
        raise _err(f"config (m_blocks, n_tiles, k_warp) = ({cfg.m_blocks}, {cfg.n_tiles}, {cfg.k_warp}) is not a "
                   f"kernel shape (m_blocks 1..4, (n_tiles, k_warp) in {sorted(_THREAD_SHAPES)})")
    if k % cfg.block_k or n % cfg.block_n:
        raise _err(f"config tile (thread_k, thread_n) = ({cfg.block_k}, {cfg.block_n}) does not divide "
                   f"(size_k, size_n) = ({k}, {n})")
    group_size = -1 if launch.num_groups == 1 else launch.group_size
    if cfg.group_mode == GROUP_GROUPED and group_size % cfg.block_k and cfg.block_k % group_size:
        raise _err(f"config thread_k = {cfg.block_k} and group_size = {group_size}: neither divides the other")
    if cfg.blocks_per_sm not in (1, 2) or (cfg.blocks_per_sm == 2 and cfg.m_blocks != 1):
        raise _err(f"config blocks_per_sm = {cfg.blocks_per_sm} with m_blocks = {cfg.m_blocks}: 1, or 2 with "
                   f"m_blocks = 1")
    if cfg.swap not in (0, 1, 2):
        raise _err(f"config swap = {cfg.swap!r} is not 0, 1 or 2 (8-row halves of the swapped loop)")
    if cfg.swap and (cfg.m_blocks != 1 or m > 8 * cfg.swap):
        raise _err(f"config swap = {cfg.swap} needs m_blocks = 1 and size_m <= {8 * cfg.swap} "
                   f"(got {cfg.m_blocks}, {m})")
    limit = smem_limit if cfg.blocks_per_sm == 1 else two_block_smem(smem_limit, sm_smem)
    if cfg.smem_bytes > limit:
        raise _err(f"config needs {cfg.smem_bytes} bytes of shared memory; {cfg.blocks_per_sm} block(s) per SM "
                   f"leave {limit}")
    iterations = pipeline_steps(cfg, m, n, k)
    checks.check_pipeline_steps(iterations)
    if grid is None:
        grid = grid_blocks(cfg, m, n, k, sms, policy=policy)
    most = min(iterations, sms * cfg.blocks_per_sm)
    if isinstance(grid, bool) or not isinstance(grid, (int, np.integer)) or not 1 <= grid <= most:
        raise _err(f"grid = {grid!r} must be an int in [1, {most}] (min(pipeline steps = {iterations}, sms = {sms} "
                   f"x blocks_per_sm = {cfg.blocks_per_sm}))")
    fp32_reduce = bool(launch.flags & FLAG_USE_FP32_REDUCE) and not launch.flags & FLAG_USE_ATOMIC_ADD
    fits = cluster_blocks(cfg, m, n, k, int(grid), cc, fp32_reduce, enabled=True, sizes=KERNEL_CLUSTER_SIZES)
    if config is None:  # the default configuration: clusters where the policy would give this grid some
        cfg = dataclasses.replace(cfg, cluster=cluster_blocks(cfg, m, n, k, int(grid), cc, fp32_reduce,
                                                              policy=policy))
    elif cfg.cluster != 1 and cfg.cluster != fits:
        raise _err(f"config cluster = {cfg.cluster} needs sm_90+, the fp32 reduction, m_blocks = 1 and a grid of "
                   f"cluster x slices blocks with cluster in {KERNEL_CLUSTER_SIZES} and <= the slice's pipeline "
                   f"steps (got sm_{cc}, fp32 = {fp32_reduce}, m_blocks = {cfg.m_blocks}, grid = {grid}: cluster "
                   f"{fits} fits)")
    prepared = PreparedLaunch(launch, cfg, sms, int(grid), policy)
    if launch.prob_m > 0:
        resident = resident_blocks(cfg.name_expression, launch.device)
        if grid > sms * resident:
            raise _err(f"grid = {grid} blocks cannot all be resident: the driver keeps {resident} block(s) of "
                       f"{cfg.name_expression} per SM on {sms} SMs")
        prepared.set_grid(grid)  # (PreparedLaunch shrinks the planned grid when fewer blocks are resident)
    return prepared


def launch_marlin_mm(launch: MarlinLaunch) -> None:
    """Launch one GEMM described by a launch record (docs/formats.md, "Launch record"). Raises ValueError/TypeError
    before touching the GPU.

    The first record of a layout runs every check of ``check_launch``; later records with the same scalar fields and
    the same null pointers reuse that verdict and re-check only the addresses (``PreparedLaunch.launch``)."""
    prepared = prepare_launch(launch)
    ptr = launch.pointer
    prepared.launch(ptr("a"), ptr("b"), ptr("c"), ptr("c_tmp"), ptr("b_scales"), ptr("zero_points"),
                    ptr("group_index"), ptr("permutation"), ptr("a_tmp"), ptr("workspace"), ptr("stream"))


def _p(ptr: int) -> np.uint64:
    return np.uint64(ptr)


# ---------------------------------------------------------------------------------------------------------------
# Array-level API (vLLM names and argument order)
# ---------------------------------------------------------------------------------------------------------------
def _bf16():
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


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


def act_scalar_type(dtype) -> ScalarType:
    dtype = np.dtype(dtype)
    if dtype == np.float16:
        return ScalarType.F16
    if dtype == _bf16():
        return ScalarType.BF16
    raise TypeError(f"unsupported `a` dtype = {dtype}; the Marlin GEMM takes float16 or bfloat16 activations")


def act_numpy_dtype(act: ScalarType) -> np.dtype:
    return np.dtype(np.float16) if act is ScalarType.F16 else _bf16()


def _shape(x) -> tuple[int, ...]:
    return tuple(int(s) for s in x.shape)


def _numel(x) -> int:
    return int(np.prod(_shape(x))) if x is not None else 0


def _is_empty(x) -> bool:
    return x is None or _numel(x) == 0


def _contiguous(x) -> bool:
    flags = getattr(x, "flags", None)
    return bool(flags["C_CONTIGUOUS"]) if flags is not None else True


def _dtype_is(x, dtype, name: str) -> None:
    if np.dtype(x.dtype) != np.dtype(dtype):
        raise TypeError(f"{name} dtype = {np.dtype(x.dtype)} must be {np.dtype(dtype)}")


@dataclasses.dataclass(frozen=True)
class GemmPlan:
    """What the shape checks concluded: ferrum-kernels' ``MarlinMmProblem`` (m, n, k, lda, groups) plus the types and
    the act-order flags; turned into a ``MarlinMmRequest`` once device pointers are known."""

    act: ScalarType
    weight: ScalarType
    problem: MarlinMmProblem
    has_act_order: bool
    is_k_full: bool

    m = property(lambda self: self.problem.m)
    n = property(lambda self: self.problem.n)
    k = property(lambda self: self.problem.k)
    lda = property(lambda self: self.problem.lda)
    num_groups = property(lambda self: self.problem.num_groups)
    group_size = property(lambda self: self.problem.group_size)  # -1 = channelwise


def check_gemm_shapes(a, b_q_weight, b_scales, b_zeros, g_idx, perm, b_q_type, size_m: int, size_n: int,
                      size_k: int, is_k_full: bool, c=None) -> GemmPlan:
    """The host checks of docs/formats.md, "Host checks", on any array-like with .shape/.dtype/.strides; no GPU
    needed."""
    act = act_scalar_type(a.dtype)
    weight = ScalarType.parse(b_q_type)
    if weight not in GEMM_WEIGHT_TYPES:
        raise ValueError(f"b_q_type = {weight} is not a Marlin weight type")
    for name, v in (("size_m", size_m), ("size_n", size_n), ("size_k", size_k)):
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    checks.check_mnk(size_m, size_n, size_k)
    if len(_shape(a)) != 2:
        raise ValueError(f"a must be 2-D (M, K), got shape {_shape(a)}")
    if _shape(a)[0] != size_m:
        raise ValueError(f"Shape mismatch: a.size(0) = {_shape(a)[0]}, size_m = {size_m}")
    if _shape(a)[1] != size_k:
        raise ValueError(f"Shape mismatch: a.size(1) = {_shape(a)[1]}, size_k = {size_k}")
    checks.check_size_k(size_k)
    _dtype_is(b_q_weight, np.int32, "b_q_weight")
    if len(_shape(b_q_weight)) != 2:
        raise ValueError(f"b_q_weight must be 2-D (K/16, N*16/pack), got shape {_shape(b_q_weight)}")
    if _shape(b_q_weight)[0] != size_k // TILE_K:
        raise ValueError(f"Shape mismatch: b_q_weight.size(0) = {_shape(b_q_weight)[0]}, size_k = {size_k}, "
                         f"tile_size = {TILE_K}")
    if _shape(b_q_weight)[1] % TILE_K:
        raise ValueError(f"b_q_weight.size(1) = {_shape(b_q_weight)[1]} is not divisible by tile_size = {TILE_K}")
    actual_n = _shape(b_q_weight)[1] // TILE_K * weight.pack_factor
    if size_n != actual_n:
        raise ValueError(f"size_n = {size_n}, actual_size_n = {actual_n} (b_q_weight.size(1) = "
                         f"{_shape(b_q_weight)[1]}, pack_factor = {weight.pack_factor})")
    checks.check_size_n(size_n)
    item = np.dtype(a.dtype).itemsize
    strides = tuple(int(s) for s in a.strides)
    if size_m > 0 and strides[1] != item:
        raise ValueError(f"A.stride(1) is not 1 (strides in elements: {tuple(s // item for s in strides)})")
    lda = strides[0] // item if size_m > 1 else size_k
    if size_m > 1:
        checks.check_row_stride(lda, size_k, "A.stride(0)")
    if not _contiguous(b_q_weight):
        raise ValueError("b_q_weight is not contiguous")
    if c is not None:
        if _shape(c) != (size_m, size_n):
            raise ValueError(f"Shape mismatch: c.size(0) = {_shape(c)[0] if _shape(c) else '?'}, size_m = {size_m}"
                             f" (c has shape {_shape(c)}, expected ({size_m}, {size_n}))")
        if np.dtype(c.dtype) != np.dtype(a.dtype):
            raise TypeError(f"c dtype = {np.dtype(c.dtype)} must equal a dtype = {np.dtype(a.dtype)}")
        if not _contiguous(c):
            raise ValueError("c is not contiguous")
    if len(_shape(b_scales)) != 2:
        raise ValueError(f"b_scales rank = {len(_shape(b_scales))} is not 2")
    if _shape(b_scales)[1] != size_n:
        raise ValueError(f"b_scales dim 1 = {_shape(b_scales)[1]} is not size_n = {size_n}")
    if np.dtype(b_scales.dtype) != np.dtype(a.dtype):
        raise TypeError(f"b_scales dtype = {np.dtype(b_scales.dtype)} must equal a dtype = {np.dtype(a.dtype)}")
    if not _contiguous(b_scales):
        raise ValueError("b_scales is not contiguous")
    num_groups = _shape(b_scales)[0]
    has_act_order = not (_is_empty(g_idx) and _is_empty(perm))
    if has_act_order:
        g_len = _shape(g_idx)[-1] if g_idx is not None and _shape(g_idx) else 0
        p_len = _shape(perm)[-1] if perm is not None and _shape(perm) else 0
        if g_len != size_k or p_len != size_k:
            raise ValueError(f"Unexpected g_idx.size(-1) = {g_len} and perm.size(-1) = {p_len}, "
                             f"where size_k = {size_k}")
        _dtype_is(g_idx, np.int32, "g_idx")
        _dtype_is(perm, np.int32, "perm")
    checks.check_act_order(weight, has_act_order, is_k_full, num_groups)
    group_size = checks.check_groups(weight, size_k, num_groups, has_act_order, is_k_full, "b_scales.size(0)")
    has_zp = not _is_empty(b_zeros)
    checks.check_zero_points(has_zp, weight)
    if has_zp:
        _dtype_is(b_zeros, np.int32, "b_zeros")
        if len(_shape(b_zeros)) != 2:
            raise ValueError(f"b_zeros rank = {len(_shape(b_zeros))} is not 2")
        if _shape(b_zeros)[0] != num_groups:
            raise ValueError(f"b_zeros dim 0 = {_shape(b_zeros)[0]} is not num_groups = {num_groups}")
        if _shape(b_zeros)[1] != size_n // weight.pack_factor:
            raise ValueError(f"b_zeros dim 1 = {_shape(b_zeros)[1]} is not size_n / pack_factor = "
                             f"{size_n // weight.pack_factor}")
        if not _contiguous(b_zeros):
            raise ValueError("b_zeros is not contiguous")
    problem = MarlinMmProblem(m=size_m, n=size_n, k=size_k, lda=lda, num_groups=num_groups,
                              group_size=group_size if num_groups > 1 else -1)
    return GemmPlan(act, weight, problem, has_act_order, bool(is_k_full) or not has_act_order)


def _check_scratch(plan: GemmPlan, workspace, c_tmp, a_tmp, sms: int, use_fp32_reduce: bool,
                   use_atomic_add: bool) -> None:
    if workspace is None:
        raise ValueError("workspace is required: a zeroed int32 buffer of at least workspace_numel(sms) elements")
    _dtype_is(workspace, np.int32, "workspace")
    if _numel(workspace) < workspace_numel(sms):
        raise ValueError(f"workspace.numel = {_numel(workspace)} is below min_workspace_size = "
                         f"{workspace_numel(sms)}")
    if use_fp32_reduce and not use_atomic_add:
        if c_tmp is None:
            raise ValueError("use_fp32_reduce needs c_tmp (fp32, at least c_tmp_numel(sms) elements)")
        _dtype_is(c_tmp, np.float32, "c_tmp")
        if _numel(c_tmp) < c_tmp_numel(sms):
            raise ValueError(f"c_tmp.numel = {_numel(c_tmp)} is below c_tmp_numel(sms = {sms}) = {c_tmp_numel(sms)}")
    if plan.has_act_order:
        if a_tmp is None:
            raise ValueError("act-order needs a_tmp (an M x K buffer in the activation dtype)")
        if np.dtype(a_tmp.dtype) != act_numpy_dtype(plan.act):
            raise TypeError(f"a_tmp dtype = {np.dtype(a_tmp.dtype)} must equal the activation dtype")
        if _numel(a_tmp) < plan.m * plan.k:
            raise ValueError(f"a_tmp.numel = {_numel(a_tmp)} is below size_m * size_k = {plan.m * plan.k}")


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
              use_atomic_add, use_fp32_reduce, c, c_tmp, a_tmp, deterministic, sms, policy):
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
            or not isinstance(b_q_type, (str, ScalarType))):
        return None
    optional = (_meta(b_zeros, nd), _meta(g_idx, nd), _meta(perm, nd), _meta(c, nd), _meta(c_tmp, nd),
                _meta(a_tmp, nd))
    if _SLOW in optional:
        return None
    return (a.shape, a.strides, a.dtype, a.data.device_id, b_q_weight.shape, b_q_weight.strides, b_q_weight.dtype,
            b_scales.shape, b_scales.strides, b_scales.dtype, workspace.shape, workspace.dtype, optional, b_q_type,
            size_m, size_n, size_k, bool(is_k_full), bool(use_atomic_add), bool(use_fp32_reduce),
            bool(deterministic), sms, policy.token)


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
                     *, c=None, c_tmp=None, a_tmp=None, deterministic: bool = False, stream=None, sms: int = -1,
                     policy: GemmPolicy | None = None):
    """vLLM's ``gptq_marlin_gemm`` (with the newer ``use_atomic_add``): C = A @ dequant(B), on CuPy arrays, PyTorch
    CUDA tensors or any ``__cuda_array_interface__`` arrays (Numba's).

    ``b_zeros``/``g_idx``/``perm`` may be None or empty. ``c`` (M, N) is allocated when None, and so is ``a_tmp``
    for act-order; ``c_tmp`` None takes the per-(device, stream, SMs) buffer of ``scratch_buffers``. Pass ``c``,
    ``c_tmp``/``a_tmp`` and ``workspace`` to keep allocation out of the call (CUDA-graph capture).

    Every check runs on the first call with a given set of shapes, strides, dtypes, flags and device; repeated calls
    with the same ones (CuPy arrays) reuse that verdict and re-check only what can change under equal shapes: the
    device of every array and each address (non-null, 16-byte aligned).

    ``policy``: how the kernel, grid and launch are chosen (workbench.policy.GemmPolicy; None: the default).

    Frameworks: ``stream=None`` is the current stream of A's framework (``torch.cuda.current_stream()`` for a torch
    tensor, CuPy's otherwise; a torch / CuPy / Numba stream object or a raw handle may be passed), and what the call
    allocates (``c``, ``a_tmp``, the default ``c_tmp``) comes from A's framework's pool: torch's caching allocator for
    torch tensors (``c`` is then a torch tensor), CuPy's pool otherwise. Mixed inputs: A's framework wins.
    """
    if policy is None:
        policy = _default_policy
    key = _plan_key(a, b_q_weight, b_scales, b_zeros, g_idx, perm, workspace, b_q_type, size_m, size_n, size_k,
                    is_k_full, use_atomic_add, use_fp32_reduce, c, c_tmp, a_tmp, deterministic, sms, policy)
    plan = _array_plans.get(key) if key is not None else None
    if plan is None:
        if type(a) is not rt_arrays.cupy_array_type() and not isinstance(a, rt.DeviceArray) and _on_device(a):
            return _through_views(a, b_q_weight, b_scales, b_zeros, g_idx, perm, workspace, b_q_type, size_m,
                                  size_n, size_k, is_k_full, use_atomic_add, use_fp32_reduce, c, c_tmp, a_tmp,
                                  deterministic, stream, sms, policy)
        return _gptq_marlin_gemm_checked(key, a, b_q_weight, b_scales, b_zeros, g_idx, perm, workspace, b_q_type,
                                         size_m, size_n, size_k, is_k_full, use_atomic_add, use_fp32_reduce, c,
                                         c_tmp, a_tmp, deterministic, stream, sms, policy)
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
    plan.prepared.launch(pointers[0], pointers[1], c_ptr, c_tmp_ptr, pointers[2], pointers[3], pointers[4],
                         pointers[5], a_tmp_ptr, pointers[6], stream_ptr)
    return c


def _through_views(a, b_q_weight, b_scales, b_zeros, g_idx, perm, workspace, b_q_type, size_m, size_n, size_k,
                   is_k_full, use_atomic_add, use_fp32_reduce, c, c_tmp, a_tmp, deterministic, stream, sms, policy):
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
        n_sms = device_properties(device)[1] if sms <= 0 else sms
        c_tmp = scratch_buffers(device, stream_ptr, n_sms, framework)[1]
    vc = view(c, "c")
    gptq_marlin_gemm(va, *views[:6], b_q_type, size_m, size_n, size_k, is_k_full, use_atomic_add, use_fp32_reduce,
                     c=vc, c_tmp=view(c_tmp, "c_tmp"), a_tmp=view(a_tmp, "a_tmp"), deterministic=deterministic,
                     stream=stream_ptr, sms=sms, policy=policy)
    return c


def _outputs(plan: _ArrayPlan, c, a_tmp, cupy):
    if c is None:
        c = cupy.empty(plan.out_shape, dtype=plan.out_dtype)
    if a_tmp is None and plan.act_order:
        a_tmp = cupy.empty((max(plan.out_shape[0], 1), plan.prepared.k), dtype=plan.out_dtype)
    return c, a_tmp


def _gptq_marlin_gemm_checked(key, a, b_q_weight, b_scales, b_zeros, g_idx, perm, workspace, b_q_type, size_m,
                              size_n, size_k, is_k_full, use_atomic_add, use_fp32_reduce, c, c_tmp, a_tmp,
                              deterministic, stream, sms, policy, launch: bool = True):
    """Every check, in order, then the launch; the verdict is kept under ``key`` (None: not kept). With ``launch``
    False: the checks only, returning the plan (``plan_marlin_gemm``)."""
    checks.check_reduction(use_atomic_add, deterministic)
    plan = check_gemm_shapes(a, b_q_weight, b_scales, b_zeros, g_idx, perm, b_q_type, size_m, size_n, size_k,
                             is_k_full, c)
    if isinstance(sms, bool) or not isinstance(sms, (int, np.integer)):
        raise TypeError(f"sms must be an int, got {type(sms).__name__}")
    a_ptr, device = rt.device_pointer(a, "A")
    device_sms = device_properties(device)[1]
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
    _check_scratch(plan, workspace, c_tmp, a_tmp, sms, use_fp32_reduce, use_atomic_add)
    pointers = {}
    for name, x in (("b_q_weight", b_q_weight), ("b_scales", b_scales), ("c", c), ("workspace", workspace),
                    ("b_zeros", None if _is_empty(b_zeros) else b_zeros),
                    ("g_idx", g_idx if plan.has_act_order else None), ("perm", perm if plan.has_act_order else None),
                    ("c_tmp", c_tmp if uses_c_tmp else None),
                    ("a_tmp", a_tmp if plan.has_act_order else None)):
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
                                a_tmp=pointers["a_tmp"], workspace=pointers["workspace"]),
        problem=plan.problem,
        execution=MarlinMmExecution(device=device, stream=stream_ptr, sms=sms,
                                    has_act_order=plan.has_act_order, is_k_full=plan.is_k_full,
                                    use_atomic_add=use_atomic_add, use_fp32_reduce=use_fp32_reduce,
                                    deterministic=deterministic),
    )
    record = request.into_launch()
    prepared = prepare_launch(record, policy=policy)  # every record-level rule (check_launch) on this first call
    array_plan = _ArrayPlan(prepared, device, sms, (size_m, size_n), np.dtype(a.dtype), uses_c_tmp,
                            plan.has_act_order)
    if key is not None:
        if len(_array_plans) >= _MAX_PLANS:
            _array_plans.clear()
        _array_plans[key] = array_plan
    if not launch:
        return array_plan
    ptr = record.pointer
    prepared.launch(ptr("a"), ptr("b"), ptr("c"), ptr("c_tmp"), ptr("b_scales"), ptr("zero_points"),
                    ptr("group_index"), ptr("permutation"), ptr("a_tmp"), ptr("workspace"), stream_ptr)
    return c


# ---------------------------------------------------------------------------------------------------------------
# MarlinWeight convenience
# ---------------------------------------------------------------------------------------------------------------
def upload_weight(weight):
    """A copy of a ``MarlinWeight`` whose arrays live on the current CuPy device."""
    cupy = rt_arrays.cupy()
    up = (lambda x: None if x is None else cupy.asarray(np.ascontiguousarray(x)))
    return dataclasses.replace(weight, qweight=up(weight.qweight), scales=up(weight.scales), zeros=up(weight.zeros),
                               g_idx=up(weight.g_idx), perm=up(weight.perm))


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
                stream=None, sms: int = -1, policy: GemmPolicy | None = None):
    """C = a @ dequant(weight) for a ``MarlinWeight`` on the GPU (see ``upload_weight``). a: (M, K) CuPy array or
    another framework's (see gptq_marlin_gemm: streams and allocations follow a's framework).

    Numerics: fp32 accumulation, one rounding to the activation type at the end. Most integer-weight kernels at
    M <= 16 (``KernelConfig.late_scale``; not act-order groups) apply the scales to fp32 partial sums, so the weight is
    never rounded to the activation type there: results may differ from a @ (the rounded dequantized weight) by one
    rounding more, towards the exact product."""
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
        n_sms = device_properties(device)[1] if sms <= 0 else sms
        ws, ct = scratch_buffers(device, stream_ptr, n_sms, framework)
        workspace = ws if workspace is None else workspace
        c_tmp = ct if c_tmp is None else c_tmp
    k_full = weight.is_k_full if is_k_full is None else is_k_full
    size_m = int(a.shape[0]) if len(a.shape) == 2 else -1
    return gptq_marlin_gemm(a, weight.qweight, weight.scales, weight.zeros, weight.g_idx, weight.perm, workspace,
                            weight.weight_type, size_m, weight.size_n, weight.size_k, is_k_full=k_full,
                            use_atomic_add=use_atomic_add, use_fp32_reduce=use_fp32_reduce, c=c, c_tmp=c_tmp,
                            a_tmp=a_tmp, deterministic=deterministic, stream=stream_ptr, sms=sms, policy=policy)


def _on_device(x) -> bool:
    try:
        rt.as_device_array(x, "x")
    except TypeError:
        return False
    return True


def plan_marlin_gemm(a, weight, *, c, workspace, c_tmp=None, a_tmp=None, is_k_full: bool | None = None,
                     use_atomic_add: bool = False, use_fp32_reduce: bool = True, deterministic: bool = False,
                     stream=None, sms: int = -1, policy: GemmPolicy | None = None) -> PreparedLaunch:
    """Every check ``marlin_gemm`` makes on these arrays, without launching: the ``PreparedLaunch`` that runs the
    same problem on any addresses (``launch``). For callers that launch many GEMMs of one shape at row or expert
    offsets of buffers already checked once (``MoE.gemm_phase_batched``); M > 0."""
    if getattr(weight, "num_experts", None) is not None:
        raise ValueError("weight is a stack of experts; pick one with weight.expert(e)")
    size_m = int(a.shape[0]) if len(a.shape) == 2 else -1
    k_full = weight.is_k_full if is_k_full is None else is_k_full
    return _gptq_marlin_gemm_checked(None, a, weight.qweight, weight.scales, weight.zeros, weight.g_idx, weight.perm,
                                     workspace, weight.weight_type, size_m, weight.size_n, weight.size_k, k_full,
                                     use_atomic_add, use_fp32_reduce, c, c_tmp, a_tmp, deterministic, stream, sms,
                                     policy or _default(), launch=False).prepared


# ---------------------------------------------------------------------------------------------------------------
# The default policy, and the old module globals (deprecated: they read and write it for one release)
# ---------------------------------------------------------------------------------------------------------------
_default_policy: GemmPolicy = DEFAULT_GEMM_POLICY


def _default() -> GemmPolicy:
    """The policy of calls that pass none (DEFAULT_GEMM_POLICY unless a deprecated module global was set)."""
    return _default_policy


install_deprecated_globals(__name__, GEMM_GLOBALS, "workbench.policy.DEFAULT_GEMM_POLICY")
