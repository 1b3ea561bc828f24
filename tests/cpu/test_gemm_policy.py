"""The kernel-choice policy (workbench.gemm.choose_config / grid_blocks) on the H200's limits, pinned cell by cell
to what the configuration sweeps measured fastest (docs/performance.md, "The dense GEMM"), and the earlier policy
(OLD_POLICY below, a bench/ab.py variant) pinned to what it chose, so that an A/B run given it times what it claims
to. Percentages in the comments: the measured gain of the choice over the alternative named."""
from __future__ import annotations

import dataclasses
import sys

import pytest

from workbench import gemm
from workbench.policy import DEFAULT_GEMM_POLICY
from workbench.scalar_types import ScalarType as S

# the earlier policy: 8 stages first for M <= 16, the (2, 4) tile first for 8-bit, aligned grids only
# when no longer than the striped one (an A/B variant: bench/ab.py --variant with these fields)
OLD_POLICY = dataclasses.replace(
    DEFAULT_GEMM_POLICY, one_m_block_stages=((4, (8, 6, 4)), (8, (8, 6, 4))),
    eight_bit_one_m_block_shapes=DEFAULT_GEMM_POLICY.small_m_shapes, aligned_max_longer=1.0,
    aligned_max_longer_swap=1.0, two_blocks_min_steps_swap=DEFAULT_GEMM_POLICY.two_blocks_min_steps,
    rows_wide_first=False)

SMS, SMEM_LIMIT, SM_SMEM = 132, 232448, 233472  # H200
GROUP = {S.U4B8: 128, S.U4: 128, S.U8B128: 128, S.FE4M3FN: -1}


def choice(weight, m, k, n, policy=None):
    """(n_tiles, k_warp, stages, blocks per SM, grid) for fp16 activations on the H200."""
    cfg = gemm.choose_config(S.F16, weight, m, n, k, GROUP[weight], False, SMEM_LIMIT, sm_smem=SM_SMEM, sms=SMS,
                             policy=policy)
    return cfg.n_tiles, cfg.k_warp, cfg.stages, cfg.blocks_per_sm, gemm.grid_blocks(cfg, m, n, k, SMS, policy=policy)


def replaced(**fields):
    return dataclasses.replace(DEFAULT_GEMM_POLICY, **fields)


