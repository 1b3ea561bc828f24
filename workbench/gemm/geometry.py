"""Tile geometry and config choice of the dense Marlin GEMM: the kernel's block shapes and shared memory
(``TileGeometry``, ``KernelConfig``), which instantiation a problem runs (``choose_config``), on how many blocks
(``grid_blocks``) and in which clusters (``cluster_blocks``), and the scratch sizes every configuration fits.

Pure functions of the problem, the device's limits and a ``GemmPolicy``: no GPU, no CuPy.
"""
from __future__ import annotations

import dataclasses
import math
import sys

from workbench.policy import GemmPolicy, lookup
from workbench.scalar_types import ScalarType

# The package's namespace, which holds the default policy (workbench.gemm._default_policy): read through the dict,
# since an attribute of a module whose class has __getattr__ (the deprecated globals) costs a Python-level call.
_package = sys.modules[__package__].__dict__


def default_policy() -> GemmPolicy:
    """The policy of calls that pass none (DEFAULT_GEMM_POLICY unless a deprecated module global was set)."""
    return _package["_default_policy"]


_default = default_policy

THREADS = 256
MAX_BLOCK_M = 64  # rows of one block tile (4 m16 blocks)
MAX_BLOCK_N = 256

REDUCE_IN_C, REDUCE_FP32, REDUCE_ATOMIC = 0, 1, 2  # kernels_cuda/marlin_gemm.cu ReduceMode
GROUP_CHANNELWISE, GROUP_GROUPED, GROUP_PER_ROW = 0, 1, 2  # kernels_cuda/marlin_mainloop.cuh GroupMode


