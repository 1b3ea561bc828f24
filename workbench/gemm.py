"""Native Marlin GEMM (``kernels_cuda/marlin_gemm.cu``), compiled at first use through ``cupy.RawModule``.

Three entry points, each one layer on top of the next:

* ``launch_marlin_mm(record)`` — the seed's ABI: a ``MarlinLaunch`` record of raw device pointers
  (``workbench.gemm_abi``). Checks everything a record can say (types, flags, sizes, alignment) and launches.
  No allocation and no host synchronisation: capturable in a CUDA graph.
* ``gptq_marlin_gemm(a, b_q_weight, b_scales, b_zeros, g_idx, perm, workspace, b_q_type, size_m, size_n, size_k,
  ...)`` — vLLM's op and argument order, on CuPy arrays. Checks every shape, dtype and device rule (spec §7.6)
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
import os
import pathlib
import re
import threading
from typing import Any

import numpy as np

from workbench.gemm_abi import (
    ABI_VERSION, ACT_TYPES, FLAG_DETERMINISTIC, FLAG_HAS_ACT_ORDER, FLAG_HAS_ZERO_POINTS, FLAG_IS_K_FULL,
    FLAG_USE_ATOMIC_ADD, FLAG_USE_FP32_REDUCE, GEMM_WEIGHT_TYPES, KNOWN_FLAGS, MarlinLaunch, MarlinMmBuffers,
    MarlinMmExecution, MarlinMmProblem, MarlinMmRequest,
)
from workbench.scalar_types import ScalarType

KERNEL_DIR = pathlib.Path(__file__).resolve().parent.parent / "kernels_cuda"
KERNEL_SOURCE = "marlin_gemm.cu"

THREADS = 256
TILE_N = 64  # Marlin tile width (spec §2.1)
TILE_K = 16
MAX_BLOCK_M = 64  # rows of one block tile (4 m16 blocks)
MAX_BLOCK_N = 256
GROUP_SIZES = (32, 64, 128)  # grouped scales the kernel stages per pipeline step

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
    # 16x16 sub-block instead of two), 2 for M <= 16 (the policy's only under SWAP_MAX_M = 16); bools read as 0 / 1
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


# (n_tiles, k_warp) -> (thread_k, thread_n) = (block_k, block_n). Small M streams weights: the first choices keep
# BK large so that the fixed cost of a pipeline step (barrier, address math, fetch issue) is spread over more
# tiles; large M reuses each A stage over 256 columns.
# (1, 2), 256 x 64, before (1, 1), 128 x 64 (round 11): where 64-column slices are what fill the SMs (the pair
# policy on 4096-column layers), its blocks run half as many steps of twice the bytes, and late scaling spans two
# k16 tiles. Sweep r11a on the H200, u4b8 g128 fp16, µs (128 x 64 -> 256 x 64, pairs): 4096^2 M = 1 8.11 -> 7.27,
# M = 8 8.11 -> 7.28, M = 16 8.88 -> 7.98; 14336x4096 M = 1 (the 256 x 128 tile, one block per SM) 14.84 -> 13.88;
# FP8 4096^2 M = 1 8.98 -> 8.55.
_SMALL_M_SHAPES = ((2, 4), (2, 2), (1, 2), (1, 1), (2, 1), (4, 2))
_LARGE_M_SHAPES = ((4, 2), (2, 2), (2, 1), (1, 1))
_THREAD_SHAPES = {(2, 4): (256, 128), (2, 2): (128, 128), (1, 1): (128, 64), (4, 2): (64, 256), (2, 1): (64, 128),
                  (1, 2): (256, 64), (1, 4): (512, 64), (2, 8): (512, 128)}
# 8 stages keep ~7 weight stages in flight per SM for small M (HBM needs tens of KiB in flight per SM); 4 else.
_DEEP_STAGES, _STAGES = 8, 4
# Kernels with one m16 block (M <= 16) and one block per SM: stage counts in order of preference, per weight bits
# (round-6 sweep of every configuration, H200, bench/results/sweep_head16b6c93_*, µs 8 -> 6 stages): 4-bit: 6 beat 8
# on every one-block cell by 3-6% (4096^2 M = 1 10.89 -> 10.26, 14336x4096 M = 2 20.45 -> 19.45, M = 16 24.02 ->
# 22.67); 8-bit on the (4, 2) tile (EIGHT_BIT_ONE_M_BLOCK_SHAPES): 4 beat 6 and 8 on 4 of its 5 cells (FP8
# 8192x28672 M = 1, grid 112: 123.7 / 125.2 / 126.4). Two m16 blocks keep 8, 6, 4 (not swept).
ONE_M_BLOCK_STAGES = {4: (6, _DEEP_STAGES, _STAGES), 8: (_STAGES, 6, _DEEP_STAGES)}
# 8-bit weights, M <= 16: the (4, 2) tile (64 x 256) first (same sweep, default (2, 4) -> (4, 2), µs): FP8 / u8b128
# 8192^2 M = 16 47.1 -> 44.9 / 48.6 -> 45.3; 8192x28672 M = 1 130.1 -> 123.7 / ~132 -> 124.7-128.9 (with the
# slice-aligned 112 grid, ALIGNED_MAX_LONGER); 8192^2 M = 1 44.9 -> 44.3 / 48.0 -> 47.3.
EIGHT_BIT_ONE_M_BLOCK_SHAPES = ((4, 2),) + tuple(s for s in _SMALL_M_SHAPES if s != (4, 2))


def thread_shapes() -> dict[tuple[int, int], tuple[int, int]]:
    return dict(_THREAD_SHAPES)


RESERVED_SMEM_PER_BLOCK = 1024  # shared memory the system takes per resident block on sm_80 / sm_90
# What a block needs beside its dynamic shared memory when planning blocks per SM: the system's reserve plus room for
# the kernel's static shared memory.
_SMEM_RESERVED_PER_BLOCK = RESERVED_SMEM_PER_BLOCK + 64

# When two blocks per SM pay (measured on the H200, bench/NOTES_gemm.md step 5): only for 4-bit weights (8-bit
# stages hold twice the bytes, so only shallow stages fit beside a second block: slower on every 8-bit layer), and
# only when each block gets a long run of pipeline steps (with ~2 steps per block, e.g. 4096 x 4096 at M = 1, every
# slice is shared by ~8 blocks and the cross-block reduction dominates: 17.4 -> 22.9 us).
# The swapped (M <= 8) kernels of weights without zero points and act-order need one step more (round 8g A/B on the
# H200, after round 8's cheaper finishing): u4b8 8192^2 M = 1..8 (7.8 steps per block with two) 17.7 -> 16.95 us with
# one block on the slice-aligned grid of 128, while u4 + zero points lost (18.7 -> 19.1) and M = 16 (not swapped)
# stayed fastest with two. Act-order kernels: not measured, kept at TWO_BLOCKS_MIN_STEPS.
TWO_BLOCKS_WEIGHT_BITS = (4,)
TWO_BLOCKS_MIN_STEPS = 7
TWO_BLOCKS_MIN_STEPS_SWAP = 8

# Pairs (sm_90+, fp32 reduction; choose_config(pairs=True)): for M <= 16, the first thread shape whose slices, two
# blocks each with one block per SM, fill PAIR_MIN_FILL..1 of the SMs is taken when each block then gets at most
# PAIR_MAX_STEPS pipeline steps, or, for kernels without act-order groups, when it is the first-choice shape (long
# pairs: PAIR_LONG_*; fp16 without zero points: M <= 8 since round 9, M = 9..16 since round 10's late scaling made the
# one-block kernel faster: sweep r10f, u4b8 28672x8192 M = 16 two blocks per SM 44.63 -> pairs 43.07 µs; bf16 and zero
# points since round 17). Its grid is slice-aligned with two blocks per slice, summed in clusters of two
# (cluster_blocks). PAIR_TWO_BLOCK_MIN_FILL: the same with two blocks per SM (see choose_config; round 10j). Round 9c
# sweep on the H200 (bench/NOTES_gemm.md "Round 9"), µs default -> pair: u4b8 8192^2 M = 16 18.45 -> 17.04, 28672x8192
# M = 1 40.93 -> 38.52, 4096^2 M = 1 9.51 -> 8.15 (the 128 x 64 tile), FP8 8192^2 M = 1 22.98 -> 20.32 (the 256 x 128
# tile); lost with long ranges (then): 28672x8192 M = 16 44.68 -> 46.87, 14336x4096 (128 x 64, 56 steps) 15.51 -> 18.16,
# and (round 9d A/B) u4 + zero points 28672x8192 M = 1 44.88 -> 46.96; u4b8 bf16 28672x8192 M = 1..8 (round 9f A/B, two
# blocks per SM -> pairs) 41.5-41.8 -> 41.8-43.1.
# The pairs do not depend on CLUSTER_SUMS: with the sums switched off the same partition runs with global sums.
PAIR_CLUSTERS = True
PAIR_MIN_FILL = 0.9
PAIR_MAX_STEPS = 32
# Kernels with zero points or act-order groups: pairs only up to 16 steps per block. A/B round 11b (H200, u4 g128
# fp16, µs, one block per SM -> 256 x 64 pairs): 4096^2 (8 steps) M = 1 9.47 -> 8.41; 14336x4096 (28 steps) M = 1
# 16.61 -> 17.80, M = 16 18.13 -> 20.41, while u4b8 there gained (14.85 -> 13.84). Round 9d: 8192^2 (16) won.
PAIR_MAX_STEPS_NOT_PLAIN = 16
# Long pairs (long_ok in choose_config: the first-choice shape past PAIR_MAX_STEPS): activation types that may take
# them, and whether zero-point kernels may (act-order ones never). fp16 without zero points only until round 17,
# when the per-warp pipeline for two tiles (r16i) let the one-block kernels beat two blocks per SM there too. A/B
# r17b (H200, 28672x8192, 56 steps a block; two blocks per SM -> one-block pairs), µs: u4 + zero points fp16 M = 1
# 41.37 -> 35.05, M = 8 41.50 -> 35.05, M = 16 54.16 -> 44.75 (the two-block zero-point kernel spills 16 bytes);
# u4b8 bf16 M = 1 35.07 -> 34.97, M = 8 35.47 -> 35.20, M = 16 44.89 -> 42.97.
PAIR_LONG_ACTS = (ScalarType.F16, ScalarType.BF16)
PAIR_LONG_ZERO_POINTS = True
# Activation types of the swapped two-block pairs (choose_config's pair_choice). bf16 since round 17: A/B r17b, u4b8
# bf16 4096x14336 (one block of 6 stages on 112 -> two blocks per SM on 224 in pairs), µs M = 1 12.46 -> 11.48,
# M = 8 12.20 -> 11.60.
TWO_BLOCK_PAIR_ACTS = (ScalarType.F16, ScalarType.BF16)
PAIR_TWO_BLOCK_MIN_FILL = 0.8
PAIR_TWO_BLOCK_EIGHT_BIT_ROWS = True  # (see choose_config's pair_choice; a switch for bench/ab_gemm.py's A/B)
# Stage counts of 4-bit pairs on the 256 x 64 tile, by swap (twice the bytes per stage of 128 x 64, whose order is
# ONE_M_BLOCK_STAGES). Sweep r11a, u4b8 fp16 4096^2, µs with 4 / 6 / 8 stages: swapped M = 1 7.27 / 7.61 / 7.66,
# M = 8 7.28 / 7.51 / 7.41; rows layout M = 16 8.30 / 8.31 / 7.98.
# (the table PAIR_STAGES below, tile (1, 2))
# 4-bit pairs try the 512 x 64 tile before 256 x 64 (both fill the SMs on 4096-column layers: 64 slices x 2): a
# block runs half as many stages of twice the bytes again. Sweep r14a, u4b8 g128 fp16 under programmatic launches,
# µs 256 x 64 -> 512 x 64 (stages): 14336x4096 M = 1 12.75 -> 11.81 (4; 6: 12.72), M = 16 15.39 -> 14.37 (4; 6:
# 14.39); 4096^2 M = 1 6.12 -> 6.13, M = 8 6.13 -> 6.03, M = 16 7.08 -> 6.90 (6; 4: 7.01). Not for 8-bit weights
# (FP8 4096^2 M = 1 7.37 -> 8.24, 14336x4096 16.52 -> 16.90), whose order starts with their own tile anyway.
# The 512 x 128 tile ((2, 8), in _THREAD_SHAPES for sweeps) is in no order: before 256 x 128 it gained little where
# the bars are met already and lost on 8192^2 (sweep r14c, µs: 28672x8192 M = 1 33.72 -> 33.05, M = 16 42.32 ->
# 40.59; 8192^2 M = 1 13.06 -> 13.23, M = 16 15.13 -> 15.08; 4096x14336 M = 16, one block per SM, 14.27 -> 14.11).
FOUR_BIT_PAIR_SHAPES = ((2, 4), (2, 2), (1, 4), (1, 2), (1, 1), (2, 1), (4, 2))
# Stage orders of one-block pairs by (weight bits, tile) and swap (the other tiles: the policy's stage_order).
# A shallow ring first (round 16): 3 stages, never tried before, beat 4, 5, 6 and 8 on every 4-bit pair cell and
# on the 8-bit 256 x 128 ones. Fewer bytes in flight per SM, so a block's first stages land sooner and its compute
# starts earlier. Near-default sweep r16b (H200, under programmatic launches), µs default -> 3 stages: u4b8 g128 fp16
# 4096^2 M = 1 5.99 (4) -> 5.84, M = 8 5.89 -> 5.82, M = 16 6.25 (6) -> 6.19; 14336x4096 M = 1 11.57 -> 11.33,
# M = 16 13.46 -> 13.38; 8192^2 M = 1 12.95 (6) -> 12.10, M = 8 12.64 -> 12.15, M = 16 14.35 -> 14.20; 28672x8192
# M = 1 33.92 -> 33.77 (5: 33.69), M = 16 41.02 -> 40.90; FP8 / u8b128 8192^2 M = 1 18.33 / 18.46 -> 18.09 / 18.04,
# M = 16 19.34 / 19.37 -> 18.75 / 18.61. Two stages lost (4096^2 M = 1 6.45, sweep r16a). Not taken: 8-bit on the
# 256 x 64 and 128 x 256 tiles, where 4 stays first (FP8 4096^2 M = 1 7.25 -> 7.30, 14336x4096 16.45 -> 17.23,
# 4096x14336 17.37 -> 18.14), and the 4-bit 256 x 64 tile (not swept with 3).
PAIR_STAGES = {(4, (1, 2)): {True: (4, 6, 8), False: (8, 6, 4)},
               (4, (1, 4)): {True: (3, 4, 6), False: (3, 6, 4)},
               (4, (2, 4)): {True: (3, 4, 6), False: (3, 6, 4)},
               (4, (2, 8)): {False: (3, 4)},  # (the rows layout only: ROWS_WIDE_FIRST)
               (8, (2, 4)): {True: (3, 4), False: (3, 4)}}

# The 512 x 128 tile first for 4-bit rows-layout kernels with one m16 block (M = 9..16, not swapped), groups of at
# least 128 rows (channelwise: not timed), no act-order, where a block gets at least ROWS_WIDE_MIN_STEPS stages: a
# warp's 128 rows of a stage are one whole group, so late scaling flushes once per 8 k16 tiles instead of 4, and a
# stage's fixed cost (fetch addresses, the wait) is spread over twice the bytes. It wins as a pair, alone on the
# aligned grid and striped, before the two-block kernels. Sweeps r18c / r18d (H200, u4b8 g128 fp16, µs default ->
# 512 x 128 with 3 stages): 4096x14336 M = 16 (2,4,6 on 112) 13.05 -> 12.41; 8192^2 (pairs) 13.68 -> 12.94;
# 28672x8192 (pairs) 38.70 -> 34.51; 8192x28672 (two blocks per SM on 264) 43.33 -> 38.71 (one block, striped 132);
# 4 stages 0.5% behind 3. The 4096-column layers keep their 512 x 64 pairs (the tile's 32 slices fill a quarter of
# the SMs; without pairs 7.75 µs either way on 4096^2). The swapped kernels (M <= 8) gained 1-4% at most (28672x8192
# M = 1 31.65 -> 30.42): not taken. A/B r18e (every bench layer, M = 9 / 16; u4 + zero points and bf16 too): see
# bench/NOTES_gemm.md "Round 18". (Its 3 stages need 176,128 bytes of shared memory: not on an A100, 166,912.)
ROWS_WIDE_FIRST = True
ROWS_WIDE_TILE = (2, 8)
ROWS_WIDE_STAGES = PAIR_STAGES[(4, ROWS_WIDE_TILE)][False]
ROWS_WIDE_MIN_STEPS = 8


def pairs_possible(compute_capability: int, fp32_reduce: bool) -> bool:
    """Whether choose_config may take the pair policy for a launch (PAIR_CLUSTERS, sm_90+, fp32 reduction)."""
    return PAIR_CLUSTERS and compute_capability >= 90 and fp32_reduce


# Operand swap (KernelConfig.swap) for M <= SWAP_MAX_M (at most 16; 0 = never): one 8-row half for M <= 8, two for
# M = 9..16 where the weights have no zero points or act-order groups (with them the 16-row form's two-block kernels
# spill 8-136 bytes at 128 registers, nvcc sm_80 / sm_90). A module switch so that bench/ab_gemm.py can time the
# alternatives.
SWAP_MAX_M = 8


def swap_halves(size_m: int, plain: bool = True) -> int:
    """KernelConfig.swap for M rows under SWAP_MAX_M: 8-row halves of the swapped loop, 0 for the row layout.
    ``plain``: weights without zero points or act-order groups (KernelConfig.plain)."""
    return 1 if size_m <= min(SWAP_MAX_M, 8) else 2 if plain and size_m <= min(SWAP_MAX_M, 16) else 0


def choose_config(act: ScalarType, weight: ScalarType, size_m: int, size_n: int, size_k: int, group_size: int,
                  per_row_groups: bool, smem_limit: int, thread_k: int = -1, thread_n: int = -1,
                  sm_smem: int = 0, sms: int = 0, pairs: bool = False) -> KernelConfig:
    """The first thread shape that divides (K, N) and fits shared memory; ValueError naming the shape otherwise.

    ``pairs`` (the launch can sum slices in clusters of two: sm_90+, fp32 reduction, see PAIR_CLUSTERS): for M <= 16,
    the one-block-per-SM configuration whose slices, two blocks each, fill the ``sms`` SMs (PAIR_*) comes first.
    4-bit rows-layout kernels with groups of >= 128 rows at M = 9..16 try the 512 x 128 tile first, in pairs and then
    alone (ROWS_WIDE_FIRST).
    Else, for M <= 16 (one m16 block) and 4-bit weights, a configuration that lets two blocks share an SM
    (``sm_smem`` = shared memory per SM; 0 = unknown; kernel cut to 128 registers) is preferred when each of the 2
    ``sms`` blocks then gets at least TWO_BLOCKS_MIN_STEPS pipeline steps (``sms`` = 0: unknown, not checked).
    """
    m_blocks = min(4, max(1, math.ceil(size_m / 16)))
    group_mode = GROUP_PER_ROW if per_row_groups else (GROUP_CHANNELWISE if group_size == -1 else GROUP_GROUPED)
    # kernels of weights without zero points or act-order groups (swapped: their own thresholds below)
    plain = not weight.has_zero_points and not per_row_groups
    variant = dict(swap=swap_halves(size_m, plain))
    plain_swap = bool(variant["swap"]) and plain
    order = _SMALL_M_SHAPES if m_blocks <= 2 else _LARGE_M_SHAPES
    if m_blocks == 1 and weight.bits == 8:
        order = EIGHT_BIT_ONE_M_BLOCK_SHAPES
    wide_rows = (ROWS_WIDE_FIRST and m_blocks == 1 and weight.bits == 4 and not variant["swap"]
                 and not per_row_groups and group_size >= 128)
    wide_first = (ROWS_WIDE_TILE,) if wide_rows else ()  # (tried by the pairs and alone, never by the last resort)
    stage_order = ((_DEEP_STAGES, 6, _STAGES) if m_blocks == 2 else (_STAGES, 3)) if m_blocks > 1 else \
        ONE_M_BLOCK_STAGES.get(weight.bits, (_DEEP_STAGES, 6, _STAGES))

    def shapes(shape_order=order):
        for n_tiles, k_warp in shape_order:
            tk, tn = _THREAD_SHAPES[(n_tiles, k_warp)]
            if (thread_k, thread_n) != (-1, -1) and (tk, tn) != (thread_k, thread_n):
                continue
            if size_k % tk or size_n % tn:
                continue
            if group_size > 0 and not per_row_groups and group_size % tk and tk % group_size:
                continue
            if (n_tiles, k_warp) == ROWS_WIDE_TILE and size_k // tk < ROWS_WIDE_MIN_STEPS:
                continue
            yield n_tiles, k_warp

    half_smem = min(smem_limit, sm_smem // 2 - _SMEM_RESERVED_PER_BLOCK)  # per block, two blocks per SM

    def pair_choice() -> KernelConfig | None:
        """The pair policy (PAIR_*): slices of two blocks each, summed in clusters of two."""
        first = next(shapes(wide_first + order), None)
        # long pairs (past the step limits) for the first-choice shape: PAIR_LONG_*
        long_pairs = act in PAIR_LONG_ACTS and (plain or (PAIR_LONG_ZERO_POINTS and not per_row_groups))
        pair_shapes = FOUR_BIT_PAIR_SHAPES if weight.bits == 4 else order
        for n_tiles, k_warp in shapes(wide_first + pair_shapes):
            tk, tn = _THREAD_SHAPES[(n_tiles, k_warp)]
            slices = size_n // tn
            if not PAIR_MIN_FILL * sms <= 2 * slices <= sms:
                continue
            steps = size_k // tk // 2  # per block
            if (n_tiles, k_warp) == ROWS_WIDE_TILE and steps < ROWS_WIDE_MIN_STEPS:
                continue
            # (rows layout: only where late scaling flushes once per stage, i.e. a group spans a warp's k16 tiles)
            one_flush = variant["swap"] or group_size < 0 or group_size >= 16 * k_warp
            long_ok = long_pairs and (n_tiles, k_warp) == first and one_flush
            if steps >= 1 and (steps <= (PAIR_MAX_STEPS if plain else PAIR_MAX_STEPS_NOT_PLAIN) or long_ok):
                stages_here = PAIR_STAGES.get((weight.bits, (n_tiles, k_warp)), {}).get(bool(variant["swap"]),
                                                                                        stage_order)
                pair = next((cfg for stages in stages_here
                             for cfg in [KernelConfig(act, weight, m_blocks, n_tiles, k_warp, stages, group_mode,
                                                      **variant)] if cfg.smem_bytes <= smem_limit), None)
                if pair is not None:
                    return pair
            break  # only the first shape whose pairs fill the SMs
        # Two blocks per SM in pairs, where no tile's pairs fill the SMs one block each but the first-choice tile's
        # fill PAIR_TWO_BLOCK_MIN_FILL.. of them two blocks each (swapped fp16 4-bit kernels without zero points;
        # returned with cluster = 2, so grid_blocks gives each slice two blocks): sweep r10i, u4b8 4096x14336 M = 1
        # (112 slices of 128 columns, 8 steps per block) one block per SM on 112 blocks 13.76 -> 224 in pairs 12.65 µs.
        if first is not None and plain_swap and act in TWO_BLOCK_PAIR_ACTS \
                and weight.bits in TWO_BLOCKS_WEIGHT_BITS and sm_smem > 0:
            n_tiles, k_warp = first
            tk, tn = _THREAD_SHAPES[first]
            if PAIR_TWO_BLOCK_MIN_FILL * sms <= size_n // tn <= sms and size_k // tk >= 2:
                return next((cfg for stages in (3, 4)
                             for cfg in [KernelConfig(act, weight, m_blocks, n_tiles, k_warp, stages, group_mode,
                                                      blocks_per_sm=2, cluster=2, **variant)]
                             if cfg.smem_bytes <= half_smem), None)
        # 8-bit fp16 kernels at M = 9..16 (rows layout): the first tile whose slices fill the SMs so, two blocks per
        # SM in pairs where one fits half an SM (PAIR_TWO_BLOCK_EIGHT_BIT_ROWS; sweep r12f under programmatic
        # launches, FP8 4096x14336 M = 16: one block per SM on 112 blocks 20.05 -> 2,2,3 pairs on 224 17.81 µs).
        if PAIR_TWO_BLOCK_EIGHT_BIT_ROWS and weight.bits == 8 and not variant["swap"] and plain \
                and act is ScalarType.F16 and sm_smem > 0:
            for n_tiles, k_warp in shapes():
                tk, tn = _THREAD_SHAPES[(n_tiles, k_warp)]
                # (at most PAIR_MAX_STEPS per block, as the one-block pairs: the sweep had no longer range)
                steps = size_k // tk
                if not (PAIR_TWO_BLOCK_MIN_FILL * sms <= size_n // tn <= sms and 2 <= steps <= 2 * PAIR_MAX_STEPS):
                    continue
                two = next((cfg for stages in (3, 4)
                            for cfg in [KernelConfig(act, weight, m_blocks, n_tiles, k_warp, stages, group_mode,
                                                     blocks_per_sm=2, cluster=2, **variant)]
                            if cfg.smem_bytes <= half_smem), None)
                if two is not None:
                    return two
        return None

    if pairs and PAIR_CLUSTERS and m_blocks == 1 and sms > 0:
        pair = pair_choice()
        if pair is not None:
            return pair
    if wide_rows:  # (before the two-block kernels: ROWS_WIDE_FIRST)
        wide = next((cfg for n_tiles, k_warp in shapes(wide_first) for stages in ROWS_WIDE_STAGES
                     for cfg in [KernelConfig(act, weight, m_blocks, n_tiles, k_warp, stages, group_mode, **variant)]
                     if cfg.smem_bytes <= smem_limit), None)
        if wide is not None:
            return wide
    if m_blocks == 1 and sm_smem > 0 and weight.bits in TWO_BLOCKS_WEIGHT_BITS:
        two = next((cfg for n_tiles, k_warp in shapes() for stages in (4, 3)
                    for cfg in [KernelConfig(act, weight, m_blocks, n_tiles, k_warp, stages, group_mode,
                                             blocks_per_sm=2, **variant)] if cfg.smem_bytes <= half_smem), None)
        if two is not None:
            steps = (size_n // two.block_n) * (size_k // two.block_k)
            min_steps = TWO_BLOCKS_MIN_STEPS_SWAP if plain_swap else TWO_BLOCKS_MIN_STEPS
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


# Slice-aligned grids (see grid_blocks): taken when no block then gets more than ALIGNED_MAX_LONGER times the striped
# grid's longest range (+ ALIGNED_EXTRA_STEPS) pipeline steps — for kernels with one block per SM; two-block kernels
# keep the aligned grid only where it is no longer at all. A switch so that bench/ab_gemm.py can time the striped
# grid beside it. Measured on the H200 (round-6 sweep and A/B, bench/NOTES_gemm.md "Round 6 — policy"): a block
# that straddles a slice end costs more than a few steps (fence, atomic round trip, the cross-block sum on the
# critical path) when ranges are short: u4b8 4096x14336, aligned 112 (16 steps) vs striped 132 (14): 25.1 -> 18.7 µs
# (M = 1), 29.1 -> 22.9 (M = 16), 50.8 -> 47.3 (M = 64, 32 vs 28 steps); 28672x8192 M = 64 (112 vs 109) 134.0 ->
# 127.5. Where the aligned grid is 17% longer it lost or tied (8192x28672 M = 64, 128 vs 109 steps: 131.3 -> 136.3;
# u8b128 8192x28672 M = 1: 130.7 -> 137.6, FP8 the same cell 130.3 -> 123.2), and two blocks per SM on 8192x28672
# (aligned 224, 32 steps vs 28) lost 5% at M = 16 (63.6 -> 67.1): hence 1.15, one block per SM only.
# Swapped two-block kernels (M <= 8) without zero points or act-order take it up to ALIGNED_MAX_LONGER too (one block
# per slice there: no cross-block sum at all). Sweep r14c under programmatic launches, u4b8 fp16 8192x28672 M = 1,
# striped 264 (28 steps) 36.88 -> aligned 224 (32 steps) 32.75 µs; A/B r14d, µs M = 1 / 8: u4b8 fp16 36.66 / 36.76 ->
# 32.74 / 33.25, bf16 37.29 / 37.50 -> 35.77 / 36.38, but u4 + zero points 42.39 / 42.30 -> 43.23 / 43.44 (not
# taken); the rows-layout kernels at M = 16 lose too (sweep r14c: 43.23 -> 45.12).
ALIGN_SLICES = True
ALIGNED_MAX_LONGER = 1.15
# One-block swapped kernels (M <= 8) take the aligned grid up to 20% longer (round 16). Sweep r16b under programmatic
# launches, 8192x28672 M = 1 (the 64 x 256 tile: aligned 112 blocks of 128 steps vs striped 132 of ~109, 17% longer),
# µs striped -> aligned: FP8 63.40 -> 58.82, u8b128 63.16 -> 57.76; the rows layout at M = 16 still loses there
# (FP8 64.89 -> 68.14), so it keeps ALIGNED_MAX_LONGER.
ALIGNED_MAX_LONGER_SWAP = 1.2
ALIGNED_EXTRA_STEPS = 0
ALIGNED_SWAP_TWO_BLOCKS = True  # (a switch for bench/ab_gemm.py's A/B)

# The policy before round 6: bench/ab_gemm.py's variant new-oldpolicy sets these module switches to time it.
PRE_R6_POLICY = dict(ONE_M_BLOCK_STAGES={4: (8, 6, 4), 8: (8, 6, 4)}, EIGHT_BIT_ONE_M_BLOCK_SHAPES=_SMALL_M_SHAPES,
                     ALIGNED_MAX_LONGER=1.0, ALIGNED_MAX_LONGER_SWAP=1.0,
                     TWO_BLOCKS_MIN_STEPS_SWAP=TWO_BLOCKS_MIN_STEPS, ROWS_WIDE_FIRST=False)


def pipeline_steps(cfg: KernelConfig, size_m: int, size_n: int, size_k: int) -> int:
    """The kernel's (slice, k step) iterations: m chunks x column slices x k steps per slice."""
    return math.ceil(size_m / cfg.block_m) * (size_n // cfg.block_n) * (size_k // cfg.block_k)


def grid_blocks(cfg: KernelConfig, size_m: int, size_n: int, size_k: int, sms: int, blocks_per_sm: int = 0) -> int:
    """Blocks launched: at most as many as can be resident at once (every block must be: in the in-C and fp32
    reductions blocks wait on others' counts), fewer when the problem has fewer (slice, k) iterations.

    The kernel splits the T = slices x KI iterations evenly over the grid G. With G = slices x s (s <= KI), block
    c s + j covers [c KI + floor(j KI / s), c KI + floor((j + 1) KI / s)): every block stays inside one slice, so it
    finishes one slice instead of two (a block straddling two slices stops its pipeline mid-range to fold its warps
    and store and count in its partial, and sums its last slice's partials at the end). Chosen unless it lengthens
    the longest range by more than ALIGNED_MAX_LONGER (x, one block per SM or swapped two-block kernels without zero
    points or act-order; one-block swapped kernels: ALIGNED_MAX_LONGER_SWAP; other two-block kernels: not at all) +
    ALIGNED_EXTRA_STEPS. A configuration that choose_config returned with ``cluster`` > 1 (a pair policy choice) gets
    the aligned grid of that many blocks per slice wherever they fit.
    """
    chunks = math.ceil(size_m / cfg.block_m)
    slices = chunks * (size_n // cfg.block_n)
    ki = size_k // cfg.block_k
    iterations = slices * ki
    max_grid = sms * (blocks_per_sm or cfg.blocks_per_sm)
    striped = max(1, min(max_grid, iterations))
    if ALIGN_SLICES and slices <= max_grid:
        splits = min(ki, max_grid // slices)
        if cfg.cluster > 1 and cfg.cluster <= splits:  # chosen as a pair (choose_config): cluster blocks per slice
            return slices * cfg.cluster
        if max_grid <= sms:
            longer = ALIGNED_MAX_LONGER_SWAP if cfg.swap else ALIGNED_MAX_LONGER
        else:
            longer = ALIGNED_MAX_LONGER if cfg.swap and cfg.plain and ALIGNED_SWAP_TWO_BLOCKS else 1.0
        if math.ceil(ki / splits) <= math.ceil(iterations / striped) * longer + ALIGNED_EXTRA_STEPS:
            return slices * splits
    return striped


# Slice sums inside thread-block clusters (sm_90 and newer; mwb::marlin_gemm_cluster): where the grid is slice-aligned
# with CLUSTER_SIZES blocks per slice and the reduction is fp32, a slice's blocks run as one cluster and add their
# partials through each other's shared memory — in the fp32 reduction's order, so the output is bitwise the same —
# instead of C_tmp slots, a lock and the first contributor's wait. A switch so that bench/ab_gemm.py can time the
# global-memory sum beside it.
# Measured on the H200 (round 9b A/B, bench/NOTES_gemm.md "Round 9"), every output bitwise equal: clusters of 2 are
# faster wherever they ran (u4b8 8192^2 M = 1 17.04 -> 14.85 µs; FP8 4096x14336 M = 1 / 16 x0.88 / x0.89); clusters
# of 4 were slower in every cell (x1.2-1.6: u4b8 4096^2 M = 1 9.54 -> 12.62, 28672x8192 M = 1 41.1 -> 51.7) and of 8
# mixed (FP8 4096^2 x0.91, 14336x4096 x1.14): the H200 keeps only 30 clusters of 4 of a one-block kernel resident
# (62 of a two-block one) where the grids need 32 (64), so some ran in a second wave (round 9g). Hence
# CLUSTER_SIZES, and resident_clusters in the plan; the kernels take 2, 4 and 8.
CLUSTER_SUMS = True
CLUSTER_SIZES = (2,)
KERNEL_CLUSTER_SIZES = (2, 4, 8)  # what marlin_gemm_cluster takes: the blocks share a partial's float4s evenly


def cluster_blocks(cfg: KernelConfig, size_m: int, size_n: int, size_k: int, grid: int, compute_capability: int,
                   fp32_reduce: bool, enabled: bool | None = None, sizes: tuple[int, ...] | None = None) -> int:
    """Blocks per cluster for a launch of ``cfg`` on ``grid`` blocks: s when the grid gives each slice s blocks of its
    own (slice-aligned; s in ``sizes``, default CLUSTER_SIZES; s <= the slice's pipeline steps, so no block is idle:
    every block must reach the cluster barriers), 16-row tiles, the fp32 reduction and sm_90+; else 1 (no cluster).
    ``enabled``: None = CLUSTER_SUMS."""
    if not ((CLUSTER_SUMS if enabled is None else enabled) and compute_capability >= 90 and fp32_reduce
            and cfg.m_blocks == 1):
        return 1
    slices = math.ceil(size_m / cfg.block_m) * (size_n // cfg.block_n)
    s, rest = divmod(grid, slices)
    allowed = CLUSTER_SIZES if sizes is None else sizes
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
# Compilation (CuPy RawModule, cached per process)
# ---------------------------------------------------------------------------------------------------------------
_INCLUDE = re.compile(r'^\s*#include\s+"([^"]+)"\s*$', re.M)


@functools.lru_cache(maxsize=None)
def kernel_source() -> str:
    """marlin_gemm.cu with its local headers inlined, so that CuPy's compile cache sees every byte it builds."""
    seen: set[str] = set()

    def expand(name: str) -> str:
        if name in seen:
            return ""
        seen.add(name)
        text = (KERNEL_DIR / name).read_text()
        return _INCLUDE.sub(lambda m: expand(m.group(1)), text)

    return expand(KERNEL_SOURCE).replace("#pragma once", "")


_compile_lock = threading.Lock()
_kernels: dict[tuple[str, int], Any] = {}
_occupancy: dict[tuple[str, int], int] = {}
_function_ptrs: dict[tuple[str, int], int] = {}  # (name, device) -> CUfunction handle, for the direct launch
_cupy_module = None


def _cupy():
    global _cupy_module
    if _cupy_module is None:  # the import statement alone costs ~0.3 us per call in the launch path
        try:
            import cupy
        except ImportError as exc:  # pragma: no cover - environment
            raise RuntimeError("the native Marlin GEMM needs CuPy (pip install cupy-cuda13x)") from exc
        _cupy_module = cupy
    return _cupy_module


def get_kernel(name_expression: str, device: int, smem_bytes: int = 0):
    """The compiled kernel for one template instantiation on one device (compiled once per process)."""
    key = (name_expression, device)
    kernel = _kernels.get(key)
    if kernel is None:
        cupy = _cupy()
        with cupy.cuda.Device(device):
            module = cupy.RawModule(code=kernel_source(), options=("-std=c++17",),
                                    name_expressions=[name_expression])
            kernel = module.get_function(name_expression)
            if smem_bytes > 48 * 1024:
                kernel.max_dynamic_shared_size_bytes = smem_bytes
            resident = _resident_blocks(kernel, smem_bytes)
            function_ptr = int(kernel.kernel.ptr)  # loaded into this device's context
        with _compile_lock:
            if key not in _kernels:
                _kernels[key] = kernel
                _occupancy[key] = resident
                _function_ptrs[key] = function_ptr
            kernel = _kernels[key]
    return kernel


def function_ptr(name_expression: str, device: int, smem_bytes: int = 0) -> int:
    """The CUfunction handle of one instantiation on one device (compiling it first if needed)."""
    key = (name_expression, device)
    if key not in _function_ptrs:
        get_kernel(name_expression, device, smem_bytes)
    return _function_ptrs[key]


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
    return _occupancy.get((name_expression, device), 1)


def programmatic_launches(device: int) -> bool:
    """Whether launches on ``device`` are programmatic dependent launches (PROGRAMMATIC_LAUNCH on an sm_90+ device):
    the dense GEMM's and the MoE kernels' (workbench/moe.py)."""
    return PROGRAMMATIC_LAUNCH and device_properties(device)[0] >= 90


def pinned_smem(smem_bytes: int, blocks_per_sm: int, sm_smem: int, reserved_per_block: int) -> int:
    """The least dynamic shared memory >= smem_bytes (a multiple of 128 bytes) with which no more than
    ``blocks_per_sm`` blocks fit in an SM's ``sm_smem`` bytes, each block also taking ``reserved_per_block``."""
    least = sm_smem // (blocks_per_sm + 1) - reserved_per_block + 1  # blocks_per_sm + 1 of these overflow the SM
    return max(smem_bytes, -(-least // 128) * 128)


def pin_occupancy_of(kernel, device: int, smem_bytes: int, blocks_per_sm: int) -> int:
    """Dynamic shared memory for a launch of a compiled kernel (a CuPy function) that keeps at most
    ``blocks_per_sm`` of its blocks on an SM (PROGRAMMATIC_PIN_OCCUPANCY): ``smem_bytes`` where no more fit already,
    else pinned_smem's amount, the kernel's shared memory limit raised to it and the driver's occupancy query checking
    it. ``smem_bytes`` where the pinned amount is over the per-block limit or the query disagrees (the launch is then
    as unpinned)."""
    with _cupy().cuda.Device(device):
        if _resident_blocks(kernel, smem_bytes) <= blocks_per_sm:
            return smem_bytes
    _, _, smem_limit, sm_smem = device_properties(device)
    pinned = pinned_smem(smem_bytes, blocks_per_sm, sm_smem, RESERVED_SMEM_PER_BLOCK)
    if pinned > smem_limit:
        return smem_bytes
    with _cupy().cuda.Device(device):
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
    cupy = _cupy()
    props = cupy.cuda.runtime.getDeviceProperties(device)
    return (10 * props["major"] + props["minor"], props["multiProcessorCount"],
            props["sharedMemPerBlockOptin"], props["sharedMemPerMultiprocessor"])


def config_for(act, weight, size_m: int, size_n: int, size_k: int, group_size: int, per_row_groups: bool,
               device: int = 0) -> KernelConfig:
    """choose_config with the device's limits, for the default (fp32) reduction: the tile a launch on that device
    will use (its cluster size follows the grid: cluster_blocks)."""
    cc, sms, smem_limit, sm_smem = device_properties(device)
    return choose_config(ScalarType.parse(act) if not isinstance(act, ScalarType) else act, weight, size_m, size_n,
                         size_k, group_size, per_row_groups, smem_limit, sm_smem=sm_smem, sms=sms,
                         pairs=pairs_possible(cc, True))


# ---------------------------------------------------------------------------------------------------------------
# The record-level launch (seed ABI)
# ---------------------------------------------------------------------------------------------------------------
def _err(message: str) -> ValueError:
    return ValueError(message)


_TYPE_BY_CODE = {t.abi_code: t for t in ScalarType}


def check_launch(launch: MarlinLaunch, compute_capability: int, device_sms: int, smem_limit: int, sm_smem: int = 0
                 ) -> tuple[KernelConfig, int, int]:
    """Every rule a record can be checked against without knowing buffer extents. Returns (config, sms, grid)."""
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
    if m < 0 or n <= 0 or k <= 0:
        raise _err(f"Invalid MNK = [{m}, {n}, {k}]")
    if k % TILE_K:
        raise _err(f"size_k = {k} is not divisible by tile_size = {TILE_K}")
    if n % TILE_N:
        raise _err(f"size_n = {n} is not divisible by min_thread_n = {TILE_N}")
    if lda < k or lda % 8:
        raise _err(f"lda = {lda} must be >= size_k = {k} and a multiple of 8 (16-byte rows)")
    flags = launch.flags
    has_zp = bool(flags & FLAG_HAS_ZERO_POINTS)
    if has_zp != bool(launch.pointer("zero_points")):
        raise _err(f"HAS_ZERO_POINTS flag = {has_zp} disagrees with zero_points = {launch.pointer('zero_points'):#x}")
    if has_zp and not weight.has_zero_points:
        raise _err(f"b_type must be u4 or u8 when has_zp = True. Got = {weight}")
    if not has_zp and weight.has_zero_points:
        raise _err(f"b_type must be u4b8, u8b128 or fe4m3fn when has_zp = False. Got = {weight}")
    act_order = bool(flags & FLAG_HAS_ACT_ORDER)
    k_full = bool(flags & FLAG_IS_K_FULL)
    if act_order != bool(launch.pointer("group_index")) or act_order != bool(launch.pointer("permutation")):
        raise _err(f"HAS_ACT_ORDER flag = {act_order} needs group_index and permutation "
                   f"(got {launch.pointer('group_index'):#x}, {launch.pointer('permutation'):#x})")
    if act_order and weight is ScalarType.FE4M3FN:
        raise _err("act-order is not defined for fe4m3fn weights")
    if act_order and not launch.pointer("a_tmp"):
        raise _err("act-order needs a_tmp (an M x K activation buffer for the gathered columns)")
    ng, gs = launch.num_groups, launch.group_size
    if ng <= 0 or k % ng:
        raise _err(f"size_k = {k}, is not divisible by num_groups = {ng}")
    if act_order and k_full and ng == 1:
        raise _err("For act_order, num_groups must be > 1")
    if ng == 1:
        if gs not in (-1, k):
            raise _err(f"group_size = {gs} with num_groups = 1 must be -1 (channelwise) or size_k = {k}")
    elif gs != k // ng:
        raise _err(f"group_size = {gs} is not size_k / num_groups = {k} / {ng} = {k // ng}")
    elif not act_order or k_full:
        if gs not in GROUP_SIZES:
            raise _err(f"group_size = {gs} is not one of {GROUP_SIZES} (or -1)")
    if weight is ScalarType.FE4M3FN and ng > 1 and gs != 128:
        raise _err(f"fe4m3fn weights take channelwise or group-128 scales, got group_size = {gs}")
    atomic = bool(flags & FLAG_USE_ATOMIC_ADD)
    if atomic and flags & FLAG_DETERMINISTIC:
        raise _err("use_atomic_add cannot be deterministic: atomics sum in arrival order")
    if compute_capability < 80:
        raise _err(f"the Marlin kernels need sm_80 or newer; device {launch.device} is sm_{compute_capability}")
    for name in ("a", "b", "c", "b_scales", "workspace"):
        if not launch.pointer(name):
            raise _err(f"{name} is null")
    if flags & FLAG_USE_FP32_REDUCE and not atomic and not launch.pointer("c_tmp"):
        raise _err("use_fp32_reduce needs c_tmp (fp32 partial sums); pass one or clear the flag")
    for name in ("a", "b", "c", "c_tmp", "b_scales", "zero_points", "group_index", "permutation", "a_tmp"):
        ptr = launch.pointer(name)
        if ptr % 16:
            raise _err(f"{name} must be aligned to 16 bytes (address {ptr:#x} % 16 = {ptr % 16})")
    sms = launch.sms if launch.sms > 0 else device_sms
    if sms > device_sms:
        raise _err(f"sms = {sms} exceeds the device's {device_sms} SMs (blocks must all be resident)")
    per_row = act_order and not k_full
    group_size = -1 if ng == 1 else gs
    fp32_reduce = bool(flags & FLAG_USE_FP32_REDUCE) and not atomic
    cfg = choose_config(act, weight, max(m, 1), n, k, group_size, per_row, smem_limit,
                        launch.thread_k_init, launch.thread_n_init, sm_smem=sm_smem, sms=sms,
                        pairs=pairs_possible(compute_capability, fp32_reduce))
    iterations = pipeline_steps(cfg, max(m, 1), n, k)
    if iterations >= 2**31:
        raise _err(f"problem too large: {iterations} pipeline steps do not fit the kernel's 32-bit counters")
    grid = grid_blocks(cfg, max(m, 1), n, k, sms)
    cluster = cluster_blocks(cfg, max(m, 1), n, k, grid, compute_capability, fp32_reduce)
    # cluster_blocks decides (a pair choice comes back from choose_config with cluster = 2; kept only where it applies)
    return dataclasses.replace(cfg, cluster=cluster), sms, grid


# The pointer fields of a record that must be 16-byte aligned (null counts as aligned).
_ALIGNED_POINTERS = ("a", "b", "c", "c_tmp", "b_scales", "zero_points", "group_index", "permutation", "a_tmp")
_POINTER_FIELDS = tuple(f for f, t in MarlinLaunch._fields_ if t is ctypes.c_void_p)
_SCALARS_OFFSET = MarlinLaunch.prob_m.offset  # the record's non-pointer tail: sizes, types, device, sms, flags

# Launch through cuLaunchKernel with a reused argument block (True) or through CuPy's RawKernel call (False,
# converting every argument on each call, as HEAD did): a switch for bench/bench_host.py's A/B, and a way back
# (WORKBENCH_DIRECT_LAUNCH=0) should a driver/CuPy combination refuse the direct launch.
DIRECT_LAUNCH = os.environ.get("WORKBENCH_DIRECT_LAUNCH", "1") != "0"
# Programmatic dependent launch (sm_90+, direct launches; on unless WORKBENCH_PROGRAMMATIC_LAUNCH=0): the GEMM is
# launched with programmatic stream serialization, so its blocks may be scheduled while the kernel before it in the
# stream finishes; they fetch their first weight stage at once and wait (griddepcontrol.wait, kernels_cuda/mma.cuh)
# before they read the activations or write anything. Every GEMM lets the next one start so
# (griddepcontrol.launch_dependents). It pays only where the kernel before triggers it: back-to-back GEMMs (as in
# bench_gemm's graphs) or another kernel that does; after any other kernel the launch behaves as a plain one.
# Needs cuda-python's driver bindings (cuLaunchKernelEx), else launches stay plain.
PROGRAMMATIC_LAUNCH = os.environ.get("WORKBENCH_PROGRAMMATIC_LAUNCH", "1") != "0"
# A programmatic launch places the next grid's blocks in whatever SM space is free while the grid before runs, so
# the SMs that grid leaves idle (it may have fewer blocks than SMs) take as many blocks as fit, where a launch on an
# idle GPU spreads them one per SM. A kernel planned at b blocks per SM that fits more then runs some SMs stacked.
# Pinning: the launch asks for just enough shared memory that no more than b fit. Measured (H200, back-to-back in
# graphs, round 12a, µs plain / programmatic unpinned / pinned): u4b8 14336x4096 M = 1 13.77 / 15.90 / 12.67, FP8
# 4096x14336 M = 1 18.86 / 25.18 / 17.63; elsewhere pinned = unpinned within 4% (4096^2 M = 1 7.15 / 5.85 / 6.07).
PROGRAMMATIC_PIN_OCCUPANCY = True
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

    The kernel's arguments live in a ctypes block reused by every call (a lock keeps two threads from interleaving
    fill and launch; cuLaunchKernel copies the block before it returns)."""

    def __init__(self, launch: MarlinLaunch, cfg: KernelConfig, sms: int, grid: int):
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
                self.grid = grid_blocks(cfg, m, n, k, sms, resident)
                if cfg.cluster > 1:  # (sm_90+ and fp32: the planned grid had clusters) the new grid's, if any
                    cfg = self.cfg = dataclasses.replace(
                        cfg, cluster=cluster_blocks(cfg, m, n, k, self.grid, 90, True))
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
        # (8,) u64 addresses then (14,) i32 scalars, and the (22,) void* table cuLaunchKernel reads them through:
        # mwb::marlin_gemm's parameter list (KERNEL_ARG_KINDS, checked against the source by tests/cpu)
        self._ptrs = (ctypes.c_uint64 * 8)()
        self._ints = (ctypes.c_int32 * 14)(*self._kernel_ints())
        self._params = _param_table(self._ptrs, 8, self._ints, 14)
        # permute_cols(A, perm, out, prob_m, prob_k, lda): (3,) u64 + (3,) i32
        self._perm_ptrs = (ctypes.c_uint64 * 3)()
        self._perm_ints = (ctypes.c_int32 * 3)(m, k, self.lda)
        self._perm_params = _param_table(self._perm_ptrs, 3, self._perm_ints, 3)
        # the launch configuration of a programmatic launch (None: cuLaunchKernel), its stream set per call
        self._programmatic = None
        self.launch_smem = self.smem  # what a programmatic launch asks for (pinned_smem)
        if m > 0 and programmatic_launches(self.device):
            if PROGRAMMATIC_PIN_OCCUPANCY:
                self.launch_smem = pin_occupancy_of(self._kernel, self.device, self.smem, cfg.blocks_per_sm)
            self._programmatic = _programmatic_config(self.grid, self.launch_smem, self._function)

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
            if self._programmatic is not None:
                self._programmatic = _programmatic_config(self.grid, self.launch_smem, self._function)

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
        cupy = _cupy()
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
        if not DIRECT_LAUNCH:
            self._launch_cupy(a, b, c, c_tmp, scales, zero_points, group_index, permutation, a_tmp, workspace,
                              stream)
            return
        driver = _driver()
        with self._lock:
            if self.act_order:
                pp = self._perm_ptrs
                pp[0], pp[1], pp[2] = a, permutation, a_tmp
                driver.launchKernel(self._permute_function, self.m, 1, 1, THREADS, 1, 1, 0, stream,
                                    self._perm_params, 0)
                a = a_tmp
            p = self._ptrs
            p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7] = (a, b, c, c_tmp, scales, zero_points, group_index,
                                                              workspace)
            if self._programmatic is not None:
                _launch_programmatic(self._programmatic, stream, self._params)
            else:
                driver.launchKernel(self._function, self.grid, 1, 1, THREADS, 1, 1, self.smem, stream, self._params,
                                    0)

    def _launch_cupy(self, a, b, c, c_tmp, scales, zero_points, group_index, permutation, a_tmp, workspace,
                     stream):
        s = _stream(stream)
        if self.act_order:
            self._permute((self.m,), (THREADS,), (_p(a), _p(permutation), _p(a_tmp), np.int32(self.m),
                                                  np.int32(self.k), np.int32(self.lda)), stream=s)
            a = a_tmp  # (the kernel's lda argument is then K: _kernel_ints)
        self._kernel((self.grid,), (THREADS,),
                     (_p(a), _p(b), _p(c), _p(c_tmp), _p(scales), _p(zero_points), _p(group_index), _p(workspace),
                      *(np.int32(v) for v in self._ints)),
                     shared_mem=self.smem, stream=s)

    def _refuse(self, pointers: dict[str, int]) -> None:
        for name in ("a", "b", "c", "b_scales", "workspace"):
            if not pointers[name]:
                raise _err(f"{name} is null")
        if self.uses_c_tmp and not pointers["c_tmp"]:
            raise _err("use_fp32_reduce needs c_tmp (fp32 partial sums); pass one or clear the flag")
        if self.has_zero_points and not pointers["zero_points"]:
            raise _err("HAS_ZERO_POINTS flag = True needs zero_points (got null)")
        if self.act_order and not (pointers["group_index"] and pointers["permutation"]):
            raise _err(f"HAS_ACT_ORDER flag = True needs group_index and permutation (got "
                       f"{pointers['group_index']:#x}, {pointers['permutation']:#x})")
        if self.act_order and not pointers["a_tmp"]:
            raise _err("act-order needs a_tmp (an M x K activation buffer for the gathered columns)")
        for name in _ALIGNED_POINTERS:
            if pointers[name] % 16:
                raise _err(f"{name} must be aligned to 16 bytes (address {pointers[name]:#x} % 16 = "
                           f"{pointers[name] % 16})")
        raise AssertionError("refused a launch without a reason")  # pragma: no cover - the checks above mirror it


_driver_module = None


def _driver():
    """CuPy's binding of the CUDA driver API (cuLaunchKernel), looked up once."""
    global _driver_module
    if _driver_module is None:
        from cupy_backends.cuda.api import driver

        _driver_module = driver
    return _driver_module


def _programmatic_config(grid: int, smem: int, function: int, threads: int = THREADS):
    """(cuda.bindings driver module, CUlaunchConfig with programmatic stream serialization allowed, CUfunction) for a
    launch of ``function`` on ``grid`` blocks of ``threads``, made once per plan; None where cuda-python's driver
    bindings are missing (the launch stays plain)."""
    try:
        from cuda.bindings import driver as cu
    except ImportError:  # pragma: no cover - environment
        return None
    attr = cu.CUlaunchAttribute()
    attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value.programmaticStreamSerializationAllowed = 1
    config = cu.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = grid, 1, 1
    config.blockDimX, config.blockDimY, config.blockDimZ = threads, 1, 1
    config.sharedMemBytes = smem
    config.attrs = [attr]
    config.numAttrs = 1
    return cu, config, cu.CUfunction(function)


def _launch_programmatic(programmatic, stream: int, params: int) -> None:
    """cuLaunchKernelEx of a prepared programmatic launch (_programmatic_config) on ``stream``; RuntimeError naming
    the driver's error if it refuses."""
    cu, config, function = programmatic
    config.hStream = cu.CUstream(stream)
    err, = cu.cuLaunchKernelEx(config, function, params, 0)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuLaunchKernelEx (programmatic launch) failed: {err!r}")


def _param_table(ptrs, n_ptrs: int, ints, n_ints: int):
    """The void* table cuLaunchKernel reads the arguments through: one entry per argument, into the two blocks."""
    p0, i0 = ctypes.addressof(ptrs), ctypes.addressof(ints)
    table = (ctypes.c_void_p * (n_ptrs + n_ints))(*[p0 + 8 * i for i in range(n_ptrs)],
                                                  *[i0 + 4 * i for i in range(n_ints)])
    return _ParamTable(table, ptrs, ints)


class _ParamTable(int):
    """The table's address as an int (what cuLaunchKernel takes), holding the blocks it points into alive."""

    def __new__(cls, table, ptrs, ints):
        obj = super().__new__(cls, ctypes.addressof(table))
        obj._keep = (table, ptrs, ints)
        return obj


_MAX_PLANS = 4096  # cached plans per cache (a serving loop sees a few dozen shapes; the bound keeps a sweep finite)
_prepared: dict[tuple, PreparedLaunch] = {}


def _record_key(launch: MarlinLaunch) -> tuple:
    """Everything check_launch reads except addresses: the record's scalar tail and which pointers are null."""
    return (bytes(launch)[_SCALARS_OFFSET:],) + tuple(not getattr(launch, f) for f in _POINTER_FIELDS)


def prepare_launch(launch: MarlinLaunch, *, config: KernelConfig | None = None, grid: int | None = None
                   ) -> PreparedLaunch:
    """check_launch on the device's properties, then the prepared launch (cached per record layout).

    ``config`` / ``grid`` force the kernel configuration and the number of blocks instead of choose_config /
    grid_blocks (bench/sweep_gemm.py times the alternatives): checked by ``_prepare_forced``, never cached."""
    if not isinstance(launch, MarlinLaunch):
        raise TypeError(f"expected a MarlinLaunch record, got {type(launch).__name__}")
    if config is not None or grid is not None:
        return _prepare_forced(launch, config, grid)
    key = _record_key(launch)
    prepared = _prepared.get(key)
    if prepared is None:
        cc, device_sms, smem_limit, sm_smem = device_properties(launch.device)
        cfg, sms, grid = check_launch(launch, cc, device_sms, smem_limit, sm_smem)
        prepared = PreparedLaunch(launch, cfg, sms, grid)
        if len(_prepared) >= _MAX_PLANS:
            _prepared.clear()
        _prepared[key] = prepared
    return prepared


def _prepare_forced(launch: MarlinLaunch, config: KernelConfig | None, grid: int | None) -> PreparedLaunch:
    """prepare_launch with a forced configuration and/or grid: every rule of check_launch, then ValueError unless the
    configuration is one the kernel computes this problem correctly with (same types and group mode, tile divides
    (K, N) and the group size, swap 1 / 2 only for M <= 8 / 16, two blocks per SM only with 16-row tiles, shared
    memory fits)
    and every block of the grid can be resident (the in-C and fp32 reductions wait on other blocks; the scratch buffers
    hold sms x blocks_per_sm blocks)."""
    cc, device_sms, smem_limit, sm_smem = device_properties(launch.device)
    default, sms, _ = check_launch(launch, cc, device_sms, smem_limit, sm_smem)
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
    limit = smem_limit if cfg.blocks_per_sm == 1 else min(smem_limit, sm_smem // 2 - _SMEM_RESERVED_PER_BLOCK)
    if cfg.smem_bytes > limit:
        raise _err(f"config needs {cfg.smem_bytes} bytes of shared memory; {cfg.blocks_per_sm} block(s) per SM "
                   f"leave {limit}")
    iterations = pipeline_steps(cfg, m, n, k)
    if iterations >= 2**31:
        raise _err(f"problem too large: {iterations} pipeline steps do not fit the kernel's 32-bit counters")
    if grid is None:
        grid = grid_blocks(cfg, m, n, k, sms)
    most = min(iterations, sms * cfg.blocks_per_sm)
    if isinstance(grid, bool) or not isinstance(grid, (int, np.integer)) or not 1 <= grid <= most:
        raise _err(f"grid = {grid!r} must be an int in [1, {most}] (min(pipeline steps = {iterations}, sms = {sms} "
                   f"x blocks_per_sm = {cfg.blocks_per_sm}))")
    fp32_reduce = bool(launch.flags & FLAG_USE_FP32_REDUCE) and not launch.flags & FLAG_USE_ATOMIC_ADD
    fits = cluster_blocks(cfg, m, n, k, int(grid), cc, fp32_reduce, enabled=True, sizes=KERNEL_CLUSTER_SIZES)
    if config is None:  # the default configuration: clusters where the policy would give this grid some
        cfg = dataclasses.replace(cfg, cluster=cluster_blocks(cfg, m, n, k, int(grid), cc, fp32_reduce))
    elif cfg.cluster != 1 and cfg.cluster != fits:
        raise _err(f"config cluster = {cfg.cluster} needs sm_90+, the fp32 reduction, m_blocks = 1 and a grid of "
                   f"cluster x slices blocks with cluster in {KERNEL_CLUSTER_SIZES} and <= the slice's pipeline "
                   f"steps (got sm_{cc}, fp32 = {fp32_reduce}, m_blocks = {cfg.m_blocks}, grid = {grid}: cluster "
                   f"{fits} fits)")
    prepared = PreparedLaunch(launch, cfg, sms, int(grid))
    if launch.prob_m > 0:
        resident = resident_blocks(cfg.name_expression, launch.device)
        if grid > sms * resident:
            raise _err(f"grid = {grid} blocks cannot all be resident: the driver keeps {resident} block(s) of "
                       f"{cfg.name_expression} per SM on {sms} SMs")
        prepared.set_grid(grid)  # (PreparedLaunch shrinks the planned grid when fewer blocks are resident)
    return prepared


def launch_marlin_mm(launch: MarlinLaunch) -> None:
    """Launch one GEMM described by a seed-ABI record. Raises ValueError/TypeError before touching the GPU.

    The first record of a layout runs every check of ``check_launch``; later records with the same scalar fields and
    the same null pointers reuse that verdict and re-check only the addresses (``PreparedLaunch.launch``)."""
    prepared = prepare_launch(launch)
    ptr = launch.pointer
    prepared.launch(ptr("a"), ptr("b"), ptr("c"), ptr("c_tmp"), ptr("b_scales"), ptr("zero_points"),
                    ptr("group_index"), ptr("permutation"), ptr("a_tmp"), ptr("workspace"), ptr("stream"))


def _p(ptr: int) -> np.uint64:
    return np.uint64(ptr)


_streams: dict[int, Any] = {}


def _stream(ptr: int):
    """A CuPy stream object for a raw CUstream handle (cached: creating one allocates nothing on the device)."""
    cupy = _cupy()
    if ptr == 0:
        return cupy.cuda.Stream.null
    s = _streams.get(ptr)
    if s is None:
        import warnings

        with warnings.catch_warnings():  # CuPy 14 deprecates it in favour of objects with __cuda_stream__; a raw
            warnings.simplefilter("ignore", DeprecationWarning)  # handle from the ABI has nothing else to wrap
            s = _streams.setdefault(ptr, cupy.cuda.ExternalStream(ptr))
    return s


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


def _device_ptr(x, name: str) -> tuple[int, int]:
    """(address, device id) of a CUDA array; TypeError naming the array otherwise."""
    if type(x) is _fast_array_type():  # CuPy: no interface dict, no pointer query
        mem = x.data
        return mem.ptr, mem.device_id
    iface = getattr(x, "__cuda_array_interface__", None)
    if iface is None:
        raise TypeError(f"{name} is not on GPU (got {type(x).__module__}.{type(x).__name__}; use a CuPy array)")
    ptr = int(iface["data"][0])
    device = getattr(getattr(x, "device", None), "id", None)
    if device is None:
        device = _cupy().cuda.runtime.pointerGetAttributes(ptr).device
    return ptr, int(device)


@dataclasses.dataclass(frozen=True)
class GemmPlan:
    """What the shape checks concluded: the seed's ``MarlinMmProblem`` (m, n, k, lda, groups) plus the types and the
    act-order flags; turned into a ``MarlinMmRequest`` once device pointers are known."""

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
    """spec §7.6's host checks (adapted), on any array-like with .shape/.dtype/.strides; no GPU needed."""
    act = act_scalar_type(a.dtype)
    weight = ScalarType.parse(b_q_type)
    if weight not in GEMM_WEIGHT_TYPES:
        raise ValueError(f"b_q_type = {weight} is not a Marlin weight type")
    for name, v in (("size_m", size_m), ("size_n", size_n), ("size_k", size_k)):
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if size_m < 0 or size_n <= 0 or size_k <= 0:
        raise ValueError(f"Invalid MNK = [{size_m}, {size_n}, {size_k}]")
    if len(_shape(a)) != 2:
        raise ValueError(f"a must be 2-D (M, K), got shape {_shape(a)}")
    if _shape(a)[0] != size_m:
        raise ValueError(f"Shape mismatch: a.size(0) = {_shape(a)[0]}, size_m = {size_m}")
    if _shape(a)[1] != size_k:
        raise ValueError(f"Shape mismatch: a.size(1) = {_shape(a)[1]}, size_k = {size_k}")
    if size_k % TILE_K:
        raise ValueError(f"size_k = {size_k} is not divisible by tile_size = {TILE_K}")
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
    if size_n % TILE_N:
        raise ValueError(f"size_n = {size_n}, is not divisible by min_thread_n = {TILE_N}")
    item = np.dtype(a.dtype).itemsize
    strides = tuple(int(s) for s in a.strides)
    if size_m > 0 and strides[1] != item:
        raise ValueError(f"A.stride(1) is not 1 (strides in elements: {tuple(s // item for s in strides)})")
    lda = strides[0] // item if size_m > 1 else size_k
    if size_m > 1 and (lda % 8 or lda < size_k):
        raise ValueError(f"A.stride(0) = {lda} must be >= size_k = {size_k} and divisible by 8 (16-byte rows)")
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
        if weight is ScalarType.FE4M3FN:
            raise ValueError("act-order (g_idx, perm) is not defined for fe4m3fn weights")
        if is_k_full and num_groups == 1:
            raise ValueError("For act_order, num_groups must be > 1")
    if num_groups <= 0 or size_k % num_groups:
        raise ValueError(f"size_k = {size_k}, is not divisible by b_scales.size(0) = {num_groups}")
    group_size = -1 if num_groups == 1 else size_k // num_groups
    if num_groups > 1 and not (has_act_order and not is_k_full) and group_size not in GROUP_SIZES:
        raise ValueError(f"group size = size_k / num_groups = {size_k} / {num_groups} = {group_size} is not one of "
                         f"{GROUP_SIZES} (or channelwise)")
    if weight is ScalarType.FE4M3FN and num_groups > 1 and group_size != 128:
        raise ValueError(f"fe4m3fn weights take channelwise or group-128 scales, got group size {group_size}")
    has_zp = not _is_empty(b_zeros)
    if has_zp and not weight.has_zero_points:
        raise ValueError(f"b_type must be u4 or u8 when has_zp = True. Got = {weight}")
    if not has_zp and weight.has_zero_points:
        raise ValueError(f"b_type must be u4b8, u8b128 or fe4m3fn when has_zp = False. Got = {weight}")
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


def _stream_ptr(stream) -> int:
    if stream is None:
        return _cupy().cuda.get_current_stream().ptr
    if isinstance(stream, (int, np.integer)):
        return int(stream)
    return int(stream.ptr)


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
_FAST_ARRAY: Any = None  # cupy.ndarray once looked up; the plan cache serves CuPy arrays only


def _fast_array_type():
    global _FAST_ARRAY
    if _FAST_ARRAY is None:
        try:
            import cupy

            _FAST_ARRAY = cupy.ndarray
        except ImportError:  # pragma: no cover - environment
            _FAST_ARRAY = type("NoCuPy", (), {})
    return _FAST_ARRAY


def _meta(x, array_type):
    """(shape, strides, dtype) of an optional CuPy array, None for None; _SLOW for anything else."""
    if x is None:
        return None
    if type(x) is not array_type:
        return _SLOW
    return x.shape, x.strides, x.dtype


_SLOW = object()
_FLAG_TYPES = (bool, int)


def _plan_key(a, b_q_weight, b_scales, b_zeros, g_idx, perm, workspace, b_q_type, size_m, size_n, size_k, is_k_full,
              use_atomic_add, use_fp32_reduce, c, c_tmp, a_tmp, deterministic, sms):
    """Everything the checks of gptq_marlin_gemm read except addresses and devices of the other arrays, or None
    when an input is not of the cached kind (then every check runs). Exact types for the ints: 1.0, True and
    np.int64(1) compare equal to 1 but are checked differently."""
    nd = _fast_array_type()
    if (type(a) is not nd or type(b_q_weight) is not nd or type(b_scales) is not nd or type(workspace) is not nd
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
            bool(deterministic), sms)


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
                     *, c=None, c_tmp=None, a_tmp=None, deterministic: bool = False, stream=None, sms: int = -1):
    """vLLM's ``gptq_marlin_gemm`` (with the newer ``use_atomic_add``): C = A @ dequant(B), on CuPy arrays.

    ``b_zeros``/``g_idx``/``perm`` may be None or empty. ``c`` (M, N) is allocated when None, and so is ``a_tmp``
    for act-order; ``c_tmp`` None takes the per-(device, stream, SMs) buffer of ``scratch_buffers``. Pass ``c``,
    ``c_tmp``/``a_tmp`` and ``workspace`` to keep allocation out of the call (CUDA-graph capture).

    Every check runs on the first call with a given set of shapes, strides, dtypes, flags and device; repeated calls
    with the same ones (CuPy arrays) reuse that verdict and re-check only what can change under equal shapes: the
    device of every array and each address (non-null, 16-byte aligned).
    """
    key = _plan_key(a, b_q_weight, b_scales, b_zeros, g_idx, perm, workspace, b_q_type, size_m, size_n, size_k,
                    is_k_full, use_atomic_add, use_fp32_reduce, c, c_tmp, a_tmp, deterministic, sms)
    plan = _array_plans.get(key) if key is not None else None
    if plan is None:
        return _gptq_marlin_gemm_checked(key, a, b_q_weight, b_scales, b_zeros, g_idx, perm, workspace, b_q_type,
                                         size_m, size_n, size_k, is_k_full, use_atomic_add, use_fp32_reduce, c,
                                         c_tmp, a_tmp, deterministic, stream, sms)
    device = plan.device
    pointers = (a.data.ptr, _address_on(b_q_weight, device, "b_q_weight"), _address_on(b_scales, device, "b_scales"),
                _address_on(b_zeros, device, "b_zeros") if plan.prepared.has_zero_points else 0,
                _address_on(g_idx, device, "g_idx") if plan.act_order else 0,
                _address_on(perm, device, "perm") if plan.act_order else 0,
                _address_on(workspace, device, "workspace"))
    stream_ptr = _stream_ptr(stream)
    if c is None or (a_tmp is None and plan.act_order):
        cupy = _cupy()
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


def _outputs(plan: _ArrayPlan, c, a_tmp, cupy):
    if c is None:
        c = cupy.empty(plan.out_shape, dtype=plan.out_dtype)
    if a_tmp is None and plan.act_order:
        a_tmp = cupy.empty((max(plan.out_shape[0], 1), plan.prepared.k), dtype=plan.out_dtype)
    return c, a_tmp


def _gptq_marlin_gemm_checked(key, a, b_q_weight, b_scales, b_zeros, g_idx, perm, workspace, b_q_type, size_m,
                              size_n, size_k, is_k_full, use_atomic_add, use_fp32_reduce, c, c_tmp, a_tmp,
                              deterministic, stream, sms, launch: bool = True):
    """Every check, in order, then the launch; the verdict is kept under ``key`` (None: not kept). With ``launch``
    False: the checks only, returning the plan (``plan_marlin_gemm``)."""
    if use_atomic_add and deterministic:
        raise ValueError("use_atomic_add cannot be deterministic: atomics sum in arrival order")
    plan = check_gemm_shapes(a, b_q_weight, b_scales, b_zeros, g_idx, perm, b_q_type, size_m, size_n, size_k,
                             is_k_full, c)
    if isinstance(sms, bool) or not isinstance(sms, (int, np.integer)):
        raise TypeError(f"sms must be an int, got {type(sms).__name__}")
    a_ptr, device = _device_ptr(a, "A")
    device_sms = device_properties(device)[1]
    sms = device_sms if sms <= 0 else int(sms)
    stream_ptr = _stream_ptr(stream)
    uses_c_tmp = bool(use_fp32_reduce) and not use_atomic_add
    cupy = _cupy()
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
        ptr, dev = _device_ptr(x, name)
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
    prepared = prepare_launch(record)  # every record-level rule (check_launch) on this first call
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
    cupy = _cupy()
    up = (lambda x: None if x is None else cupy.asarray(np.ascontiguousarray(x)))
    return dataclasses.replace(weight, qweight=up(weight.qweight), scales=up(weight.scales), zeros=up(weight.zeros),
                               g_idx=up(weight.g_idx), perm=up(weight.perm))


_scratch: dict[tuple[int, int, int], tuple[Any, Any]] = {}


def scratch_buffers(device: int, stream_ptr: int, sms: int):
    """(workspace, c_tmp) kept per (device, stream, sms): launches on one stream run in order, so they can share
    the lock counters (left zero) and the partial-sum buffer; concurrent streams get their own."""
    key = (device, stream_ptr, sms)
    if key not in _scratch:
        cupy = _cupy()
        with cupy.cuda.Device(device):
            _scratch[key] = (cupy.zeros(workspace_numel(sms), dtype=np.int32),
                             cupy.empty(c_tmp_numel(sms), dtype=np.float32))
    return _scratch[key]


def marlin_gemm(a, weight, *, c=None, is_k_full: bool | None = None, use_atomic_add: bool = False,
                use_fp32_reduce: bool = True, deterministic: bool = False, workspace=None, c_tmp=None, a_tmp=None,
                stream=None, sms: int = -1):
    """C = a @ dequant(weight) for a ``MarlinWeight`` on the GPU (see ``upload_weight``). a: (M, K) CuPy array.

    Numerics: fp32 accumulation, one rounding to the activation type at the end. Most integer-weight kernels at
    M <= 16 (``KernelConfig.late_scale``; not act-order groups) apply the scales to fp32 partial sums, so the weight is
    never rounded to the activation type there: results may differ from a @ (the rounded dequantized weight) by one
    rounding more, towards the exact product."""
    if getattr(weight, "num_experts", None) is not None:
        raise ValueError("weight is a stack of experts; pick one with weight.expert(e) (the fused MoE GEMM is issue 7)")
    nd = _fast_array_type()
    for field in ("qweight", "scales"):
        x = getattr(weight, field)
        if type(x) is not nd and getattr(x, "__cuda_array_interface__", None) is None:
            raise TypeError(f"weight.{field} is not on GPU; call workbench.gemm.upload_weight(weight) once first")
    device = a.data.device_id if type(a) is nd else _device_ptr(a, "A")[1]
    stream_ptr = _stream_ptr(stream)
    if workspace is None or (c_tmp is None and use_fp32_reduce and not use_atomic_add):
        n_sms = device_properties(device)[1] if sms <= 0 else sms
        ws, ct = scratch_buffers(device, stream_ptr, n_sms)
        workspace = ws if workspace is None else workspace
        c_tmp = ct if c_tmp is None else c_tmp
    k_full = weight.is_k_full if is_k_full is None else is_k_full
    size_m = int(a.shape[0]) if len(a.shape) == 2 else -1
    return gptq_marlin_gemm(a, weight.qweight, weight.scales, weight.zeros, weight.g_idx, weight.perm, workspace,
                            weight.weight_type, size_m, weight.size_n, weight.size_k, is_k_full=k_full,
                            use_atomic_add=use_atomic_add, use_fp32_reduce=use_fp32_reduce, c=c, c_tmp=c_tmp,
                            a_tmp=a_tmp, deterministic=deterministic, stream=stream_ptr, sms=sms)


def plan_marlin_gemm(a, weight, *, c, workspace, c_tmp=None, a_tmp=None, is_k_full: bool | None = None,
                     use_atomic_add: bool = False, use_fp32_reduce: bool = True, deterministic: bool = False,
                     stream=None, sms: int = -1) -> PreparedLaunch:
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
                                     launch=False).prepared