# (weight, M, K, N) -> (the policy's choice, OLD_POLICY's choice)
CELLS = [
    # 4-bit one block: 6 stages (against 8: 6% on 4096^2 M = 1 and on 14336x4096 M = 16)
    ((S.U4B8, 1, 4096, 4096), (2, 4, 6, 1, 128), (2, 4, 8, 1, 128)),
    # M = 9..16: the 512 x 128 tile, 3 stages (GemmPolicy.rows_wide_first)
    ((S.U4B8, 16, 4096, 4096), (2, 8, 3, 1, 128), (2, 4, 8, 1, 128)),
    ((S.U4B8, 8, 14336, 4096), (2, 4, 6, 1, 128), (2, 4, 8, 1, 128)),
    # the slice-aligned 112 grid, 16 steps instead of the striped 132 with ~14 (M = 2: 25%)
    ((S.U4B8, 1, 4096, 14336), (2, 4, 6, 1, 112), (2, 4, 8, 1, 132)),
    ((S.U4B8, 16, 4096, 14336), (2, 8, 3, 1, 112), (2, 4, 8, 1, 132)),
    # one block on the aligned 128 for the swapped u4b8 kernel of 8192^2 (7.8 steps with two; 4% at M = 1..8); zero
    # points keep two blocks (one was 2% slower)
    ((S.U4B8, 1, 8192, 8192), (2, 4, 6, 1, 128), (2, 4, 3, 2, 256)),
    ((S.U4B8, 8, 8192, 8192), (2, 4, 6, 1, 128), (2, 4, 3, 2, 256)),
    ((S.U4, 1, 8192, 8192), (2, 4, 3, 2, 256), (2, 4, 3, 2, 256)),
    # M = 16: one block of the 512 x 128 tile (against two blocks per SM: 11% on 8192x28672; the two-block kernel's
    # aligned 224 there, 32 steps vs 28, lost 5%)
    ((S.U4B8, 16, 8192, 8192), (2, 8, 3, 1, 128), (2, 4, 3, 2, 256)),
    ((S.U4B8, 16, 8192, 28672), (2, 8, 3, 1, 132), (2, 4, 3, 2, 264)),
    # ... except swapped ones without zero points (M = 1: 11% on the aligned 224)
    ((S.U4B8, 1, 8192, 28672), (2, 4, 3, 2, 224), (2, 4, 3, 2, 264)),
    ((S.U4, 1, 8192, 28672), (2, 4, 3, 2, 264), (2, 4, 3, 2, 264)),
    ((S.U4B8, 1, 28672, 8192), (2, 4, 3, 2, 256), (2, 4, 3, 2, 256)),
    # M = 32 (two m16 blocks): stages as before, the aligned grid where it is at most 15% longer
    ((S.U4B8, 32, 4096, 14336), (2, 4, 6, 1, 112), (2, 4, 6, 1, 132)),
    ((S.U4B8, 32, 4096, 4096), (2, 4, 6, 1, 128), (2, 4, 6, 1, 128)),
    # M = 64: the (4, 2) tile, aligned 112 / 128 grids now where at most 15% longer (not 8192x28672: 128 vs 109)
    ((S.U4B8, 64, 4096, 14336), (4, 2, 4, 1, 112), (4, 2, 4, 1, 132)),
    ((S.U4B8, 64, 28672, 8192), (4, 2, 4, 1, 128), (4, 2, 4, 1, 132)),
    ((S.U4B8, 64, 8192, 8192), (4, 2, 4, 1, 128), (4, 2, 4, 1, 128)),
    ((S.U4B8, 64, 8192, 28672), (4, 2, 4, 1, 132), (4, 2, 4, 1, 132)),
    # 8-bit, M <= 16: the (4, 2) tile, 4 stages (FP8 8192^2 M = 16 9%, 4096x14336 M = 16 14% with the aligned 112;
    # u8b128 8192^2 M = 16 5%); on 8192x28672 (aligned: 128 vs 109 steps) the aligned grid for the swapped kernel
    # (M = 1: 7%), striped at M = 16
    ((S.FE4M3FN, 1, 8192, 28672), (4, 2, 4, 1, 112), (2, 4, 4, 1, 132)),
    ((S.FE4M3FN, 16, 4096, 14336), (4, 2, 4, 1, 112), (2, 4, 4, 1, 132)),
    ((S.FE4M3FN, 16, 8192, 8192), (4, 2, 4, 1, 128), (2, 4, 4, 1, 128)),
    ((S.U8B128, 1, 8192, 8192), (4, 2, 4, 1, 128), (2, 4, 4, 1, 128)),
    ((S.U8B128, 16, 8192, 28672), (4, 2, 4, 1, 132), (2, 4, 4, 1, 132)),
    # 8-bit M = 32: the (2, 4) tile as before, aligned grid where within 15%
    ((S.FE4M3FN, 32, 28672, 8192), (2, 4, 4, 1, 128), (2, 4, 4, 1, 132)),
]


@pytest.mark.parametrize("key, new, old", CELLS, ids=lambda v: str(v) if not isinstance(v, tuple) else None)
def test_policy_choices(key, new, old):
    assert choice(*key) == new


@pytest.mark.parametrize("key, new, old", CELLS, ids=lambda v: str(v) if not isinstance(v, tuple) else None)
def test_old_policy_reproduces_its_choices(key, new, old):
    assert choice(*key, policy=OLD_POLICY) == old