# ---------------------------------------------------------------------------------------------------------------
# Shapes that are not tile multiples (docs/formats.md, "Shapes that are not tile multiples")
# ---------------------------------------------------------------------------------------------------------------
def tiled_n(size_n: int) -> int:
    """The width of a weight's Marlin arrays: size_n rounded up to whole 64-column tiles (the padding is zeros)."""
    return -(-size_n // 64) * 64


def k_steps(size_k: int, block_k: int) -> int:
    """Pipeline steps of one slice: ceil(K / block_k) (the kernel's KI; the last step may run past K)."""
    return -(-size_k // block_k)


def tile_k(size_k: int, group_size: int) -> int:
    """The K a tile shape must divide in choose_config: size_k itself where it comes in k16 tiles and whole groups
    (every shape the kernel took before it predicated the edges plans as it did), else size_k rounded up to 128, so
    an odd K runs the tile of the next aligned K (its last step partly past K) rather than the largest tile that
    divides it (10944 = 171 x 64: 64-row steps)."""
    if size_k % 16 == 0 and (group_size <= 0 or size_k % group_size == 0):
        return size_k
    return -(-size_k // 128) * 128


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
        fits = self.swap == 1 or (self.blocks_per_sm == 1 and self.k_warp >= 2)
        return not getattr(self, "invariant", False) and self.m_blocks == 1 and self.group_mode != GROUP_PER_ROW \
            and self.weight is not ScalarType.FE4M3FN and self.weight is not ScalarType.FE2M1F and not getattr(self, "e8m0_scales", False) \
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
    # the operand-swapped loop (template argument SWAP; 0: row layout): 1 for M <= 8, one mma per 16x16 sub-block
    # instead of two; bools read as 0 / 1
    swap: int = 0
    cluster: int = 1  # > 1: blocks per thread-block cluster, slices summed in shared memory (marlin_gemm_cluster)
    # the weight's scales are E8M0 codes (MXFP4, MXFP8): the kernel's weight code is the type's + 16 (dequant.cuh)
    e8m0_scales: bool = False
    # the batch-invariant kernels (marlin_gemm_invariant / marlin_gemm_cluster_invariant): never late-scaled, so a
    # 16-row kernel sums a row as the 32..64-row kernels of its tile do
    invariant: bool = False
    # (invariant, four m16 blocks, fp32 reduction, s > 1 blocks per slice) one launch walks every 64-row chunk of A
    # on the one-chunk partition (marlin_gemm_invariant's WALK)
    walk: bool = False
    # (invariant, one m16 block) > 0: each stage merges k_warp / k_base stages of the k_warp = k_base tile and sums
    # them as that tile does (WarpLoop's K_BASE): the same bits as the k_base tile's kernels
    k_base: int = 0

    @property
    def name_expression(self) -> str:
        t = "__half" if self.act is ScalarType.F16 else "__nv_bfloat16"
        code = self.weight.abi_code + 16 * self.e8m0_scales
        args = (f"{t}, {code}, {self.m_blocks}, {self.n_tiles}, {self.k_warp}, {self.stages}, "
                f"{self.group_mode}, {self.blocks_per_sm}, {int(self.swap)}")
        if self.invariant:
            if self.cluster > 1:
                return f"mwb::marlin_gemm_cluster_invariant<{args}, {self.cluster}, {self.k_base}>"
            return f"mwb::marlin_gemm_invariant<{args}, {int(self.walk)}, {self.k_base}>"
        if self.cluster > 1:
            return f"mwb::marlin_gemm_cluster<{args}, {self.cluster}>"
        return f"mwb::marlin_gemm<{args}>"


# (n_tiles, k_warp) -> (thread_k, thread_n) = (block_k, block_n): every tile the kernel instantiates. Which ones a
# launch tries, and in what order, is the policy's (workbench.policy.GemmPolicy).
THREAD_SHAPES = {(2, 4): (256, 128), (2, 2): (128, 128), (1, 1): (128, 64), (4, 2): (64, 256), (2, 1): (64, 128),
                  (1, 2): (256, 64), (1, 4): (512, 64), (2, 8): (512, 128)}


def thread_shapes() -> dict[tuple[int, int], tuple[int, int]]:
    return dict(THREAD_SHAPES)


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


def swap_halves(size_m: int, policy: GemmPolicy | None = None) -> int:
    """KernelConfig.swap for M rows under the policy's ``swap_max_m``: 1 (the operand-swapped loop) for at most 8
    rows, 0 for the row layout."""
    return 1 if size_m <= min((policy or _default()).swap_max_m, 8) else 0


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
    # tiles of the padded width; K steps rounded up (tile_k: the K tile shapes must divide)
    size_n, k_fit = tiled_n(size_n), tile_k(size_k, -1 if per_row_groups else group_size)
    m_blocks = min(4, max(1, math.ceil(size_m / 16)))
    group_mode = GROUP_PER_ROW if per_row_groups else (GROUP_CHANNELWISE if group_size == -1 else GROUP_GROUPED)
    # kernels of weights without zero points or act-order groups (swapped: their own thresholds below)
    plain = not weight.has_zero_points and not per_row_groups
    variant = dict(swap=swap_halves(size_m, policy=p))
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
            tk, tn = THREAD_SHAPES[(n_tiles, k_warp)]
            if (thread_k, thread_n) != (-1, -1) and (tk, tn) != (thread_k, thread_n):
                continue
            if k_fit % tk or size_n % tn:
                continue
            if group_size > 0 and not per_row_groups and group_size % tk and tk % group_size:
                continue
            if (n_tiles, k_warp) == rows_wide_tile and k_steps(size_k, tk) < p.rows_wide_min_steps:
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
            tk, tn = THREAD_SHAPES[(n_tiles, k_warp)]
            slices = size_n // tn
            if not p.pair_min_fill * sms <= 2 * slices <= sms:
                continue
            steps = k_steps(size_k, tk) // 2  # per block
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
            tk, tn = THREAD_SHAPES[first]
            if p.pair_two_block_min_fill * sms <= size_n // tn <= sms and k_steps(size_k, tk) >= 2:
                return next((cfg for stages in p.two_block_pair_stages
                             for cfg in [KernelConfig(act, weight, m_blocks, n_tiles, k_warp, stages, group_mode,
                                                      blocks_per_sm=2, cluster=2, **variant)]
                             if cfg.smem_bytes <= half_smem), None)
        # 8-bit fp16 kernels at M = 9..16 (rows layout): the first tile whose slices fill the SMs so, two blocks per
        # SM in pairs where one fits half an SM (pair_two_block_eight_bit_rows).
        if p.pair_two_block_eight_bit_rows and weight.bits == 8 and not variant["swap"] and plain \
                and act is ScalarType.F16 and sm_smem > 0:
            for n_tiles, k_warp in shapes():
                tk, tn = THREAD_SHAPES[(n_tiles, k_warp)]
                # (at most pair_max_steps per block, as the one-block pairs: no longer range was measured)
                steps = k_steps(size_k, tk)
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
            steps = (size_n // two.block_n) * k_steps(size_k, two.block_k)
            min_steps = p.two_blocks_min_steps_swap if plain_swap else p.two_blocks_min_steps
            if sms <= 0 or steps >= min_steps * 2 * sms:
                return two
    tried = []
    # (last resort: K rounded up to 128, whose last step runs past K, where no tile divides K itself)
    for k_try in dict.fromkeys((k_fit, -(-size_k // 128) * 128)):
        for n_tiles, k_warp in order:
            tk, tn = THREAD_SHAPES[(n_tiles, k_warp)]
            if (thread_k, thread_n) != (-1, -1) and (tk, tn) != (thread_k, thread_n):
                continue
            tried.append((tk, tn))
            if k_try % tk or size_n % tn:
                continue
            if group_size > 0 and not per_row_groups and group_size % tk and tk % group_size:
                continue
            for stages in stage_order:
                cfg = KernelConfig(act, weight, m_blocks, n_tiles, k_warp, stages, group_mode, **variant)
                if cfg.smem_bytes <= smem_limit:
                    return cfg
    raise ValueError(
        f"Invalid thread config: no (thread_k, thread_n) in {sorted(set(tried)) or [(thread_k, thread_n)]} divides "
        f"(size_k, size_n) = ({size_k}, {size_n}) (planned as ({k_fit}, {size_n})) within {smem_limit} bytes of "
        f"shared memory")


def pipeline_steps(cfg: KernelConfig, size_m: int, size_n: int, size_k: int) -> int:
    """The kernel's (slice, k step) iterations: m chunks x column slices x k steps per slice."""
    return math.ceil(size_m / cfg.block_m) * (tiled_n(size_n) // cfg.block_n) * k_steps(size_k, cfg.block_k)


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
    slices = chunks * (tiled_n(size_n) // cfg.block_n)
    ki = k_steps(size_k, cfg.block_k)
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


# ---------------------------------------------------------------------------------------------------------------
# The batch-invariant partition (docs/performance.md, "Batch invariance")
# ---------------------------------------------------------------------------------------------------------------
def _stage_order(weight: ScalarType, m_blocks: int, p: GemmPolicy) -> tuple:
    """choose_config's stage order for kernels of ``m_blocks`` m16 blocks (one block per SM)."""
    if m_blocks == 1:
        return p.one_block_stages(weight.bits)
    return p.two_m_block_stages if m_blocks == 2 else p.large_m_stages


def choose_invariant_config(act: ScalarType, weight: ScalarType, size_m: int, size_n: int, size_k: int,
                            group_size: int, per_row_groups: bool, smem_limit: int, thread_k: int = -1,
                            thread_n: int = -1, policy: GemmPolicy | None = None) -> KernelConfig:
    """The batch-invariant configuration: the first of the policy's ``invariant_shapes`` that divides (K, N) and the
    group size and fits shared memory at every m16 block count, as a batch-invariant kernel (``invariant``: never
    late-scaled, so its 16-row kernel sums a row as the 32..64-row kernels of the tile do); the swapped loop for
    M <= ``swap_max_m`` where ``invariant_swap`` (it sums a row as the row layout on the same tile). One block per SM,
    no cluster of its own choosing; only ``m_blocks`` (and so the stages) and the swap follow M, and a row's sums
    depend on neither. ValueError naming the shapes tried otherwise."""
    p = policy or _default()
    m_blocks = min(4, max(1, math.ceil(size_m / 16)))
    group_mode = GROUP_PER_ROW if per_row_groups else (GROUP_CHANNELWISE if group_size == -1 else GROUP_GROUPED)
    tried = []
    # (as choose_config plans shapes that are not tile multiples: N over its 64-column tiles, K by tile_k)
    n_plan, k_plan = tiled_n(size_n), tile_k(size_k, -1 if per_row_groups else group_size)
    swap = swap_halves(size_m, policy=p) if p.invariant_swap else 0
    for n_tiles, k_warp in p.invariant_shapes:
        tk, tn = THREAD_SHAPES[(n_tiles, k_warp)]
        if (thread_k, thread_n) != (-1, -1) and (tk, tn) != (thread_k, thread_n):
            continue
        tried.append((tk, tn))
        if k_plan % tk or n_plan % tn:
            continue
        if group_size > 0 and not per_row_groups and group_size % tk and tk % group_size:
            continue

        def fitting(mb):
            return next((cfg for stages in _stage_order(weight, mb, p)
                         for cfg in [KernelConfig(act, weight, mb, n_tiles, k_warp, stages, group_mode,
                                                  invariant=True)]
                         if cfg.smem_bytes <= smem_limit), None)

        fits = [fitting(mb) for mb in (1, 2, 3, 4)]
        if None in fits:
            continue
        return dataclasses.replace(fits[m_blocks - 1], swap=swap if m_blocks == 1 else 0)
    raise ValueError(
        f"batch_invariant: no (thread_k, thread_n) in {tried or [(thread_k, thread_n)]} (GemmPolicy.invariant_shapes) "
        f"divides (size_k, size_n) = ({size_k}, {size_n}) and group size {group_size} within {smem_limit} bytes of "
        f"shared memory")


def _merged(cfg: KernelConfig, size_k: int, split: int, smem_limit: int, p: GemmPolicy) -> KernelConfig:
    """The 16-row invariant kernel with F = ``invariant_merge[bits]`` stages of its tile merged into one
    (KernelConfig.k_base), where every block's range of the partition is whole merged stages (K a multiple of the
    merged depth, the split dividing the slice's steps and F their share) and a ring of the merged stages fits
    (``invariant_merge_stages``); else ``cfg``. (Groups are powers of two, so one of a group and the merged depth
    divides the other.)"""
    merge = lookup(p.invariant_merge, cfg.weight.bits, 1)
    if merge <= 1 or cfg.m_blocks != 1 or cfg.group_mode == GROUP_PER_ROW or cfg.k_base or cfg.e8m0_scales \
            or cfg.weight is ScalarType.FE2M1F:  # (microscaled weights: not measured merged)
        return cfg
    ki = k_steps(size_k, cfg.block_k)
    if size_k % (cfg.block_k * merge) or ki % split or (ki // split) % merge:
        return cfg
    for stages in p.invariant_merge_stages:
        wide = dataclasses.replace(cfg, k_warp=cfg.k_warp * merge, k_base=cfg.k_warp, stages=stages)
        if wide.smem_bytes <= smem_limit:
            return wide
    return cfg


def invariant_split(cfg: KernelConfig, size_n: int, size_k: int, device_sms: int,
                    policy: GemmPolicy | None = None) -> int:
    """Blocks per column slice of the batch-invariant partition: ``invariant_blocks`` (at most the device's SMs)
    over the slices of one 64-row chunk, at most one per ``invariant_min_steps`` k steps, at least 1. A function of
    the layer, the tile and the device only: never of M or of the ``sms`` a launch is given."""
    p = policy or _default()
    if cfg.k_base:  # (a merged 16-row kernel: the partition is its tile's)
        cfg = dataclasses.replace(cfg, k_warp=cfg.k_base, k_base=0)
    cols, ki = tiled_n(size_n) // cfg.block_n, k_steps(size_k, cfg.block_k)
    blocks = min(p.invariant_blocks, device_sms)
    return max(1, min(blocks // cols, ki // max(1, p.invariant_min_steps)))


def invariant_launches(cfg: KernelConfig, size_m: int, size_n: int, size_k: int, sms: int, split: int,
                       walk: bool = False) -> tuple[tuple[int, int, int], ...]:
    """The launches of the batch-invariant partition, (first row, rows, grid) each. Every launch gives each of its
    column slices ``split`` blocks of its own (block c split + j sums k steps [floor(j KI / split),
    floor((j + 1) KI / split)) of slice c: the same ranges whatever the number of slices), so a row's partials and
    their fp32 sum in block order are the same for every M. With ``split`` = 1 one launch takes every slice on the
    largest grid <= ``sms`` that divides their count (whole slices per block). Else a launch holds as many 64-row
    chunks as ``sms`` blocks take at once (every block must be resident); ValueError if one chunk needs more. ``walk``
    (the chunk-walking kernel can run it: see invariant_plan): where a launch holds one chunk only, one launch of that
    chunk's blocks walks all of them instead of one launch per chunk."""
    chunk = cfg.block_m
    chunks = math.ceil(size_m / chunk)
    cols = tiled_n(size_n) // cfg.block_n
    if split == 1:
        slices = chunks * cols
        grid = next(g for g in range(min(sms, slices), 0, -1) if slices % g == 0)
        return ((0, size_m, grid),)
    per_chunk = cols * split
    if per_chunk > sms:
        raise ValueError(f"batch_invariant: this layer's partition gives each of its {cols} column slices {split} "
                         f"blocks ({per_chunk} resident at once); sms = {sms} is fewer (pass sms >= {per_chunk}, or "
                         f"a policy with a smaller invariant_blocks)")
    if walk and sms // per_chunk == 1:
        return ((0, size_m, per_chunk),)
    rows = (sms // per_chunk) * chunk
    return tuple((r0, min(rows, size_m - r0), math.ceil(min(rows, size_m - r0) / chunk) * per_chunk)
                 for r0 in range(0, size_m, rows))


def invariant_plan(cfg: KernelConfig, size_m: int, size_n: int, size_k: int, sms: int, device_sms: int,
                   compute_capability: int, fp32_reduce: bool, policy: GemmPolicy | None = None,
                   smem_limit: int = 0) -> tuple[KernelConfig, tuple[tuple[int, int, int], ...]]:
    """What a batch-invariant call of ``cfg`` (choose_invariant_config's) launches: the configuration of its (first)
    launch and the launches (invariant_launches). The configuration gets its cluster size (cluster_blocks with the
    policy's ``invariant_cluster_sizes``: a slice's blocks summed in a cluster at M <= 16, in the fp32 slots' order),
    ``walk`` (one launch walking every 64-row chunk: the policy's ``invariant_walk``, four m16 blocks, the fp32
    reduction, ``split`` > 1, more than one chunk and at most ``invariant_walk_max_steps`` k steps per block and
    chunk) and, with ``smem_limit`` > 0, the 16-row kernel's merged stages where the policy's ``invariant_merge`` and
    the partition allow (_merged; a merged ``cfg`` stays so)."""
    p = policy or _default()
    cfg = dataclasses.replace(cfg, cluster=1, walk=False)
    split = invariant_split(cfg, size_n, size_k, device_sms, p)
    if smem_limit > 0:
        cfg = _merged(cfg, size_k, split, smem_limit, p)
    walk = (p.invariant_walk and fp32_reduce and cfg.m_blocks == 4 and 1 < split and size_m > cfg.block_m
            and -(-k_steps(size_k, cfg.block_k) // split) <= p.invariant_walk_max_steps)
    launches = invariant_launches(cfg, size_m, size_n, size_k, sms, split, walk=walk)
    if walk and len(launches) == 1 and launches[0][2] == tiled_n(size_n) // cfg.block_n * split:
        return dataclasses.replace(cfg, walk=True), launches
    _, rows, grid = launches[0]
    cluster = cluster_blocks(cfg, rows, size_n, size_k, grid, compute_capability, fp32_reduce,
                             sizes=p.invariant_cluster_sizes, policy=p)
    return dataclasses.replace(cfg, cluster=cluster), launches


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
    slices = math.ceil(size_m / cfg.block_m) * (tiled_n(size_n) // cfg.block_n)
    s, rest = divmod(grid, slices)
    allowed = p.cluster_sizes if sizes is None else sizes
    return s if rest == 0 and s in allowed and s in KERNEL_CLUSTER_SIZES and s <= k_steps(size_k, cfg.block_k) else 1


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

