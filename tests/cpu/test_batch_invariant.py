"""The batch-invariant planner on the CPU: one configuration for every M, a K partition that no M and no ``sms``
changes, launches that cover the rows with it, the fused MoE's pinned tile, and the record flag. (The bits themselves
are compared on a GPU: tests/gpu/test_invariance.py.)"""
import dataclasses

import pytest

from workbench import gemm_abi
from workbench.gemm import geometry
from workbench.gemm.launch import check_launch
from workbench.moe.config import choose_moe_config
from workbench.formats.moe_align import SUPPORTED_BLOCK_SIZES
from workbench.policy import DEFAULT_GEMM_POLICY, DEFAULT_MOE_POLICY
from workbench.scalar_types import ScalarType as S

H200 = dict(cc=90, sms=132, smem_limit=232448 - 1024, sm_smem=233472)  # (as gemm.device_properties reports it)
LAYERS = ((4096, 4096), (4096, 14336), (14336, 4096), (8192, 8192), (8192, 28672), (28672, 8192), (1024, 512),
          (512, 8192), (256, 16384), (4096, 192 * 64))  # (K, N)
TYPES = [(wt, gs, per_row) for wt in (S.U4B8, S.U4, S.U8B128, S.U8) for gs in (-1, 32, 64, 128)
         for per_row in ((False, True) if gs == 128 else (False,))] + [(S.FE4M3FN, -1, False), (S.FE4M3FN, 128, False)]
M_ALL = range(1, 257)


def _config(wt, gs, per_row, m, k, n, act=S.F16, policy=None):
    return geometry.choose_invariant_config(act, wt, m, n, k, gs, per_row, H200["smem_limit"], policy=policy)


def _pinned(cfg):
    """What must not change with M: everything but the m16 block count, the stages it allows and the swap (which
    sums a row as the row layout on the same tile: tests/gpu/test_invariance.py)."""
    return (cfg.act, cfg.weight, cfg.n_tiles, cfg.k_base or cfg.k_warp, cfg.group_mode, cfg.blocks_per_sm,
            cfg.invariant, cfg.late_scale)