def test_aligned_grid_bound():
    """ALIGNED_MAX_LONGER = 1.15: 4096 x 14336's aligned 112 grid (16 steps vs 14) passes, an aligned grid that leaves
    about half the SMs idle does not (here 67 slices of a 16-step K: 67 blocks x 16 steps vs 132 x ~9), nor one
    17% longer (8192 x 28672 at M = 64: 128 vs 109 steps), nor a rows-layout or zero-point two-block kernel's 224 on
    8192 x 28672 (32 vs 28); the swapped u4b8 two-block kernel takes it."""
    p = replaced(rows_wide_first=False)  # (the rows-layout two-block kernel at M = 16 without the wide tile)
    cfg = gemm.choose_config(S.F16, S.U4B8, 1, 14336, 4096, 128, False, SMEM_LIMIT, policy=p)
    assert gemm.grid_blocks(cfg, 1, 14336, 4096, SMS, policy=p) == 112
    assert gemm.grid_blocks(cfg, 1, 67 * 128, 4096, SMS, policy=p) == SMS  # striped: 1072 steps over 132 blocks
    wide = gemm.choose_config(S.F16, S.U4B8, 64, 28672, 8192, 128, False, SMEM_LIMIT, policy=p)
    assert gemm.grid_blocks(wide, 64, 28672, 8192, SMS, policy=p) == SMS
    for weight, m, grid in ((S.U4B8, 16, 2 * SMS), (S.U4, 1, 2 * SMS), (S.U4B8, 1, 224)):
        two = gemm.choose_config(S.F16, weight, m, 28672, 8192, 128, False, SMEM_LIMIT, sm_smem=SM_SMEM, sms=SMS,
                                 policy=p)
        assert two.blocks_per_sm == 2 and gemm.grid_blocks(two, m, 28672, 8192, SMS, policy=p) == grid, (weight, m)


def test_eight_bit_falls_back_when_the_wide_tile_does_not_divide_n():
    """N = 8192 + 128 is no multiple of 256: the (2, 4) tile, with the 8-bit stage order (4 first)."""
    cfg = gemm.choose_config(S.F16, S.FE4M3FN, 1, 8192 + 128, 8192, -1, False, SMEM_LIMIT, sm_smem=SM_SMEM, sms=SMS)
    assert (cfg.n_tiles, cfg.k_warp, cfg.stages) == (2, 4, 4)


@pytest.mark.parametrize("weight", [S.U4B8, S.U8B128, S.FE4M3FN])
@pytest.mark.parametrize("m", [1, 5, 16, 17, 33, 64])
def test_every_choice_fits_and_divides(weight, m):
    for k, n in ((4096, 4096), (4096, 14336), (14336, 4096), (8192, 8192), (8192, 28672), (28672, 8192),
                 (128 * 11, 64 * 13)):
        cfg = gemm.choose_config(S.F16, weight, m, n, k, GROUP[weight], False, SMEM_LIMIT, sm_smem=SM_SMEM, sms=SMS)
        assert k % cfg.block_k == 0 and n % cfg.block_n == 0 and cfg.smem_bytes <= SMEM_LIMIT
        grid = gemm.grid_blocks(cfg, m, n, k, SMS)
        assert 1 <= grid <= SMS * cfg.blocks_per_sm


def test_ab_variant_policy_leaves_the_default_alone():
    """The old-policy A/B variant is a policy value: calls given it choose its configuration, calls without it the
    default's, before and after."""
    def pick(policy=None):
        cfg = gemm.choose_config(S.F16, S.U4B8, 1, 14336, 4096, 128, False, SMEM_LIMIT, sm_smem=SM_SMEM, sms=SMS,
                                 policy=policy)
        return cfg.stages, gemm.grid_blocks(cfg, 1, 14336, 4096, SMS, policy=policy)

    assert pick() == (6, 112)
    assert pick(OLD_POLICY) == (8, 132)
    assert pick() == (6, 112)


def test_policies_are_values():
    """Equal policies are equal and hash alike (plan caches key on them); a replaced field makes another key; the
    default has no unhashable field."""
    a, b = replaced(align_slices=False), replaced(align_slices=False)
    assert a == b and hash(a) == hash(b) and a is not b
    assert a != DEFAULT_GEMM_POLICY and len({a, b, DEFAULT_GEMM_POLICY}) == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.align_slices = True


