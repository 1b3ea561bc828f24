"""Batch invariance on a real GPU: with ``batch_invariant=True`` a row's output has the same bits whatever batch it is
in. The same probe rows run alone (M = 1) and inside batches of M = 1..256 whose other rows are fresh random data, at
random positions, with forced SM counts, both reductions, on two streams at once; dense (every weight type and group
size, act-order) and the fused MoE layer (every type, every moe_block_size, every path). Compared bit for bit; the
batch's outputs are also checked against the fp32 reference within the derived bound (tests/gpu/test_gemm.py
error_bound), so an invariant but wrong kernel fails. Outputs are poisoned (NaN) before every launch.

Also measured here, because batch invariance uses it and may only while it holds: whether the operand-swapped small-M
loop gives bitwise the row layout's per-row sums on the same tile and grid (docs/performance.md, "Batch invariance");
and the chunk-walking launch against one launch per chunk, every output bit.
"""
import dataclasses

import ml_dtypes
import numpy as np
import pytest

from workbench import gemm, hardware, moe
from workbench.gemm import geometry
from workbench.policy import DEFAULT_GEMM_POLICY, DEFAULT_MOE_POLICY
from workbench.scalar_types import ScalarType as S
from workbench.weight import random_marlin_weight

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not hardware.cupy_available(), reason="no CUDA GPU visible to CuPy")]

cp = pytest.importorskip("cupy")

from gpu.test_gemm import error_bound, poisoned  # noqa: E402  (tests/ is on the pytest pythonpath)

F16 = np.dtype(np.float16)
BF16 = np.dtype(ml_dtypes.bfloat16)
INT_TYPES = (S.U4B8, S.U4, S.U8B128, S.U8)
# (weight, group size, act-order, activation): every type and group size; act-order and bf16 once each
DENSE_CASES = ([(wt, gs, False, F16) for wt in INT_TYPES for gs in (-1, 32, 64, 128)]
               + [(S.FE4M3FN, gs, False, F16) for gs in (-1, 128)]
               + [(S.U4B8, 128, True, F16), (S.U4, 64, False, BF16), (S.FE4M3FN, 128, False, BF16)])
DENSE_K, DENSE_N = 1024, 512  # 4 blocks per column slice (GemmPolicy.invariant_blocks / _min_steps)
# (K, N): 2 blocks per slice (cluster sums at M <= 16, fp32 slots above, 64 rows per launch at M = 256) and no split
# (a grid of whole slices)
SPLIT_SHAPES = ((512, 8192), (256, 16384))
# (K, N) that are not tile multiples: a partial last group (1000 = 7 x 128 + 104), a partial last k16 tile and a
# last 64-column tile of 8 columns (the kernels predicate both edges in this mode too)
ODD_SHAPES = ((1000, 200),)
ODD_TYPES = ((S.U4B8, 128), (S.U8B128, 64), (S.FE4M3FN, -1))
M_VALUES = (1, 5, 8, 9, 16, 17, 31, 33, 64, 65, 130, 256)
PROBES = 3  # probe rows per case
MODES = {"fp32": dict(use_fp32_reduce=True), "in_c": dict(use_fp32_reduce=False)}
MOE_TYPES = ((S.U4B8, 128), (S.U4, 64), (S.U8B128, 32), (S.U8, -1), (S.FE4M3FN, 128), (S.FE4M3FN, -1))
MOE_E, MOE_TOPK, MOE_K, MOE_N = 8, 2, 256, 128
MOE_M = (3, 8, 33, 100, 256)
MOE_CASES = [(wt, gs, F16) for wt, gs in MOE_TYPES] + [(S.U4B8, 128, BF16)]
MOE_FEW_SMS = 40  # a stack planned for fewer SMs (the fused grid changes, no item's sum does)


def _device():
    return cp.cuda.Device().id