@pytest.mark.parametrize("wt,gs,per_row", TYPES, ids=str)
def test_one_configuration_for_every_m(wt, gs, per_row):
    for k, n in LAYERS:
        first = _config(wt, gs, per_row, 1, k, n)
        assert first.invariant and not first.late_scale, "the 16-row kernel must sum as the 32..64-row ones"
        assert (first.swap, first.blocks_per_sm, first.cluster, first.walk) == (1, 1, 1, False)
        split = geometry.invariant_split(first, n, k, H200["sms"])
        for m in M_ALL:
            cfg = _config(wt, gs, per_row, m, k, n)
            assert _pinned(cfg) == _pinned(first), f"{wt} g{gs} {k}x{n}: M = {m} takes another tile"
            assert cfg.m_blocks == min(4, -(-m // 16)) and cfg.swap == (m <= 8) and not cfg.late_scale
            assert geometry.invariant_split(cfg, n, k, H200["sms"]) == split


def test_every_type_takes_the_default_large_m_tile():
    """The invariant kernels never late-scale, so the policy's first shape (64 x 256, the default's tile from
    M = 33 up) serves integer weights too; their names are the invariant kernels'."""
    for wt, gs in ((S.FE4M3FN, -1), (S.U4B8, 128), (S.U4, 64), (S.U8B128, 32)):
        for m in (1, 16, 64, 256):
            cfg = _config(wt, gs, False, m, 4096, 4096)
            assert (cfg.n_tiles, cfg.k_warp) == DEFAULT_GEMM_POLICY.invariant_shapes[0] == (4, 2)
            assert cfg.name_expression.startswith("mwb::marlin_gemm_invariant<")
    default = geometry.choose_config(S.F16, S.U4B8, 64, 4096, 4096, 128, False, H200["smem_limit"])
    assert (default.n_tiles, default.k_warp, default.m_blocks) == (4, 2, 4)
    cl = dataclasses.replace(_config(S.U4B8, 128, False, 1, 4096, 4096), cluster=2)
    assert cl.name_expression.startswith("mwb::marlin_gemm_cluster_invariant<") and cl.name_expression.endswith(", 2, 0>")


@pytest.mark.parametrize("k,n", LAYERS, ids=str)
def test_the_chunk_walk_runs_one_launch_on_the_one_chunk_partition(k, n):
    """Where a launch holds one chunk's blocks (s > 1, fp32) and a block sums few k steps of a chunk: one launch of
    cols x s blocks walks every chunk; without the walk (the policy's switch, longer ranges, or the in-C reduction)
    the same partition runs chunk by chunk."""
    args = (H200["sms"], H200["sms"], H200["cc"])
    no_walk = dataclasses.replace(DEFAULT_GEMM_POLICY, invariant_walk=False)
    for m in (1, 16, 64, 65, 128, 256):
        cfg = _config(S.U4B8, 128, False, m, k, n)
        split = geometry.invariant_split(cfg, n, k, H200["sms"])
        per_chunk = n // cfg.block_n * split
        walked, launches = geometry.invariant_plan(cfg, m, n, k, *args, True)
        plain, pieces = geometry.invariant_plan(cfg, m, n, k, *args, True, policy=no_walk)
        in_c, in_c_pieces = geometry.invariant_plan(cfg, m, n, k, *args, False)
        assert not plain.walk and not in_c.walk and pieces == in_c_pieces
        short = -(-(k // cfg.block_k) // split) <= DEFAULT_GEMM_POLICY.invariant_walk_max_steps
        if split > 1 and m > 64 and H200["sms"] // per_chunk == 1 and short:
            assert walked.walk and launches == ((0, m, per_chunk),)
            assert len(pieces) == -(-m // 64) and all(g == per_chunk for _, _, g in pieces)
        else:
            assert not walked.walk and launches == pieces


def _ranges(total_steps, grid):
    """The kernel's block ranges: block b holds iterations [b T / G, (b + 1) T / G) (marlin_gemm.cu)."""
    return [(b * total_steps // grid, (b + 1) * total_steps // grid) for b in range(grid)]


@pytest.mark.parametrize("k,n", LAYERS, ids=str)
def test_every_launch_gives_each_slice_the_same_k_ranges(k, n):
    """For every M and every sms the partition accepts, each launch's blocks cut every column slice at the same k
    steps (the split's ranges, or whole slices), the launches cover the rows once, and no grid exceeds sms."""
    cfg0 = _config(S.U4B8, 128, False, 1, k, n)
    split = geometry.invariant_split(cfg0, n, k, H200["sms"])
    ki, cols = k // cfg0.block_k, n // cfg0.block_n
    expected = {(j * ki // split, (j + 1) * ki // split) for j in range(split)}
    least = cols * split if split > 1 else 1
    for m in (1, 7, 16, 17, 48, 64, 65, 100, 128, 200, 256):
        cfg = _config(S.U4B8, 128, False, m, k, n)
        for sms in sorted({least, least + 3, 100, 128, 132} - set(range(least))):
            launches = geometry.invariant_launches(cfg, m, n, k, sms, split)
            assert [r0 for r0, _, _ in launches] == [sum(r for _, r, _ in launches[:i]) for i in range(len(launches))]
            assert sum(r for _, r, _ in launches) == m
            for r0, rows, grid in launches:
                assert r0 % cfg.block_m == 0 and 1 <= grid <= sms
                slices = -(-rows // cfg.block_m) * cols
                for lo, hi in _ranges(slices * ki, grid):
                    if split > 1:  # one slice per block, cut where the split cuts it
                        assert lo // ki == (hi - 1) // ki, f"M = {m}, sms = {sms}: a block straddles two slices"
                        assert (lo % ki, (hi - 1) % ki + 1) in expected
                    else:  # whole slices per block
                        assert lo % ki == 0 and hi % ki == 0, f"M = {m}, sms = {sms}: a slice is split"
                if split > 1:
                    assert grid == slices * split
    if split > 1:
        with pytest.raises(ValueError, match=f"sms = {least - 1} is fewer"):
            geometry.invariant_launches(cfg0, 1, n, k, least - 1, split)


def test_the_split_is_policy_data():
    cfg = _config(S.U4B8, 128, False, 1, 4096, 4096)
    assert geometry.invariant_split(cfg, 4096, 4096, 132) == 8  # 128 blocks over 16 slices of 256 columns
    assert geometry.invariant_split(cfg, 4096, 4096, 64) == 4  # (a device of fewer SMs: across GPUs not guaranteed)
    fewer = dataclasses.replace(DEFAULT_GEMM_POLICY, invariant_blocks=16)
    assert geometry.invariant_split(cfg, 4096, 4096, 132, policy=fewer) == 1
    longer = dataclasses.replace(DEFAULT_GEMM_POLICY, invariant_min_steps=32)
    assert geometry.invariant_split(cfg, 4096, 4096, 132, policy=longer) == 2  # 64 k steps / 32
    only = dataclasses.replace(DEFAULT_GEMM_POLICY, invariant_shapes=((1, 1),))
    assert (_config(S.U4B8, 128, False, 200, 4096, 4096, policy=only).n_tiles,) == (1,)
    with pytest.raises(ValueError, match="invariant_shapes"):
        _config(S.U4B8, 128, False, 1, 4096, 4096 + 64,
                policy=dataclasses.replace(DEFAULT_GEMM_POLICY, invariant_shapes=((4, 2),)))  # 64 x 256 fits no N
    assert not _config(S.U4B8, 128, False, 4, 4096, 4096,
                       policy=dataclasses.replace(DEFAULT_GEMM_POLICY, invariant_swap=False)).swap


def _record(m, n, k, wt=S.U4B8, gs=128, sms=-1, atomic=False, invariant=True):
    ng = 1 if gs == -1 else k // gs
    buffers = gemm_abi.MarlinMmBuffers(a=1 << 20, b=2 << 20, c=3 << 20, c_tmp=4 << 20, b_scales=5 << 20,
                                       workspace=6 << 20)
    return gemm_abi.MarlinMmRequest(
        weight_type=wt, buffers=buffers, problem=gemm_abi.MarlinMmProblem(m, n, k, k, ng, gs),
        execution=gemm_abi.MarlinMmExecution(sms=sms, use_atomic_add=atomic, use_fp32_reduce=not atomic,
                                             batch_invariant=invariant)).into_launch()


def test_the_record_flag_reaches_the_planner():
    args = (H200["cc"], H200["sms"], H200["smem_limit"], H200["sm_smem"])
    rec = _record(1, 4096, 4096)
    assert rec.flags & gemm_abi.FLAG_BATCH_INVARIANT and gemm_abi.KNOWN_FLAGS & gemm_abi.FLAG_BATCH_INVARIANT
    seen = set()
    for m in (1, 8, 16, 17, 64, 256):
        for sms in (-1, 128, 130):
            cfg, _, grid = check_launch(_record(m, 4096, 4096, sms=sms), *args)
            seen.add(_pinned(dataclasses.replace(cfg, cluster=1)))
            assert grid == 128  # 16 slices x 8 blocks: one 64-row chunk at a time
    assert len(seen) == 1
    default, _, _ = check_launch(_record(1, 4096, 4096, invariant=False), *args)
    assert _pinned(default) != seen.pop()
    with pytest.raises(ValueError, match="cannot be batch_invariant"):
        check_launch(_record(16, 4096, 4096, atomic=True), *args)
    with pytest.raises(ValueError, match="sms = 100 is fewer"):
        check_launch(_record(16, 4096, 4096, sms=100), *args)


@pytest.mark.parametrize("wt,gs", [(S.U4B8, 128), (S.U4, 64), (S.U8B128, 32), (S.U8, -1), (S.FE4M3FN, 128)],
                         ids=str)
def test_fused_moe_pins_one_tile_for_every_block_size(wt, gs):
    policy = DEFAULT_MOE_POLICY.batch_invariant()
    seen = set()
    for n, k in ((14336 * 2, 4096), (4096, 14336), (2048, 7168), (256, 256)):
        for bs in SUPPORTED_BLOCK_SIZES:
            for items in (1, 8, 100, 5000):
                for sms in (40, 132):
                    cfg = choose_moe_config(S.F16, wt, bs, n, k, gs, items, sms, H200["smem_limit"], H200["sm_smem"],
                                            policy=policy)
                    assert not cfg.swap and not cfg.late_scale, f"block size {bs}"
                    seen.add((n, k, cfg.n_tiles, cfg.k_warp))
        assert len({s for s in seen if s[:2] == (n, k)}) == 1, f"{n}x{k}: several tiles"
    # the default policy, for contrast, swaps 8-row blocks
    assert choose_moe_config(S.F16, wt, 8, 256, 256, gs, 8, 132, H200["smem_limit"], H200["sm_smem"]).swap


@pytest.mark.parametrize("walk", [True, False], ids=["walk", "per_chunk"])
def test_large_m_runs_on_the_one_chunk_partition(walk):
    """On the stand-in driver (tests/fake_device.py): M = 200 on a layer whose slices take 8 blocks each runs as one
    launch of 128 blocks that walks the 64-row chunks with one chunk's division plan (the policy's invariant_walk),
    or as launches of 64-row chunks, each at its rows of A and C with the division plan of its own rows; a repeated
    call launches the same again."""
    import numpy as np

    from fake_device import SMS, FakeArray, installed
    from workbench import gemm

    policy = dataclasses.replace(DEFAULT_GEMM_POLICY, invariant_walk=walk)
    k, n, m = 4096, 4096, 200
    with installed() as (_, driver):
        args = dict(a=FakeArray((m, k), np.float16), b_q_weight=FakeArray((k // 16, n * 2), np.int32),
                    b_scales=FakeArray((k // 128, n), np.float16), b_zeros=None, g_idx=None, perm=None,
                    workspace=FakeArray((gemm.workspace_numel(SMS),), np.int32), b_q_type=S.U4B8, size_m=m,
                    size_n=n, size_k=k, c=FakeArray((m, n), np.float16),
                    c_tmp=FakeArray((gemm.c_tmp_numel(SMS),), np.float32))
        gemm.gptq_marlin_gemm(**args, batch_invariant=True, policy=policy)
        first = list(driver.launches)
        gemm.gptq_marlin_gemm(**args, batch_invariant=True, policy=policy)
        assert driver.launches[len(first):] == first, "the cached plan launches the same pieces"
    rows = [200] if walk else [64, 64, 64, 8]
    assert len(first) == len(rows)
    n_pointers = gemm.KERNEL_ARG_KINDS["marlin_gemm"].count("p")  # the kernel's pointer parameters come first
    for i, (launch, r) in enumerate(zip(first, rows)):
        pointers, ints = launch[5][:n_pointers], launch[5][n_pointers:]  # (a, b, c, c_tmp, scales, zeros, ...)
        assert launch[1] == (128, 1, 1)
        assert pointers[0] == args["a"].data.ptr + i * 64 * k * 2 and pointers[2] == args["c"].data.ptr + i * 64 * n * 2
        assert ints[:6] == (r, n, k, k, 128, gemm.REDUCE_FP32)
        steps = 16 * (k // 64)  # one chunk of 16 slices of 64 k steps (the 64 x 256 tile) over 128 blocks
        assert ints[6:8] == (steps // 128, steps % 128)


def test_the_16_row_kernel_merges_stages_where_every_range_is_whole_merged_stages():
    """invariant_plan (with the device's shared memory) under invariant_merge = ((4, 4),): 4-bit 16-row kernels take
    four 64 x 256 stages per pipeline stage (k_base = 2) where K, the split and each block's share allow; the
    partition stays the tile's; 8-bit weights, 32..64-row kernels, odd K and act-order groups keep the plain kernel.
    The default policy merges nothing yet."""
    args = (H200["sms"], H200["sms"], H200["cc"], True)
    on = dataclasses.replace(DEFAULT_GEMM_POLICY, invariant_merge=((4, 4),))
    assert DEFAULT_GEMM_POLICY.invariant_merge == ()  # (off until the GPU tests have run it)
    for k, n in LAYERS[:6]:
        for m in (1, 8, 16, 17, 64):
            for wt, gs in ((S.U4B8, 128), (S.U4, 64), (S.U8B128, 128)):
                cfg = _config(wt, gs, False, m, k, n)
                split = geometry.invariant_split(cfg, n, k, H200["sms"])
                merged, launches = geometry.invariant_plan(cfg, m, n, k, *args, on, smem_limit=H200["smem_limit"])
                assert geometry.invariant_split(merged, n, k, H200["sms"]) == split
                if m <= 16 and wt.bits == 4:
                    assert (merged.k_warp, merged.k_base, merged.block_k) == (8, 2, 256), (k, n, m, wt)
                    assert merged.name_expression.endswith(", 2>") and merged.smem_bytes <= H200["smem_limit"]
                    assert launches == geometry.invariant_plan(cfg, m, n, k, *args, on)[1]
                else:
                    assert merged.k_base == 0 and merged.k_warp == 2
    odd = _config(S.U4B8, 128, False, 1, 1000, 200)
    assert geometry.invariant_plan(odd, 1, 200, 1000, *args, on, smem_limit=H200["smem_limit"])[0].k_base == 0
    act = _config(S.U4B8, 128, True, 1, 4096, 4096)
    assert geometry.invariant_plan(act, 1, 4096, 4096, *args, on, smem_limit=H200["smem_limit"])[0].k_base == 0
    u4 = _config(S.U4B8, 128, False, 1, 4096, 4096)
    assert geometry.invariant_plan(u4, 1, 4096, 4096, *args, smem_limit=H200["smem_limit"])[0].k_base == 0