def test_old_globals_warn_and_reach_the_default_policy():
    """gemm.ALIGN_SLICES and the other old switches still work for one release: reading warns and gives the default
    policy's field, writing warns and replaces the default policy (calls without policy= then follow it)."""
    with pytest.warns(DeprecationWarning, match="align_slices"):
        assert gemm.ALIGN_SLICES is True
    saved = gemm._default()
    try:
        with pytest.warns(DeprecationWarning, match="policy=dataclasses.replace"):
            gemm.ALIGN_SLICES = False
        assert gemm._default() == replaced(align_slices=False)
        assert choice(S.U4B8, 1, 4096, 14336)[4] == SMS  # striped
        with pytest.warns(DeprecationWarning):
            gemm.ONE_M_BLOCK_STAGES = {4: (8, 6, 4), 8: (8, 6, 4)}
        assert gemm._default().one_block_stages(4) == (8, 6, 4)
        with pytest.warns(DeprecationWarning):
            assert gemm.ONE_M_BLOCK_STAGES == {4: (8, 6, 4), 8: (8, 6, 4)}
    finally:
        gemm.__dict__["_default_policy"] = saved
    with pytest.raises(AttributeError):
        gemm.NO_SUCH_SWITCH


# (weight, M, K, N) -> blocks per cluster on the H200 (gemm.cluster_blocks): slice-aligned grids with two blocks per
# slice and 16-row tiles (CLUSTER_SIZES: clusters of 4 measured slower); the kernel also takes 4 and 8.
CLUSTERS = [
    ((S.U4B8, 1, 8192, 8192), 2, 2),  # 64 slices x 2 (13% against the sum through global memory)
    ((S.U4B8, 8, 8192, 8192), 2, 2),
    ((S.FE4M3FN, 1, 4096, 14336), 2, 2),  # (4, 2) tile: 56 x 2
    ((S.FE4M3FN, 16, 4096, 14336), 2, 2),
    ((S.U4B8, 1, 4096, 4096), 1, 4),  # 32 x 4
    ((S.U4B8, 16, 8192, 8192), 2, 2),  # the 512 x 128 tile: 64 x 2
    ((S.U4B8, 1, 28672, 8192), 1, 4),
    ((S.FE4M3FN, 1, 4096, 4096), 1, 8),  # 16 x 8
    ((S.U4B8, 1, 4096, 14336), 1, 1),  # 112 slices, one block each: no cross-block sum at all
    ((S.U4B8, 1, 8192, 28672), 1, 1),  # aligned 224: one block per slice
    ((S.U4B8, 16, 8192, 28672), 1, 1),  # striped 264
    ((S.U4B8, 32, 4096, 4096), 1, 1),  # two m16 blocks
]


@pytest.mark.parametrize("key, cluster, kernel_cluster", CLUSTERS, ids=str)
def test_cluster_choices(key, cluster, kernel_cluster):
    weight, m, k, n = key
    cfg = gemm.choose_config(S.F16, weight, m, n, k, GROUP[weight], False, SMEM_LIMIT, sm_smem=SM_SMEM, sms=SMS)
    grid = gemm.grid_blocks(cfg, m, n, k, SMS)
    assert gemm.cluster_blocks(cfg, m, n, k, grid, 90, True) == cluster
    assert gemm.cluster_blocks(cfg, m, n, k, grid, 90, True, sizes=gemm.KERNEL_CLUSTER_SIZES) == kernel_cluster
    # never without sm_90, the fp32 reduction or the switch
    assert gemm.cluster_blocks(cfg, m, n, k, grid, 80, True) == 1
    assert gemm.cluster_blocks(cfg, m, n, k, grid, 90, False) == 1
    assert gemm.cluster_blocks(cfg, m, n, k, grid, 90, True, enabled=False) == 1


