"""The tunables of the native GEMM and MoE kernels' host side, as values: ``GemmPolicy`` and ``MoePolicy``.

A policy is a frozen dataclass. Every function that chooses a kernel configuration, a grid or a launch form takes
``policy=`` (the default instance when omitted), and every plan cache keys on the policy's value, so an experiment is

    fast = dataclasses.replace(DEFAULT_GEMM_POLICY, align_slices=False)
    gemm.marlin_gemm(a, w, policy=fast)

and never a module switch flipped at run time. Each field carries its default and the reason for it in words; what
the measurements taught is in docs/performance.md.

Tables that were dicts are tuples of ``(key, value)`` pairs here (a policy must be hashable): see ``lookup``.

Deprecated for one release: the environment variable ``WORKBENCH_PROGRAMMATIC_LAUNCH=0`` still switches the default
policy's launch form (with a DeprecationWarning), and the old module globals of ``workbench.gemm`` /
``workbench.moe`` (``gemm.ALIGN_SLICES`` ...) still read and write the module's default policy, with a
DeprecationWarning naming the field to use instead. Removed, with a DeprecationWarning saying so where they are still
set: ``WORKBENCH_DIRECT_LAUNCH`` / ``gemm.DIRECT_LAUNCH`` / ``GemmPolicy.direct_launch`` (every launch goes through
the runtime's one launch call; the CuPy-call fallback is gone) and ``swap_max_m`` above 8 (the swapped loop's 16-row
form is gone).
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import warnings
from typing import Any

from workbench.scalar_types import ScalarType

_F16, _BF16 = ScalarType.F16, ScalarType.BF16


def lookup(table: tuple, key, default=None):
    """The value of ``key`` in a policy table of (key, value) pairs, ``default`` when it has none."""
    for k, v in table:
        if k == key:
            return v
    return default


_tokens: dict = {}  # policy value -> its token
_next_token = itertools.count()


class _Hashed:
    """A frozen dataclass whose hash is computed once, with ``token``: a small int that equal policies share, for
    plan caches that key on the policy on every call (an int hashes in C, a dataclass in Python)."""

    def __hash__(self) -> int:
        return self._hash

    @functools.cached_property
    def _hash(self) -> int:  # (cached_property writes the instance dict directly: allowed on frozen dataclasses)
        return hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self)))

    @functools.cached_property
    def token(self) -> int:
        return _tokens.setdefault(self, next(_next_token))


@dataclasses.dataclass(frozen=True, eq=True)
class GemmPolicy(_Hashed):
    """How ``workbench.gemm`` chooses a dense GEMM's kernel, grid and launch. Shapes are (n_tiles, k_warp) pairs of
    ``gemm.thread_shapes()``; "plain" weights have neither zero points nor act-order groups; "pairs" are slices of
    two blocks each (one per SM) whose partial sums a cluster of two adds in shared memory."""

    # ---- tile shapes, in order of preference --------------------------------------------------------------------
    # small M streams weights: long BK spreads a pipeline step's fixed cost (barrier, address math) over more tiles
    small_m_shapes: tuple = ((2, 4), (2, 2), (1, 2), (1, 1), (2, 1), (4, 2))
    # three or more m16 blocks reuse each A stage over 256 columns
    large_m_shapes: tuple = ((4, 2), (2, 2), (2, 1), (1, 1))
    # 8-bit weights at M <= 16: the 64 x 256 tile first; it beat the 256 x 128 tile on the 8-bit layers swept
    eight_bit_one_m_block_shapes: tuple = ((4, 2), (2, 4), (2, 2), (1, 2), (1, 1), (2, 1))
    # 4-bit pairs try the 512 x 64 tile before 256 x 64: half the stages of twice the bytes won on 4096-column layers
    four_bit_pair_shapes: tuple = ((2, 4), (2, 2), (1, 4), (1, 2), (1, 1), (2, 1), (4, 2))

    # ---- pipeline stages, in order of preference ------------------------------------------------------------------
    # one m16 block, one block per SM, by weight bits: 4-bit kernels were fastest with 6 stages on every one-block
    # cell swept, 8-bit ones on the 64 x 256 tile with 4
    one_m_block_stages: tuple = ((4, (6, 8, 4)), (8, (4, 6, 8)))
    # one m16 block of another weight width: deep rings keep enough weight bytes in flight per SM for HBM
    one_m_block_default_stages: tuple = (8, 6, 4)
    # two m16 blocks: deep rings first (not swept separately)
    two_m_block_stages: tuple = (8, 6, 4)
    # three or four m16 blocks: the accumulators leave room for 4 stages at most
    large_m_stages: tuple = (4, 3)
    # one-block pairs by (weight bits, tile, swapped): a shallow ring lands a block's first stages sooner and beat
    # deeper ones on every 4-bit pair cell and the 8-bit 256 x 128 ones; other tiles use the stage order above
    pair_stages: tuple = (((4, (1, 2), True), (4, 6, 8)), ((4, (1, 2), False), (8, 6, 4)),
                          ((4, (1, 4), True), (3, 4, 6)), ((4, (1, 4), False), (3, 6, 4)),
                          ((4, (2, 4), True), (3, 4, 6)), ((4, (2, 4), False), (3, 6, 4)),
                          ((4, (2, 8), False), (3, 4)),
                          ((8, (2, 4), True), (3, 4)), ((8, (2, 4), False), (3, 4)))
    # two blocks per SM: rings that fit half an SM, deeper first
    two_block_stages: tuple = (4, 3)
    # two-block pairs: the shallower ring first (a block's first stages land sooner)
    two_block_pair_stages: tuple = (3, 4)

    # ---- two blocks per SM (kernel cut to 128 registers) -----------------------------------------------------------
    # only 4-bit weights: 8-bit stages hold twice the bytes, and only shallow rings fit beside a second block
    two_blocks_weight_bits: tuple = (4,)
    # only when each of the 2 x SMs blocks gets this many pipeline steps: with fewer, every slice is shared by many
    # blocks and the cross-block reduction dominates
    two_blocks_min_steps: int = 7
    # swapped kernels of plain weights need one step more: one block per SM on the aligned grid won below it
    two_blocks_min_steps_swap: int = 8

    # ---- pairs (sm_90+, fp32 reduction, M <= 16) -------------------------------------------------------------------
    # pairs fill the SMs where a layer has too few slices for one block per slice per SM (the partition does not
    # depend on cluster_sums: without the cluster sums the same grid sums in global memory)
    pair_clusters: bool = True
    # the first tile whose slices, two blocks each, fill at least this share of the SMs (and no more than all)
    pair_min_fill: float = 0.9
    # ... when each block then has at most this many pipeline steps: longer ranges lost to two blocks per SM
    pair_max_steps: int = 32
    # zero-point and act-order kernels: pairs only up to this many steps (longer ones lost)
    pair_max_steps_not_plain: int = 16
    # activation types whose first-choice tile takes pairs past the step limit: the per-warp pipeline made the
    # one-block kernels beat two blocks per SM there
    pair_long_acts: tuple = (_F16, _BF16)
    # ... and whether zero-point kernels may (act-order ones never): they gained most (two-block zero-point kernels
    # spill at 128 registers)
    pair_long_zero_points: bool = True
    # activation types of the swapped two-block pairs (plain 4-bit weights, the first tile filling the SMs only with
    # two blocks per SM)
    two_block_pair_acts: tuple = (_F16, _BF16)
    # two-block pairs: the share of the SMs the first tile's slices must fill, one block pair each
    pair_two_block_min_fill: float = 0.8
    # 8-bit fp16 rows-layout kernels (M = 9..16) in two-block pairs where one fits half an SM: faster on the
    # 4096 x 14336 layers measured
    pair_two_block_eight_bit_rows: bool = True

    # ---- the 512 x 128 tile for 4-bit rows-layout kernels at M = 9..16 ---------------------------------------------
    # a warp's 128 rows of a stage are one whole group, so late scaling flushes once per 8 k16 tiles instead of 4;
    # it won in pairs, alone on the aligned grid and striped, before the two-block kernels
    rows_wide_first: bool = True
    # the tile (n_tiles, k_warp) of that rule
    rows_wide_tile: tuple = (2, 8)
    # its stages (3 needs 176,128 bytes of shared memory: sm_90; 4 was half a percent behind)
    rows_wide_stages: tuple = (3, 4)
    # only where a block gets at least this many stages
    rows_wide_min_steps: int = 8

    # ---- operand swap ---------------------------------------------------------------------------------------------
    # the swapped loop (one mma per 16 x 16 sub-block) for M <= this (at most 8; 0 = never)
    swap_max_m: int = 8

    # ---- grids ------------------------------------------------------------------------------------------------------
    # slice-aligned grids (every block inside one slice): a block straddling a slice end costs more than a few steps
    align_slices: bool = True
    # ... taken unless the longest range grows past this factor of the striped grid's (one block per SM): a 17%
    # longer aligned grid lost or tied
    aligned_max_longer: float = 1.15
    # ... for one-block swapped kernels: these took the aligned grid up to 20% longer and won
    aligned_max_longer_swap: float = 1.2
    # ... plus this many steps
    aligned_extra_steps: int = 0
    # swapped two-block kernels of plain weights take the aligned grid up to aligned_max_longer too (one block per
    # slice there: no cross-block sum); zero-point ones lost, so keep the striped grid
    aligned_swap_two_blocks: bool = True

    # ---- thread-block clusters (sm_90+) -----------------------------------------------------------------------------
    # a slice's blocks add their partials in each other's shared memory (bitwise the fp32 reduction's order)
    cluster_sums: bool = True
    # cluster sizes taken: 2 was faster wherever it ran; 4 and 8 ran partly in a second wave (a GPC holds whole
    # clusters only)
    cluster_sizes: tuple = (2,)

    # ---- launches ----------------------------------------------------------------------------------------------------
    # programmatic dependent launch on sm_90+: a GEMM's blocks fetch their first weight stage while the kernel before
    # it finishes (back-to-back GEMMs gained most)
    programmatic_launch: bool = True
    # a programmatic launch asks for just enough shared memory that no more blocks per SM fit than planned: blocks
    # placed beside a running grid otherwise stacked on the SMs it left idle
    programmatic_pin_occupancy: bool = True

    # ---- batch-invariant mode (batch_invariant=True: row r of C the same bits for every M) ------------------------
    # One tile for every M, the first of these that divides (K, N) and the group size and fits at every m16 block
    # count. The mode runs its own kernels (marlin_gemm_invariant), which never late-scale, so the 16-row kernel sums a
    # row as the 32..64-row ones of the same tile do; the first choice is the default's tile at M >= 33 (64 x 256),
    # so from M = 33 up the mode runs the default's kernel shape. No pairs of its own choosing, one block per SM.
    invariant_shapes: tuple = ((4, 2), (2, 2), (2, 1), (1, 1))
    # the swapped loop for M <= swap_max_m (not late-scaled: it sums a row as the row layout on the same tile)
    invariant_swap: bool = True
    # The K split is planned once per layer, for this many blocks (at most the device's SMs) and never for M or the
    # sms argument: each column slice gets s = blocks // slices-per-64-rows blocks (1: no split), each summing
    # ceil(KI / s) or floor(KI / s) k steps, and the s partials are added in fp32 in block order. sms below a launch's
    # blocks is refused.
    invariant_blocks: int = 128
    # ... with at least this many k steps per block (a shorter range pays more for the sum than it streams)
    invariant_min_steps: int = 4
    # M beyond one 64-row chunk with s > 1 and the fp32 reduction: one launch whose blocks walk the chunks in turn
    # (the same k ranges in each) where a launch holds one chunk's blocks; False (and the in-C reduction): one launch
    # per group of chunks that sms blocks hold at once, in order on the caller's stream
    invariant_walk: bool = True
    # ... only where each block sums at most this many k steps of a chunk: the walk won with 8 (4096 x 4096), tied
    # with 28..32 and lost with 112 (28672 x 8192), where launches per chunk overlap one's prologue with the last's end
    invariant_walk_max_steps: int = 16
    # 16-row kernels: (weight bits, F) merge F stages of the tile into one pipeline stage, each warp summing its k16
    # tiles in the tile's order (the same bits), where every block's range is whole merged stages: a stage's fixed
    # cost (barrier, wait, fetch issue) once per F; 4-bit stages of the 64 x 256 tile hold only 8 KB of weights.
    # Off: ((4, 4),) builds and plans (tests/compile, tests/cpu) and its cost is measured (docs/performance.md, Batch
    # invariance); it is taken once tests/gpu/test_invariance.py (test_dense_merged_stages_keep_the_bits) has passed.
    invariant_merge: tuple = ()
    # ... and the rings of merged stages, deeper first
    invariant_merge_stages: tuple = (4, 3)
    # at M <= 16, s blocks per slice summed in a cluster of s (the fp32 slots' order: the same bits) for s in these;
    # a grid whose clusters do not all fit at once sums in global memory instead (PreparedLaunch)
    invariant_cluster_sizes: tuple = (2,)

    # ---- kernel family (workbench.gemm.hopper) -----------------------------------------------------------------------
    # which family runs a call: ((min compute capability, min M, max M, family), ...), the first row whose capability
    # and M range hold wins, "mma_sync" where none does. Empty: the mma.sync kernel everywhere, until the wgmma family
    # ("wgmma", sm_90a) measures faster in a cell (bench/bench_gemm.py, method "ours_wgmma").
    kernel_families: tuple = ()
    # the wgmma family's block tile by M: ((max M, (rows of A per block, warpgroups split M, stages, k per stage)),
    # ...), first row with M <= max M (None: any M): a 32- or 64-row tile whose two warpgroups split each stage's
    # k16 steps for small M, 128 rows split between the warpgroups above; 128-deep stages (a stage's barrier and
    # fetch issue spread over twice the wgmma of a 64-deep one) in rings as deep as one block per SM allows (a slot
    # is refilled two stages after its use: STAGES - 2 stages in flight)
    wgmma_tiles: tuple = ((32, (32, False, 8, 128)), (64, (64, False, 6, 128)), (None, (128, True, 4, 128)))
    # the wgmma family splits K over blocks until about one block per SM runs, each split keeping at least this many
    # 64-row k steps (fewer leave the ring's prologue uncovered)
    wgmma_min_split_stages: int = 4

    def __post_init__(self):
        if self.swap_max_m > 8:
            warnings.warn(f"GemmPolicy(swap_max_m = {self.swap_max_m}): the swapped loop's 16-row form was removed; "
                          f"values above 8 act as 8", DeprecationWarning, stacklevel=3)

    # removed knob, readable for one release (a class attribute, not a field: replace() refuses it): every launch
    # goes through workbench.cuda's launch call
    direct_launch = True

    def one_block_stages(self, bits: int) -> tuple:
        return lookup(self.one_m_block_stages, bits, self.one_m_block_default_stages)

    def pair_stage_order(self, bits: int, tile: tuple, swapped: bool, default: tuple) -> tuple:
        return lookup(self.pair_stages, (bits, tuple(tile), bool(swapped)), default)


@dataclasses.dataclass(frozen=True, eq=True)
class MoePolicy(_Hashed):
    """How ``workbench.moe`` chooses the fused MoE kernel and runs a layer."""

    # (n_tiles, k_warp) in order of preference for items of at most two m16 blocks: few rows per item stream weights,
    # so long K stages spread each stage's fixed cost
    small_shapes: tuple = ((2, 4), (1, 2), (2, 2), (1, 1), (2, 1))
    # 48/64-row items keep K_WARP <= 2 so the accumulators fit in registers ((2, 2) spills with 8-bit weights)
    large_shapes: tuple = ((1, 1), (2, 1))
    # tiles of 128 columns first where the items still give every SM one (else 64-column tiles first); False: the
    # shape order as listed
    prefer_wide_items: bool = True
    # two CTAs per SM for 16-row items only for 4-bit weights (8-bit ones fit only shallow rings beside a second)
    two_blocks_weight_bits: tuple = (4,)
    # CTAs per SM: 0 = the rule (two where the one-CTA grid leaves some CTA more than one item), 1 or 2 to force
    blocks_per_sm: int = 0
    # moe_block_size <= this (8 or 0 = never): the operand-swapped loop
    swap_max_block: int = 8
    # one-CTA kernels of at most two m16 blocks: a shallow ring first lands the first stages sooner
    one_block_stages: tuple = (4, 3, 6, 8)
    # 48/64-row items: the rings that fit beside their accumulators
    large_stages: tuple = (4, 3)
    # two-CTA kernels: rings that fit half an SM, deeper first
    two_block_stages: tuple = (4, 3)
    # fused_moe through cached layer plans launched straight through the driver (False: every call checks)
    layer_plans: bool = True
    # intermediates a layer plan keeps; larger layers allocate them per call (their GEMMs dwarf an allocation)
    plan_max_workspace_bytes: int = 64 << 20
    # programmatic dependent launch of the fused phases on sm_90+ (each waits for the kernel before it)
    programmatic_launch: bool = True
    # the fused GEMMs' programmatic launches pin their CTAs per SM as the dense GEMM's do
    programmatic_pin_occupancy: bool = True
    # the dense GEMM policy of the batched and dense-loop paths
    gemm: GemmPolicy = GemmPolicy()
    # batch-invariant mode (batch_invariant=True): every moe_block_size runs one of these tiles, the first that divides
    # (K, N) and the group size, in the row layout (no swapped loop for 8-row blocks). K_WARP = 1 keeps late scaling out
    # of the 16-row kernels, so a routed row sums in the same order whatever block size its M gives (the CTA owns the
    # whole K of an item: no cross-CTA sum to pin).
    invariant_shapes: tuple = ((2, 1), (1, 1))

    def batch_invariant(self) -> "MoePolicy":
        """This policy with its tile choice pinned for batch invariance (``invariant_shapes`` for every block size, no
        swapped loop): what ``fused_moe(..., batch_invariant=True)`` runs."""
        return _moe_invariant_variant(self)


@functools.lru_cache(maxsize=64)  # (one per policy value: a layer call then pays a lookup, not a new policy's hash)
def _moe_invariant_variant(policy: MoePolicy) -> MoePolicy:
    shapes = tuple(policy.invariant_shapes)
    return dataclasses.replace(policy, small_shapes=shapes, large_shapes=shapes, swap_max_block=0,
                               prefer_wide_items=False)


def _env_off(name: str) -> bool:
    value = os.environ.get(name)
    if value is None:
        return False
    warnings.warn(f"{name} is deprecated and goes in the next release: pass policy="
                  f"dataclasses.replace(workbench.policy.DEFAULT_GEMM_POLICY, ...) instead", DeprecationWarning,
                  stacklevel=3)
    return value == "0"


def _defaults() -> tuple[GemmPolicy, MoePolicy]:
    programmatic = not _env_off("WORKBENCH_PROGRAMMATIC_LAUNCH")
    if os.environ.get("WORKBENCH_DIRECT_LAUNCH") is not None:
        warnings.warn("WORKBENCH_DIRECT_LAUNCH was removed and has no effect: every launch goes through the runtime's "
                      "one launch call (workbench.cuda)", DeprecationWarning, stacklevel=2)
    g = GemmPolicy(programmatic_launch=programmatic)
    return g, MoePolicy(programmatic_launch=programmatic, gemm=g)


# (dataclass(eq=True, frozen=True) writes a field-by-field __hash__ into each class: the cached one replaces it)
GemmPolicy.__hash__ = MoePolicy.__hash__ = _Hashed.__hash__
DEFAULT_GEMM_POLICY, DEFAULT_MOE_POLICY = _defaults()


# ---------------------------------------------------------------------------------------------------------------
# The old module globals (deprecated for one release)
# ---------------------------------------------------------------------------------------------------------------
def _dict_to_pairs(table: dict) -> tuple:
    return tuple(sorted(table.items()))


def _pair_stages_from_dict(table: dict) -> tuple:
    return tuple(((bits, tuple(tile), bool(swapped)), tuple(stages))
                 for (bits, tile), by_swap in sorted(table.items()) for swapped, stages in sorted(by_swap.items()))


def _pair_stages_to_dict(pairs: tuple) -> dict:
    out: dict = {}
    for (bits, tile, swapped), stages in pairs:
        out.setdefault((bits, tile), {})[swapped] = stages
    return out


# old name -> (field, value -> field value, field value -> old value)
_same = (lambda v: v, lambda v: v)
GEMM_GLOBALS: dict[str, tuple[str, Any, Any]] = {
    "ONE_M_BLOCK_STAGES": ("one_m_block_stages", _dict_to_pairs, dict),
    "PAIR_STAGES": ("pair_stages", _pair_stages_from_dict, _pair_stages_to_dict),
    "EIGHT_BIT_ONE_M_BLOCK_SHAPES": ("eight_bit_one_m_block_shapes", *_same),
    "FOUR_BIT_PAIR_SHAPES": ("four_bit_pair_shapes", *_same),
    "_SMALL_M_SHAPES": ("small_m_shapes", *_same), "_LARGE_M_SHAPES": ("large_m_shapes", *_same),
    **{name: (name.lower(), *_same) for name in (
        "TWO_BLOCKS_WEIGHT_BITS", "TWO_BLOCKS_MIN_STEPS", "TWO_BLOCKS_MIN_STEPS_SWAP", "PAIR_CLUSTERS",
        "PAIR_MIN_FILL", "PAIR_MAX_STEPS", "PAIR_MAX_STEPS_NOT_PLAIN", "PAIR_LONG_ACTS", "PAIR_LONG_ZERO_POINTS",
        "TWO_BLOCK_PAIR_ACTS", "PAIR_TWO_BLOCK_MIN_FILL", "PAIR_TWO_BLOCK_EIGHT_BIT_ROWS", "ROWS_WIDE_FIRST",
        "ROWS_WIDE_TILE", "ROWS_WIDE_STAGES", "ROWS_WIDE_MIN_STEPS", "SWAP_MAX_M", "ALIGN_SLICES",
        "ALIGNED_MAX_LONGER", "ALIGNED_MAX_LONGER_SWAP", "ALIGNED_EXTRA_STEPS", "ALIGNED_SWAP_TWO_BLOCKS",
        "CLUSTER_SUMS", "CLUSTER_SIZES", "PROGRAMMATIC_LAUNCH", "PROGRAMMATIC_PIN_OCCUPANCY")},
    "DIRECT_LAUNCH": (None, None, lambda _: True),  # removed: reads True, writes warn and change nothing
}
MOE_GLOBALS: dict[str, tuple[str, Any, Any]] = {
    "MOE_TWO_BLOCKS_WEIGHT_BITS": ("two_blocks_weight_bits", *_same),
    "MOE_BLOCKS_PER_SM": ("blocks_per_sm", *_same), "MOE_SWAP_MAX_BLOCK": ("swap_max_block", *_same),
    "MOE_ONE_BLOCK_STAGES": ("one_block_stages", *_same), "_MOE_SHAPES_SMALL": ("small_shapes", *_same),
    "_MOE_SHAPES_LARGE": ("large_shapes", *_same), "LAYER_PLANS": ("layer_plans", *_same),
    "PLAN_MAX_WORKSPACE_BYTES": ("plan_max_workspace_bytes", *_same),
}


def install_deprecated_globals(module_name: str, table: dict, policy_type: str,
                               policy_attr: str = "_default_policy") -> None:
    """Give module ``module_name`` a class whose old policy globals (``table``) read and write the module's default
    policy (its ``policy_attr``), each time with a DeprecationWarning naming the field of ``policy_type``."""
    import sys
    import types

    def warn(name: str) -> str | None:
        field = table[name][0]
        if field is None:
            warnings.warn(f"{module_name}.{name} was removed and has no effect (workbench.policy)", DeprecationWarning,
                          stacklevel=3)
            return None
        warnings.warn(f"{module_name}.{name} is deprecated and goes in the next release: pass "
                      f"policy=dataclasses.replace({policy_type}, {field}=...) to the call instead "
                      f"(workbench.policy)", DeprecationWarning, stacklevel=3)
        return field

    class Module(types.ModuleType):
        def __getattr__(self, name):  # only for names the module does not have
            if name in table:
                field = warn(name)
                return table[name][2](None if field is None else getattr(self.__dict__[policy_attr], field))
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")

        def __setattr__(self, name, value):
            if name in table:
                field = warn(name)
                if field is None:
                    return
                policy = self.__dict__[policy_attr]
                value = dataclasses.replace(policy, **{field: table[name][1](value)})
                name = policy_attr
            super().__setattr__(name, value)

        def __delattr__(self, name):
            if name in table:
                raise AttributeError(f"{module_name}.{name} is deprecated; it lives in {policy_type} now")
            super().__delattr__(name)

    sys.modules[module_name].__class__ = Module


# ---------------------------------------------------------------------------------------------------------------
# Repack kernels (kernels_numba/marlin_repack.py). Each default is the fastest measured choice; the measured shares
# of copy bandwidth are in docs/performance.md, "Repack kernels". Per-width fields are ((4, u4 value), (8, u8 value)).
# ---------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, eq=True)
class RepackPolicy(_Hashed):
    """Launch shapes and routes of the Numba weight repacks; the wrappers take ``policy=`` (this default when
    omitted)."""

    # GPTQ rows -> Marlin, k-tiles per thread: fastest of 1/2/4 (more loads in flight is what u4 lacks)
    direct_k_tiles_per_thread: tuple = ((4, 4), (8, 2))
    # Marlin -> GPTQ rows (u4; u8 takes the paired kernel): 4 k-tiles as the forward kernel, fastest of 1/2/4
    direct_unpack_k_tiles_per_thread: tuple = ((4, 4), (8, 1))
    # stacked act-order one-pass gather: fastest of 1/2 k-tiles per thread
    perm_k_tiles_per_thread: tuple = ((4, 2), (8, 1))
    # AWQ -> Marlin: 1 k-tile per thread fastest of 1/2/4
    awq_k_tiles_per_thread: tuple = ((4, 1), (8, 1))
    # AWQ -> Marlin on the n-fastest grid (blocks in flight write whole rows): faster than k-fastest, both widths
    awq_repack_n_fastest: bool = True
    # act-order on one matrix in two passes (N-packed intermediate): faster than the one-pass gather, both widths
    act_order_two_pass: bool = True
    # two-pass act-order, pass 2 k-tiles per thread: fastest of 1/2
    act_order_pass2_k_tiles_per_thread: tuple = ((4, 2), (8, 1))
    # pass 2 on the n-fastest grid: slightly faster than k-fastest, both widths
    act_order_pass2_n_fastest: bool = True
    # Marlin -> AWQ with 8-byte stores (whole sectors per warp store): faster, both widths
    awq_unpack_wide_stores: bool = True
    # Marlin -> AWQ on the n-fastest grid (whole rows read and written): faster than k-fastest, both widths
    awq_unpack_n_fastest: bool = True
    # Marlin -> GPTQ u8 / FP8 raw bits through the paired 8-byte-store kernel: faster than the direct unpack
    paired_unpack_8bit: bool = True
    # paired kernel k-tiles per thread: 1 fastest of {1, 2}
    paired_unpack_k_tiles_per_thread: int = 1

    def per_bits(self, field: str, bits: int) -> int:
        """A per-width field's value for ``bits``."""
        return lookup(getattr(self, field), bits)