# the merged 16-row stages (GemmPolicy.invariant_merge, off by default until this module has run them)
MERGED = dataclasses.replace(DEFAULT_GEMM_POLICY, invariant_merge=((4, 4),))
MERGED_CASES = ((S.U4B8, 128), (S.U4, 64), (S.U4B8, 32), (S.U4, -1))


def invariant_configs(act, wt, n, k, gs, per_row, policy=None):
    """Every instantiation batch_invariant launches for this layer: each m16 block count, swapped and not, with its
    cluster form and the chunk-walking one, at the SM counts the tests force and both reductions."""
    device = _device()
    cc, sms, smem_limit, _ = gemm.device_properties(device)
    out = []
    for m in (1, 9, 17, 33, 49, 130, 256):
        cfg = geometry.choose_invariant_config(gemm.act_scalar_type(act), wt, m, n, k, gs, per_row, smem_limit,
                                               policy=policy)
        split = geometry.invariant_split(cfg, n, k, sms, policy)
        least = (geometry.tiled_n(n) // cfg.block_n) * split if split > 1 else 1
        for forced in {sms, least, min(sms, least + 5)}:
            for fp32 in (True, False):
                out.append(geometry.invariant_plan(cfg, m, n, k, forced, sms, cc, fp32, policy,
                                                   smem_limit=smem_limit)[0])
    return out


def swap_configs(m_rows=8):
    """(rows-layout, swapped) configurations of one tile each: FP8 (neither late-scales), u4b8 g128 (both do) and the
    batch-invariant kernels of u4b8 g128 (neither does)."""
    g = geometry
    return [(S.FE4M3FN, -1, [g.KernelConfig(S.F16, S.FE4M3FN, 1, 4, 2, 4, g.GROUP_CHANNELWISE, swap=s)
                             for s in (0, 1)]),
            (S.U4B8, 128, [g.KernelConfig(S.F16, S.U4B8, 1, 2, 4, 6, g.GROUP_GROUPED, swap=s) for s in (0, 1)]),
            (S.U4B8, 128, [g.KernelConfig(S.F16, S.U4B8, 1, 4, 2, 6, g.GROUP_GROUPED, swap=s, invariant=True)
                           for s in (0, 1)])]


def moe_configs():
    from workbench.formats.moe_align import SUPPORTED_BLOCK_SIZES, aligned_capacity

    cc, sms, smem, sm_smem = gemm.device_properties(_device())
    policy = DEFAULT_MOE_POLICY.batch_invariant()
    out = set()
    for wt, gs, act in MOE_CASES:
        for bs in SUPPORTED_BLOCK_SIZES:
            for numel in {MOE_TOPK * m for m in (1,) + MOE_M}:
                items = min(aligned_capacity(numel, bs, MOE_E) // bs, numel)
                for n, k, g in ((2 * MOE_N, MOE_K, gs), (MOE_K, MOE_N, gs if gs <= MOE_N else -1)):
                    for planned in (sms, MOE_FEW_SMS):
                        out.add(moe.choose_moe_config(gemm.act_scalar_type(act), wt, bs, n, k, g, items, planned,
                                                      smem, sm_smem, policy=policy))
    return out


@pytest.fixture(scope="module", autouse=True)
def compile_everything_once():
    """Every instantiation the module launches, compiled in parallel threads before the first launch."""
    from concurrent.futures import ThreadPoolExecutor

    device = _device()
    dense = []
    for wt, gs, act_order, act in DENSE_CASES:
        dense += invariant_configs(act, wt, DENSE_N, DENSE_K, gs, False)  # (act-order with is_k_full: grouped)
    for k, n in SPLIT_SHAPES:
        for wt, gs in ((S.U4B8, 128), (S.FE4M3FN, -1)):
            dense += invariant_configs(F16, wt, n, k, gs, False)
    for k, n in ODD_SHAPES:
        for wt, gs in ODD_TYPES:
            dense += invariant_configs(F16, wt, n, k, gs, False)
    for n, k in ((2 * MOE_N, MOE_K), (MOE_K, MOE_N)):  # the MoE layer's dense paths
        dense += invariant_configs(F16, S.U4B8, n, k, 128, False)
    dense += [c for _, _, pair in swap_configs() for c in pair]
    for wt, gs in MERGED_CASES:
        dense += invariant_configs(F16, wt, DENSE_N, DENSE_K, gs, False, MERGED)
    dense += invariant_configs(F16, S.U4B8, SPLIT_SHAPES[0][1], SPLIT_SHAPES[0][0], 128, False, MERGED)
    names = [(c.name_expression, c.smem_bytes) for c in moe_configs()]
    names += [(f"mwb::{f}<{t}>", 0) for f in ("silu_and_mul", "moe_sum") for t in ("__half", "__nv_bfloat16")]
    names += [("mwb::gather_rows", 0), ("mwb::moe_align", 0)]
    with ThreadPoolExecutor(max_workers=16) as pool:
        jobs = [pool.submit(moe.get_moe_kernel, name, device, smem_bytes) for name, smem_bytes in names]
        jobs.append(pool.submit(gemm.precompile, dense, device, 12))
        for job in jobs:
            job.result()


def bits(x):
    return cp.asnumpy(x).view(np.uint16)


def embed(rng, probes, m):
    """A batch of m rows: the probe rows at random distinct positions, fresh random rows elsewhere."""
    rows = rng.standard_normal((m, probes.shape[1]), dtype=np.float32).astype(probes.dtype)
    where = rng.choice(m, len(probes), replace=False) if m >= len(probes) else np.arange(m)
    rows[where] = probes[:len(where)]
    return rows, where


def per_launch_blocks(w, act, sms):
    """Blocks one launch of the invariant partition needs at once (the smallest sms it takes) for 64-row chunks."""
    cfg = geometry.choose_invariant_config(gemm.act_scalar_type(act), w.weight_type, 64, w.size_n, w.size_k,
                                           w.group_size, False, gemm.device_properties(_device())[2])
    split = geometry.invariant_split(cfg, w.size_n, w.size_k, sms)
    return (geometry.tiled_n(w.size_n) // cfg.block_n) * split if split > 1 else 1


def check_invariance(rng, w, q, act, m_values=M_VALUES, sms_values=None, modes=("fp32",), is_k_full=True,
                     policy=None):
    """Probe rows alone and in every batch, every sms and reduction: the same bits; the largest batch within the
    reference bound."""
    device_sms = gemm.device_properties(_device())[1]
    if sms_values is None:
        least = per_launch_blocks(w, act, device_sms)
        sms_values = (-1, least, min(device_sms, least + 5))
    probes = rng.standard_normal((PROBES, w.size_k), dtype=np.float32).astype(act)
    for mode in modes:
        kw = dict(MODES[mode], batch_invariant=True, is_k_full=is_k_full, policy=policy)
        alone = []
        for p in probes:
            c = poisoned(1, w.size_n, act)
            gemm.marlin_gemm(cp.asarray(p[None]), w, c=c, **kw)
            alone.append(bits(c)[0])
        for m in m_values:
            batch, where = embed(rng, probes, m)
            for sms in sms_values:
                c = poisoned(m, w.size_n, act)
                gemm.marlin_gemm(cp.asarray(batch), w, c=c, sms=sms, **kw)
                got = bits(c)
                for i, r in enumerate(where):
                    assert np.array_equal(got[r], alone[i]), (
                        f"{mode}: probe {i} at row {r} of M = {m}, sms = {sms}: "
                        f"{np.count_nonzero(got[r] != alone[i])} of {w.size_n} outputs differ from M = 1")
        # the last batch (the largest M) against the reference
        out = cp.asnumpy(c).astype(np.float32)
        ref = batch.astype(np.float32) @ q.w_ref
        bound = error_bound(batch, q.w_ref, act, mode, w.size_k)
        assert np.all(np.abs(out - ref) <= bound), f"{mode}: M = {m_values[-1]} outside the reference bound"


@pytest.mark.parametrize("wt,gs,act_order,act", DENSE_CASES, ids=str)
def test_dense_rows_are_batch_invariant(wt, gs, act_order, act, rng):
    mw, q = random_marlin_weight(DENSE_K, DENSE_N, wt, gs, act_order=act_order, act_dtype=act,
                                 seed=int(rng.integers(1 << 20)))
    w = gemm.upload_weight(mw)
    check_invariance(rng, w, q, act, modes=("fp32", "in_c"))


@pytest.mark.parametrize("k,n", SPLIT_SHAPES, ids=str)
@pytest.mark.parametrize("wt,gs", [(S.U4B8, 128), (S.FE4M3FN, -1)], ids=str)
def test_dense_invariance_with_two_blocks_per_slice_and_none(k, n, wt, gs, rng):
    """2 blocks per slice: cluster sums at M <= 16 and fp32 slots above must add the same two partials the same
    way, and M = 256 runs as launches of 64 rows; 1 block per slice: grids of whole slices, any divisor."""
    mw, q = random_marlin_weight(k, n, wt, gs, act_dtype=F16, seed=int(rng.integers(1 << 20)))
    w = gemm.upload_weight(mw)
    cfg = geometry.choose_invariant_config(S.F16, wt, 1, n, k, gs, False, gemm.device_properties(_device())[2])
    split = geometry.invariant_split(cfg, n, k, gemm.device_properties(_device())[1])
    assert split == (2 if n == 8192 else 1)  # (the shapes were picked for these partitions)
    check_invariance(rng, w, q, F16, m_values=(1, 8, 16, 17, 64, 256))


@pytest.mark.parametrize("k,n", ODD_SHAPES, ids=str)
@pytest.mark.parametrize("wt,gs", ODD_TYPES, ids=str)
def test_dense_invariance_on_shapes_that_are_not_tile_multiples(k, n, wt, gs, rng):
    mw, q = random_marlin_weight(k, n, wt, gs, act_dtype=F16, seed=int(rng.integers(1 << 20)))
    w = gemm.upload_weight(mw)
    check_invariance(rng, w, q, F16, m_values=(1, 9, 16, 33, 64, 130), modes=("fp32", "in_c"))


def test_dense_chunk_walk_is_bitwise_the_launch_per_chunk(rng):
    """M beyond one 64-row chunk where a launch holds one chunk's blocks: one launch whose blocks walk the chunks
    (marlin_gemm_invariant's WALK) against one launch per chunk (invariant_walk = False), every output bit, with
    the fp32 reduction; the in-C reduction keeps one launch per chunk."""
    mw, q = random_marlin_weight(DENSE_K, DENSE_N, S.U4B8, 128, act_dtype=F16, seed=int(rng.integers(1 << 20)))
    w = gemm.upload_weight(mw)
    cc, sms, smem_limit, _ = gemm.device_properties(_device())
    least = per_launch_blocks(w, F16, sms)
    per_chunk = dataclasses.replace(DEFAULT_GEMM_POLICY, invariant_walk=False)
    for m in (65, 200, 256):
        cfg = geometry.choose_invariant_config(S.F16, S.U4B8, m, DENSE_N, DENSE_K, 128, False, smem_limit)
        walked, launches = geometry.invariant_plan(cfg, m, DENSE_N, DENSE_K, least, sms, cc, True)
        assert walked.walk and len(launches) == 1, (walked, launches)
        a = cp.asarray(rng.standard_normal((m, DENSE_K), dtype=np.float32).astype(F16))
        outs = []
        for policy in (None, per_chunk):
            c = poisoned(m, DENSE_N, F16)
            gemm.marlin_gemm(a, w, c=c, sms=least, batch_invariant=True, policy=policy)
            outs.append(bits(c))
        assert np.array_equal(outs[0], outs[1]), f"M = {m}: {np.count_nonzero(outs[0] != outs[1])} outputs differ"
    out = cp.asnumpy(c).astype(np.float32)
    ref = cp.asnumpy(a).astype(np.float32) @ q.w_ref
    assert np.all(np.abs(out - ref) <= error_bound(cp.asnumpy(a), q.w_ref, F16, "fp32", DENSE_K))


@pytest.mark.parametrize("wt,gs", MERGED_CASES, ids=str)
def test_dense_merged_stages_keep_the_bits(wt, gs, rng):
    """The merged 16-row stages (four 64 x 256 stages per pipeline stage, GemmPolicy.invariant_merge): M <= 16 runs
    them, swapped and not, M > 16 the 32..64-row kernels of the plain tile; every row the same bits, both
    reductions, and with two blocks per slice in clusters (512 x 8192)."""
    mw, q = random_marlin_weight(DENSE_K, DENSE_N, wt, gs, act_dtype=F16, seed=int(rng.integers(1 << 20)))
    w = gemm.upload_weight(mw)
    cc, sms, smem_limit, _ = gemm.device_properties(_device())
    cfg = geometry.choose_invariant_config(S.F16, wt, 1, DENSE_N, DENSE_K, gs, False, smem_limit, policy=MERGED)
    merged, _ = geometry.invariant_plan(cfg, 1, DENSE_N, DENSE_K, sms, sms, cc, True, MERGED, smem_limit)
    assert merged.k_base == 2 and merged.k_warp == 8, merged
    check_invariance(rng, w, q, F16, modes=("fp32", "in_c"), policy=MERGED)
    if (wt, gs) == (S.U4B8, 128):
        k, n = SPLIT_SHAPES[0]
        mw, q = random_marlin_weight(k, n, wt, gs, act_dtype=F16, seed=int(rng.integers(1 << 20)))
        check_invariance(rng, gemm.upload_weight(mw), q, F16, m_values=(1, 8, 16, 17, 64), policy=MERGED)


def test_dense_refuses_too_few_sms_for_its_partition(rng):
    mw, _ = random_marlin_weight(DENSE_K, DENSE_N, S.U4B8, 128, act_dtype=F16, seed=int(rng.integers(1 << 20)))
    w = gemm.upload_weight(mw)
    least = per_launch_blocks(w, F16, gemm.device_properties(_device())[1])
    a = cp.asarray(rng.standard_normal((4, DENSE_K), dtype=np.float32).astype(F16))
    with pytest.raises(ValueError, match=f"batch_invariant.*sms = {least - 1} is fewer"):
        gemm.marlin_gemm(a, w, sms=least - 1, batch_invariant=True)
    with pytest.raises(ValueError, match="cannot be batch_invariant"):
        gemm.marlin_gemm(a, w, use_atomic_add=True, batch_invariant=True)


def test_dense_invariance_on_two_streams_at_once(rng):
    """Two batches of other sizes and content on two streams at the same time (each stream its own scratch): the
    probe rows keep the bits they have alone."""
    mw, _ = random_marlin_weight(*SPLIT_SHAPES[0], S.U4B8, 128, act_dtype=F16, seed=int(rng.integers(1 << 20)))
    w = gemm.upload_weight(mw)
    probes = rng.standard_normal((PROBES, w.size_k), dtype=np.float32).astype(F16)
    alone = gemm.marlin_gemm(cp.asarray(probes[:1]), w, batch_invariant=True)
    cp.cuda.Device().synchronize()
    streams = [cp.cuda.Stream(non_blocking=True) for _ in range(2)]
    batches = [embed(rng, probes, m) for m in (17, 200)]
    outs = []
    for _ in range(3):  # (a few rounds: the two streams' kernels overlap in some)
        for s, (batch, _) in zip(streams, batches):
            c = poisoned(len(batch), w.size_n, F16)
            with s:
                outs.append(gemm.marlin_gemm(cp.asarray(batch), w, c=c, stream=s, batch_invariant=True))
    for s in streams:
        s.synchronize()
    for i, out in enumerate(outs):
        batch, where = batches[i % 2]
        first = where[0]
        assert np.array_equal(bits(out)[first], bits(alone)[0]), f"launch {i}: row {first} differs"


@pytest.mark.parametrize("wt,gs,cfgs", swap_configs(), ids=lambda v: str(v) if not isinstance(v, list) else "pair")
def test_swapped_loop_per_row_sums_against_the_row_layout(wt, gs, cfgs, rng):
    """The swapped loop (C^T = W^T A^T, one mma per 16 x 16 sub-block) against the row layout on the same tile, grid
    and late-scaling choice: whether mma.sync sums a row in the same order in both operand positions. Batch
    invariance relies on it: its kernels (never late-scaled) swap at M <= 8 and take the row layout above."""
    k, n, m = 1024, 512, 8
    mw, _ = random_marlin_weight(k, n, wt, gs, act_dtype=F16, seed=int(rng.integers(1 << 20)))
    w = gemm.upload_weight(mw)
    a = cp.asarray(rng.standard_normal((m, k), dtype=np.float32).astype(F16))
    device = _device()
    stream = cp.cuda.get_current_stream().ptr
    sms = gemm.device_properties(device)[1]
    ws, c_tmp = gemm.scratch_buffers(device, stream, sms)
    ng = int(w.scales.shape[0])
    outs = []
    for cfg in cfgs:
        c = poisoned(m, n, F16)
        buffers = gemm.MarlinMmBuffers(a=a.data.ptr, b=w.qweight.data.ptr, c=c.data.ptr, c_tmp=c_tmp.data.ptr,
                                       b_scales=w.scales.data.ptr, workspace=ws.data.ptr)
        request = gemm.MarlinMmRequest(weight_type=wt, buffers=buffers,
                                       problem=gemm.MarlinMmProblem(m, n, k, k, ng, -1 if ng == 1 else k // ng),
                                       execution=gemm.MarlinMmExecution(device=device, stream=stream))
        grid = 2 * (n // cfg.block_n)  # two blocks per slice, aligned: the same partition for both
        prepared = gemm.prepare_launch(request.into_launch(), config=cfg, grid=grid)
        prepared.launch(a.data.ptr, w.qweight.data.ptr, c.data.ptr, c_tmp.data.ptr, w.scales.data.ptr, 0, 0, 0, 0,
                        ws.data.ptr, stream)
        outs.append(bits(c))
    differ = int(np.count_nonzero(outs[0] != outs[1]))
    assert differ == 0, f"{wt}: {differ} of {m * n} outputs differ between the row layout and the swapped loop"


# ------------------------------------------------------------------------------------------------------------------
# the fused MoE layer
# ------------------------------------------------------------------------------------------------------------------
def moe_layer(rng, wt, gs, act):
    from gpu.test_moe import layer_stacks

    return layer_stacks(rng, MOE_E, MOE_K, MOE_N, wt, gs, act)


def moe_batch(rng, probes, probe_ids, probe_weights, m):
    hidden, where = embed(rng, probes, m)
    ids = np.stack([rng.choice(MOE_E, MOE_TOPK, replace=False) for _ in range(m)]).astype(np.int32)
    weights = rng.uniform(0.05, 1.0, (m, MOE_TOPK)).astype(np.float32)
    ids[where], weights[where] = probe_ids[:len(where)], probe_weights[:len(where)]
    return hidden, ids, weights, where


def run_layer(w13, w2, hidden, ids, weights, **kw):
    return moe.fused_moe(cp.asarray(hidden), w13, w2, cp.asarray(weights), cp.asarray(ids), batch_invariant=True,
                         **kw)


@pytest.mark.parametrize("wt,gs,act", MOE_CASES, ids=str)
def test_fused_moe_tokens_are_batch_invariant(wt, gs, act, rng):
    """A token's output alone and inside batches of other tokens with other routings, every moe_block_size (the
    automatic one of each M and each forced one), and on a stack planned for fewer SMs: the same bits."""
    from gpu.test_moe import check_layer

    w13, w2, w13_ref, w2_ref = moe_layer(rng, wt, gs, act)
    probes = rng.standard_normal((PROBES, MOE_K), dtype=np.float32).astype(act)
    probe_ids = np.stack([rng.choice(MOE_E, MOE_TOPK, replace=False) for _ in range(PROBES)]).astype(np.int32)
    probe_weights = rng.uniform(0.05, 1.0, (PROBES, MOE_TOPK)).astype(np.float32)
    alone = [bits(run_layer(w13, w2, probes[i:i + 1], probe_ids[i:i + 1], probe_weights[i:i + 1]))[0]
             for i in range(PROBES)]
    few = moe.MarlinExpertStack(w13.weight, sms=MOE_FEW_SMS), moe.MarlinExpertStack(w2.weight, sms=MOE_FEW_SMS)
    runs = [(m, dict()) for m in MOE_M] + [(33, dict(block_size=b)) for b in (8, 16, 32, 48, 64)] + \
        [(100, dict(stacks=few))]
    for m, kw in runs:
        hidden, ids, weights, where = moe_batch(rng, probes, probe_ids, probe_weights, m)
        stacks = kw.pop("stacks", (w13, w2))
        out = run_layer(*stacks, hidden, ids, weights, **kw)
        got = bits(out)
        for i, r in enumerate(where):
            assert np.array_equal(got[r], alone[i]), (
                f"probe {i} at token {r} of M = {m} ({kw or 'automatic block size'}): "
                f"{np.count_nonzero(got[r] != alone[i])} of {MOE_K} outputs differ from M = 1")
    check_layer(out, hidden, w13_ref, w2_ref, weights, ids, act, "batch_invariant M = 100")


@pytest.mark.parametrize("path", ["batched", "dense_loop"])
def test_dense_moe_paths_are_batch_invariant(path, rng):
    w13, w2, *_ = moe_layer(rng, S.U4B8, 128, F16)
    probes = rng.standard_normal((PROBES, MOE_K), dtype=np.float32).astype(F16)
    probe_ids = np.stack([rng.choice(MOE_E, MOE_TOPK, replace=False) for _ in range(PROBES)]).astype(np.int32)
    probe_weights = rng.uniform(0.05, 1.0, (PROBES, MOE_TOPK)).astype(np.float32)
    alone = bits(run_layer(w13, w2, probes[:1], probe_ids[:1], probe_weights[:1], path=path))[0]
    for m in MOE_M:
        hidden, ids, weights, where = moe_batch(rng, probes, probe_ids, probe_weights, m)
        got = bits(run_layer(w13, w2, hidden, ids, weights, path=path))
        assert np.array_equal(got[where[0]], alone), f"{path}: token {where[0]} of M = {m} differs from M = 1"


def test_fused_moe_invariance_on_two_streams_at_once(rng):
    w13, w2, *_ = moe_layer(rng, S.U4B8, 128, F16)
    probes = rng.standard_normal((1, MOE_K), dtype=np.float32).astype(F16)
    probe_ids = np.stack([rng.choice(MOE_E, MOE_TOPK, replace=False)]).astype(np.int32)
    probe_weights = rng.uniform(0.05, 1.0, (1, MOE_TOPK)).astype(np.float32)
    alone = bits(run_layer(w13, w2, probes, probe_ids, probe_weights))[0]
    streams = [cp.cuda.Stream(non_blocking=True) for _ in range(2)]
    batches = [moe_batch(rng, probes, probe_ids, probe_weights, m) for m in (9, 150)]
    outs = []
    for _ in range(3):
        for s, (hidden, ids, weights, where) in zip(streams, batches):
            with s:
                outs.append((run_layer(w13, w2, hidden, ids, weights, stream=s), where[0]))
    for s in streams:
        s.synchronize()
    for i, (out, row) in enumerate(outs):
        assert np.array_equal(bits(out)[row], alone), f"launch {i}: token {row} differs"