def test_cluster_needs_an_aligned_grid_of_2_4_or_8_blocks_per_slice_each_with_a_step():
    cfg = gemm.KernelConfig(S.F16, S.U4B8, 1, 2, 4, 6, gemm.GROUP_GROUPED, swap=True)  # 256 x 128 tiles
    sizes = gemm.KERNEL_CLUSTER_SIZES
    # K = 2048: 8 steps per slice; N = 256: 2 slices
    assert [gemm.cluster_blocks(cfg, 1, 256, 2048, g, 90, True, sizes=sizes) for g in (2, 3, 4, 6, 8, 16, 18)] == \
        [1, 1, 2, 1, 4, 8, 1]
    assert gemm.cluster_blocks(cfg, 1, 256, 1024, 16, 90, True, sizes=sizes) == 1, "8 blocks need 8 steps per slice"
    assert gemm.cluster_blocks(cfg, 1, 128, 4096, 16, 90, True, sizes=sizes) == 1, "16 blocks per slice"
    assert gemm.cluster_blocks(cfg, 1, 256, 2048, 8, 90, True) == 1, "the policy's sizes: 2 only"


def pair_choice(weight, m, k, n, policy=None):
    """(n_tiles, k_warp, stages, blocks per SM, grid, cluster) on the H200 when slices can be summed in pairs."""
    cfg = gemm.choose_config(S.F16, weight, m, n, k, GROUP[weight], False, SMEM_LIMIT, sm_smem=SM_SMEM, sms=SMS,
                             pairs=gemm.pairs_possible(90, True, policy), policy=policy)
    grid = gemm.grid_blocks(cfg, m, n, k, SMS, policy=policy)
    return cfg.n_tiles, cfg.k_warp, cfg.stages, cfg.blocks_per_sm, grid, gemm.cluster_blocks(cfg, m, n, k, grid, 90,
                                                                                              True, policy=policy)


# (weight, M, K, N) -> the pair policy's choice (GemmPolicy's pair_* fields)
PAIRS = [
    # one-block pairs of 4-bit weights and of the 8-bit 256 x 128 tile: 3 stages first (GemmPolicy.pair_stages)
    ((S.U4B8, 1, 8192, 8192), (2, 4, 3, 1, 128, 2)),
    ((S.U4B8, 16, 8192, 8192), (2, 8, 3, 1, 128, 2)),  # the 512 x 128 tile (GemmPolicy.rows_wide_first)
    ((S.U4B8, 1, 28672, 8192), (2, 4, 3, 1, 128, 2)),  # 56 steps per block, but swapped and the first-choice tile
    ((S.U4B8, 16, 28672, 8192), (2, 8, 3, 1, 128, 2)),  # 28 steps of 512 x 128 (11%)
    # 4-bit: the 512 x 64 tile, 64 slices x 2, 4 steps per block on 4096^2; 8-bit: the 256 x 64 tile, 4 stages
    ((S.U4B8, 1, 4096, 4096), (1, 4, 3, 1, 128, 2)),
    ((S.U4B8, 16, 4096, 4096), (1, 4, 3, 1, 128, 2)),
    ((S.U4B8, 1, 14336, 4096), (1, 4, 3, 1, 128, 2)),  # 14 steps per block (256 x 64: 28; 128 x 64: 56)
    ((S.FE4M3FN, 1, 4096, 4096), (1, 2, 4, 1, 128, 2)),
    ((S.U4, 1, 4096, 4096), (1, 4, 3, 1, 128, 2)),  # zero points, 4 steps: pairs (5%)
    ((S.U4, 1, 14336, 4096), (1, 4, 3, 1, 128, 2)),  # zero points, 14 steps: pairs (9%; 28 steps of 256 x 64 lost 7%)
    # no shape's pairs fill 90% of the SMs one block each; the first's fill 85% two blocks each
    ((S.U4B8, 1, 4096, 14336), (2, 4, 3, 2, 224, 2)),
    ((S.U4B8, 16, 4096, 14336), (2, 8, 3, 1, 112, 1)),  # not swapped: one block, 512 x 128
    ((S.U4, 1, 4096, 14336), (2, 4, 6, 1, 112, 1)),  # zero points: as before
    ((S.U4B8, 1, 8192, 28672), (2, 4, 3, 2, 224, 1)),  # swapped two-block kernels: aligned
    ((S.U4B8, 32, 8192, 8192), (2, 4, 6, 1, 128, 1)),  # two m16 blocks: no clusters
    ((S.FE4M3FN, 1, 8192, 8192), (2, 4, 3, 1, 128, 2)),  # (4, 2) gives 32 slices: the next shape, 64
    ((S.FE4M3FN, 16, 8192, 8192), (2, 4, 3, 1, 128, 2)),
    ((S.FE4M3FN, 1, 4096, 14336), (4, 2, 4, 1, 112, 2)),  # the grid the policy gave already: 56 x 2
    # 8-bit at M = 9..16: the first tile whose 112 slices fill the SMs two blocks each, 16 steps per block
    ((S.FE4M3FN, 16, 4096, 14336), (2, 2, 3, 2, 224, 2)),
    ((S.U8B128, 9, 4096, 14336), (2, 2, 3, 2, 224, 2)),
    ((S.FE4M3FN, 16, 8192, 28672), (4, 2, 4, 1, 132, 1)),  # 112 slices, but 64 steps per block: as before
    ((S.FE4M3FN, 8, 4096, 14336), (4, 2, 4, 1, 112, 2)),  # swapped: as before
    ((S.FE4M3FN, 1, 28672, 8192), (4, 2, 4, 1, 128, 1)),
    ((S.U4, 1, 8192, 8192), (2, 4, 3, 1, 128, 2)),  # zero points, 16 steps: pairs (8%)
    ((S.U4, 1, 28672, 8192), (2, 4, 3, 1, 128, 2)),  # zero points, 56 steps: long pairs (15%)
]