DEFAULT_REPACK_POLICY = RepackPolicy()
REPACK_GLOBALS: dict[str, tuple[str, Any, Any]] = {
    **{name: (name.lower(), _dict_to_pairs, dict) for name in (
        "DIRECT_K_TILES_PER_THREAD", "DIRECT_UNPACK_K_TILES_PER_THREAD", "PERM_K_TILES_PER_THREAD",
        "AWQ_K_TILES_PER_THREAD", "ACT_ORDER_PASS2_K_TILES_PER_THREAD")},
    **{name: (name.lower(), *_same) for name in (
        "AWQ_REPACK_N_FASTEST", "ACT_ORDER_TWO_PASS", "ACT_ORDER_PASS2_N_FASTEST", "AWQ_UNPACK_WIDE_STORES",
        "AWQ_UNPACK_N_FASTEST", "PAIRED_UNPACK_8BIT", "PAIRED_UNPACK_K_TILES_PER_THREAD")},
    # removed with the inverse tile's earlier modes: reads the one mode left, writes warn and change nothing
    "TRANSPOSE_INVERSE_MODE": (None, None, lambda _: "staged_marlin"),
    # removed (the AWQ unpack always moves fields by the transpose network): reads True, writes warn
    "AWQ_UNPACK_TRANSPOSE": (None, None, lambda _: True),
}