@pytest.mark.parametrize("key, choice_", PAIRS, ids=str)
def test_pair_choices(key, choice_):
    assert pair_choice(*key) == choice_


def test_pairs_off_is_the_policy_without_pairs():
    p = replaced(pair_clusters=False)
    for key, _ in PAIRS:
        weight, m, k, n = key
        assert pair_choice(*key, policy=p)[:5] == choice(*key, policy=p)


def test_pairs_long_range_exception_is_for_the_first_tile_without_act_order():
    """56 steps per block: long pairs for u4b8 at M <= 16 with fp16 or bf16 and for zero points (they lost before the
    per-warp pipeline for two tiles), never for act-order groups (PAIR_MAX_STEPS_NOT_PLAIN)."""
    def pick(act, weight, m, per_row=False, policy=None):
        cfg = gemm.choose_config(act, weight, m, 8192, 28672, 128, per_row, SMEM_LIMIT, sm_smem=SM_SMEM, sms=SMS,
                                 pairs=True, policy=policy)
        return cfg.blocks_per_sm, gemm.grid_blocks(cfg, m, 8192, 28672, SMS, policy=policy)
    for m in (8, 12, 16):
        assert pick(S.F16, S.U4B8, m) == (1, 128)
        assert pick(S.BF16, S.U4B8, m) == (1, 128)
        assert pick(S.F16, S.U4, m) == (1, 128)
        assert pick(S.F16, S.U4B8, m, per_row=True)[0] == 2
    # the earlier rules (long pairs for fp16 alone), as a policy: an A/B variant
    narrow = replaced(pair_long_acts=(S.F16,), pair_long_zero_points=False, rows_wide_first=False)
    assert pick(S.BF16, S.U4B8, 8, policy=narrow) == (2, 256) and pick(S.F16, S.U4, 16, policy=narrow) == (2, 256)
    assert pick(S.F16, S.U4B8, 8, policy=narrow) == (1, 128)
    # group 32 in the rows layout: a late-scaling flush per k16 tile (not measured with pairs): two blocks as before
    cfg = gemm.choose_config(S.F16, S.U4B8, 16, 8192, 28672, 32, False, SMEM_LIMIT, sm_smem=SM_SMEM, sms=SMS,
                             pairs=True)
    assert cfg.blocks_per_sm == 2 and gemm.choose_config(S.F16, S.U4B8, 8, 8192, 28672, 32, False, SMEM_LIMIT,
                                                         sm_smem=SM_SMEM, sms=SMS, pairs=True).blocks_per_sm == 1


def test_two_block_pairs_take_bf16():
    """u4b8 4096x14336 M <= 8 (112 slices of 128 columns): two blocks per SM in pairs on 224 for fp16 and bf16 (bf16
    M = 1: 8%); zero points keep one block on 112."""
    def pick(act, weight, m):
        cfg = gemm.choose_config(act, weight, m, 14336, 4096, 128, False, SMEM_LIMIT, sm_smem=SM_SMEM, sms=SMS,
                                 pairs=True)
        grid = gemm.grid_blocks(cfg, m, 14336, 4096, SMS)
        return cfg.blocks_per_sm, grid, gemm.cluster_blocks(cfg, m, 14336, 4096, grid, 90, True)
    for m in (1, 8):
        assert pick(S.F16, S.U4B8, m) == (2, 224, 2) and pick(S.BF16, S.U4B8, m) == (2, 224, 2)
        assert pick(S.F16, S.U4, m) == (1, 112, 1)


def test_late_scale_mirrors_the_kernel_rule():
    """KernelConfig.late_scale: one m16 block, not act-order groups, not FP8, and either swapped or one block
    per SM with two or more k16 tiles per warp and stage — as WarpLoop::kLateScale / late_scale_pays."""
    def cfg(act=S.F16, weight=S.U4B8, m_blocks=1, group_mode=gemm.GROUP_GROUPED, blocks_per_sm=1, swap=False,
            k_warp=4):
        return gemm.KernelConfig(act, weight, m_blocks, 2, k_warp, 4, group_mode, blocks_per_sm=blocks_per_sm,
                                 swap=swap)
    assert cfg().late_scale and cfg(swap=True).late_scale and cfg(group_mode=gemm.GROUP_CHANNELWISE).late_scale
    assert not cfg(m_blocks=2).late_scale
    assert not cfg(group_mode=gemm.GROUP_PER_ROW).late_scale
    assert not cfg(act=S.BF16, weight=S.FE4M3FN).late_scale and not cfg(weight=S.FE4M3FN, swap=True).late_scale
    assert cfg(weight=S.U8B128, swap=True).late_scale
    assert not cfg(blocks_per_sm=2).late_scale and cfg(blocks_per_sm=2, swap=True).late_scale
    assert not cfg(k_warp=1).late_scale and cfg(k_warp=1, swap=True).late_scale and cfg(k_warp=2).late_scale
    assert cfg(weight=S.U4).late_scale and cfg(act=S.BF16).late_scale


def test_eight_bit_row_pairs_switch():
    """pair_two_block_eight_bit_rows off (an A/B variant): FP8 4096 x 14336 at M = 16 back to one
    block per SM on 112 blocks in clusters of two."""
    p = replaced(pair_two_block_eight_bit_rows=False)
    assert pair_choice(S.FE4M3FN, 16, 4096, 14336, policy=p) == (4, 2, 4, 1, 112, 2)
    assert pair_choice(S.FE4M3FN, 16, 4096, 14336) != (4, 2, 4, 1, 112, 2)


def test_rows_wide_tile_scope():
    """The 512 x 128 tile (GemmPolicy.rows_wide_first) is for 4-bit rows-layout kernels with one m16 block (M = 9..16)
    and groups of >= 128 rows, where a block gets >= 8 stages of it; nothing else changes."""
    def tile(m, k=8192, n=8192, weight=S.U4B8, group=128, per_row=False, act=S.F16, pairs=True, policy=None):
        cfg = gemm.choose_config(act, weight, m, n, k, group, per_row, SMEM_LIMIT, sm_smem=SM_SMEM, sms=SMS,
                                 pairs=pairs, policy=policy)
        return cfg.n_tiles, cfg.k_warp
    for m in (9, 12, 16):
        assert tile(m) == (2, 8) and tile(m, act=S.BF16) == (2, 8) and tile(m, weight=S.U4) == (2, 8)
        assert tile(m, pairs=False) == (2, 8)
    assert tile(1) != (2, 8) and tile(8) != (2, 8) and tile(17) != (2, 8)  # swapped / two m16 blocks
    assert tile(16, group=64) != (2, 8) and tile(16, per_row=True) != (2, 8) and tile(16, group=-1) != (2, 8)
    assert tile(16, weight=S.U8B128) != (2, 8) and tile(16, weight=S.FE4M3FN, group=-1) != (2, 8)
    assert tile(16, k=2048, n=28672) != (2, 8)  # 4 stages of 512 rows: too short
    assert tile(16, k=4096, n=4096) == (1, 4)  # the 4096-column layers keep their 512 x 64 pairs
    assert tile(16, policy=replaced(rows_wide_first=False)) == (2, 4)


@pytest.mark.parametrize("name, field", [("WORKBENCH_PROGRAMMATIC_LAUNCH", "programmatic_launch")])
def test_old_environment_variables_warn_and_set_the_default_policy(name, field):
    """For one release the old environment switches still turn their launch form off, through the default policies,
    with a DeprecationWarning naming the replacement."""
    import os
    import subprocess

    code = ("import warnings; warnings.simplefilter('always')\n"
            "with warnings.catch_warnings(record=True) as seen:\n"
            "    from workbench import policy\n"
            f"assert any('{name} is deprecated' in str(w.message) and w.category is DeprecationWarning "
            "for w in seen), [str(w.message) for w in seen]\n"
            f"assert policy.DEFAULT_GEMM_POLICY.{field} is False\n"
            "assert policy.DEFAULT_MOE_POLICY.gemm is policy.DEFAULT_GEMM_POLICY\n")
    env = dict(os.environ, **{name: "0"})
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_equal_policies_share_a_token_and_others_do_not():
    """The plan caches key on ``policy.token``: one per policy value."""
    a, b = replaced(align_slices=False), replaced(align_slices=False)
    assert a.token == b.token != DEFAULT_GEMM_POLICY.token
    assert replaced(swap_max_m=0).token not in (a.token, DEFAULT_GEMM_POLICY.token)


def test_removed_launch_knobs_warn_and_change_nothing(monkeypatch):
    """WORKBENCH_DIRECT_LAUNCH, gemm.DIRECT_LAUNCH and GemmPolicy.direct_launch went with the CuPy-call fallback:
    setting them warns that they have no effect (for one release); the 16-row swapped loop went too, so swap_max_m
    above 8 warns and acts as 8."""
    import os
    import subprocess

    code = ("import warnings; warnings.simplefilter('always')\n"
            "with warnings.catch_warnings(record=True) as seen:\n"
            "    from workbench import policy\n"
            "assert any('WORKBENCH_DIRECT_LAUNCH was removed and has no effect' in str(w.message) "
            "and w.category is DeprecationWarning for w in seen), [str(w.message) for w in seen]\n"
            "assert policy.DEFAULT_GEMM_POLICY == policy.GemmPolicy()\n")
    subprocess.run([sys.executable, "-c", code], check=True, env=dict(os.environ, WORKBENCH_DIRECT_LAUNCH="0"))
    before = gemm.__dict__["_default_policy"]
    with pytest.warns(DeprecationWarning, match="DIRECT_LAUNCH was removed and has no effect"):
        gemm.DIRECT_LAUNCH = False
    assert gemm.__dict__["_default_policy"] is before
    with pytest.warns(DeprecationWarning, match="was removed"):
        assert gemm.DIRECT_LAUNCH is True
    assert DEFAULT_GEMM_POLICY.direct_launch is True
    with pytest.raises(TypeError):
        dataclasses.replace(DEFAULT_GEMM_POLICY, direct_launch=False)
    with pytest.warns(DeprecationWarning, match="16-row form was removed"):
        wide = dataclasses.replace(DEFAULT_GEMM_POLICY, swap_max_m=16)
    assert [gemm.swap_halves(m, policy=wide) for m in (1, 8, 9, 16)] == [1, 1, 0, 0]
