"""MoE on a real GPU: the moe_align kernels (Numba and CUDA C++), the fused Marlin MoE GEMM, the batched path, a
loop of dense GEMMs and the whole layer (fused_moe), against the NumPy MoE reference (workbench.moe.moe_reference).

Tolerances (reasons beside them):
* one GEMM phase: |C - ref| <= (2 (u + K·2^-22) + u)(|A| @ |W|) elementwise — one rounding of the output to the
  activation type plus fp32 tensor-core accumulation; doubled because the router-weighted rows round the weighted
  value; + u for the weight rounding a late-scaling kernel leaves out (tests/gpu/test_gemm.py error_bound);
* the layer: workbench.moe.moe_error_bound (derived there from each rounding), and mean relative error < 8u
  (typical elements see a few roundings of ~u each; keeps the worst-case bound from hiding a systematic error).
Outputs are poisoned with NaN so an unwritten row fails; rows no block names must stay NaN.
"""
import dataclasses

import ml_dtypes
import numpy as np
import pytest

from workbench import gemm, hardware, moe
from workbench.policy import DEFAULT_MOE_POLICY
from workbench.formats import moe_align as align_ref
from workbench.scalar_types import ScalarType as S

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not hardware.cupy_available(), reason="no CUDA GPU visible to CuPy")]

cp = pytest.importorskip("cupy")

from gpu.test_gemm import replay_in_graph  # noqa: E402  (tests/ is on the pytest pythonpath)

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
ALL_TYPES = ((S.U4B8, 128), (S.U4, 64), (S.U8B128, 32), (S.U8, -1), (S.FE4M3FN, 128), (S.FE4M3FN, -1))
U = moe.UNIT_ROUNDOFF

BLOCK_PAIRS = ((8, 32), (16, 48), (64, 8), (32, 16), (48, 64), (16, 32))  # two moe_block_sizes per case, rotating


def phase_cases():
    return [(wt, gs, act, BLOCK_PAIRS[(2 * i + j) % len(BLOCK_PAIRS)]) for i, (wt, gs) in enumerate(ALL_TYPES)
            for j, act in enumerate((F16, BF16))]


LAYER_CASES = [  # (E, top_k, M, K, N, weight type, group, act)
    (4, 1, 1, 256, 128, S.U4B8, 128, F16),
    (8, 2, 7, 512, 256, S.U4, 128, BF16),
    (64, 6, 64, 256, 128, S.U8B128, 64, F16),
    (64, 8, 257, 256, 128, S.U4B8, -1, BF16),
    (8, 8, 257, 128, 192, S.U8, 32, F16),
    (8, 2, 64, 256, 128, S.FE4M3FN, 128, BF16),
    (4, 2, 7, 384, 128, S.FE4M3FN, -1, F16),
    (8, 6, 1, 256, 256, S.U4, -1, F16),
]


@pytest.fixture(scope="module", autouse=True)
def compile_everything_once():
    """Compile every fused and dense instantiation the module launches, in parallel threads (NVRTC runs outside
    the GIL; one instantiation takes seconds). The fused choice depends only on shapes and on the routing's size,
    which the cases fix; the dense choice on M only through the 16-row block count, so all four are built."""
    from concurrent.futures import ThreadPoolExecutor

    from workbench.formats.moe_align import aligned_capacity

    device = cp.cuda.Device().id
    props = gemm.device_properties(device)  # (cc, SMs, opt-in smem per block, smem per SM)
    sms, smem, sm_smem = props[1], props[2], props[3]
    fused, dense = set(), set()

    def add_fused(act, wt, bs, n, k, gs, numel, e):
        items = min(aligned_capacity(numel, bs, e) // bs, numel)
        for blocks_per_sm in (0, 1, 2):  # the automatic choice and both forced variants (test_fused_phase_every_type)
            fused.add(moe.choose_moe_config(gemm.act_scalar_type(act), wt, bs, n, k, gs, items, sms, smem, sm_smem,
                                            blocks_per_sm))

    def add_dense(act, wt, n, k, gs):
        for m in (1, 17, 33, 49):
            dense.add(gemm.config_for(gemm.act_scalar_type(act), wt, m, n, k, gs, False, device))

    for wt, gs, act, blocks in phase_cases():
        for bs in blocks:
            add_fused(act, wt, bs, 192, 256, gs, 38, 8)
    add_fused(F16, S.U4B8, 16, 128, 128, 128, 66, 4)
    add_fused(F16, S.U4, moe.choose_block_size(64, 1, 8), 256, 384, 128, 64, 8)
    add_dense(F16, S.U4, 256, 384, 128)
    for e, top_k, m, k, n, wt, gs, act in LAYER_CASES:
        bs = moe.choose_block_size(m, top_k, e)
        gs2 = gs if gs <= n else -1
        add_fused(act, wt, bs, 2 * n, k, gs, m * top_k, e)
        add_fused(act, wt, bs, k, n, gs2, m * top_k, e)
        add_dense(act, wt, 2 * n, k, gs)
        add_dense(act, wt, k, n, gs2)
    bs = moe.choose_block_size(33, 2, 8)
    add_fused(F16, S.U4B8, bs, 256, 256, 128, 66, 8)
    add_fused(F16, S.U4B8, bs, 256, 128, 128, 66, 8)
    add_dense(F16, S.U4B8, 256, 256, 128)
    add_dense(F16, S.U4B8, 256, 128, 128)
    add_dense(F16, S.U4, 128, 256, 64)
    names = [(c.name_expression, c.smem_bytes) for c in fused]
    names += [(f"mwb::{f}<{t}>", 0) for f in ("silu_and_mul", "moe_sum", "add_bias")
              for t in ("__half", "__nv_bfloat16")] + [("mwb::gather_rows", 0), ("mwb::moe_align", 0)]
    with ThreadPoolExecutor(max_workers=16) as pool:
        jobs = [pool.submit(moe.get_moe_kernel, name, device, smem_bytes) for name, smem_bytes in names]
        jobs.append(pool.submit(gemm.precompile, sorted(dense, key=lambda c: c.name_expression), device, 8))
        for job in jobs:
            job.result()


def routing(rng, m, top_k, num_experts, only=None):
    """topk_ids [M, top_k] int32 (distinct experts per token; drawn from `only` when given), weights float32."""
    pool = np.arange(num_experts) if only is None else np.asarray(only)
    ids = np.stack([rng.choice(pool, top_k, replace=False) for _ in range(m)]).astype(np.int32)
    weights = rng.uniform(0.05, 1.0, (m, top_k)).astype(np.float32)
    return ids, weights


def layer_stacks(rng, e, k, n, wt, gs, act):
    seed = int(rng.integers(1 << 20))
    w13, w13_ref = moe.random_expert_stack(e, k, 2 * n, wt, gs, act_dtype=act, seed=seed)
    w2, w2_ref = moe.random_expert_stack(e, n, k, wt, gs if gs <= n else -1, act_dtype=act, seed=seed + 1)
    return (moe.MarlinExpertStack(gemm.upload_weight(w13)), moe.MarlinExpertStack(gemm.upload_weight(w2)),
            w13_ref, w2_ref)


def check_layer(out, hidden, w13_ref, w2_ref, weights, ids, act, where, expert_map=None):
    out = cp.asnumpy(out).astype(np.float32)
    ref = moe.moe_reference(hidden, w13_ref, w2_ref, weights, ids, act, expert_map).astype(np.float32)
    bound = moe.moe_error_bound(hidden, w13_ref, w2_ref, weights, ids, act, expert_map)
    assert np.all(np.isfinite(out)), f"{where}: unwritten or overflowing outputs"
    excess = np.abs(out - ref) - bound
    assert excess.max() <= 0, f"{where}: worst excess {excess.max():.3g} at {np.unravel_index(excess.argmax(), excess.shape)}"
    denom = np.mean(np.abs(ref))
    if denom > 0:
        assert np.mean(np.abs(out - ref)) / denom < 8 * U[np.dtype(act).name], where


# ------------------------------------------------------------------------------------------------------------------
# moe_align_block_size on the GPU (Numba kernel)
# ------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("m,top_k,e,block", [(1, 8, 256, 8), (257, 8, 64, 64), (64, 6, 64, 16), (257, 2, 8, 48)])
def test_moe_align_kernel_on_gpu(m, top_k, e, block, rng):
    from kernels_numba.moe_align import moe_align_block_size

    ids, _ = routing(rng, m, top_k, e)
    got = [cp.asnumpy(x) for x in moe_align_block_size(cp.asarray(ids), block, e)]
    want = align_ref.moe_align_block_size(ids, block, e)
    assert got[2].tolist() == want[2].tolist() and np.array_equal(got[1], want[1])
    assert align_ref.segments(*got, block, ids.size) == align_ref.segments(*want, block, ids.size)


# ------------------------------------------------------------------------------------------------------------------
# moe_align_block_size on the GPU (CUDA C++ kernel, workbench.moe; what fused_moe uses)
# ------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("m,top_k,e,block,mapped", [(1, 8, 256, 8, False), (257, 8, 64, 64, True),
                                                    (64, 6, 64, 16, False), (257, 2, 8, 48, True),
                                                    (300, 8, 1024, 16, True), (3, 1, 1, 32, False),
                                                    (600, 4, 1000, 8, False)])
def test_moe_align_cuda_kernel(m, top_k, e, block, mapped, rng):
    """workbench.moe.moe_align_block_size (CUDA C++): padded count and expert ids equal the NumPy spec, segments hold
    the same entries; dropped ids (-1, >= E) are ignored; outputs are poisoned before the call (below); the input is
    not modified."""
    ids, _ = routing(rng, m, top_k, e)
    ids[rng.random(ids.shape) < 0.05] = -1  # dropped slots
    ids[rng.random(ids.shape) < 0.02] = e  # out of range: ignored as well
    emap = None
    if mapped:  # half the experts on another device (-1), the rest renumbered to local ids
        local = rng.random(e) < 0.5
        emap = np.where(local, np.cumsum(local) - 1, -1).astype(np.int32)
    cap = align_ref.aligned_capacity(ids.size, block, e)
    # poison: free blocks of exactly the outputs' sizes filled with -7, which CuPy's pool hands to the outputs
    for size in (cap, cap // block, 1):
        cp.full(size, -7, dtype=np.int32)
    d_ids = cp.asarray(ids)
    got = [cp.asnumpy(x) for x in moe.moe_align_block_size(d_ids, block, e,
                                                             None if emap is None else cp.asarray(emap))]
    assert np.array_equal(cp.asnumpy(d_ids), ids), "topk_ids was modified"
    want = align_ref.moe_align_block_size(ids, block, e, emap)
    assert [x.shape for x in got] == [x.shape for x in want]
    assert all(x.dtype == np.int32 for x in got)
    assert got[2].tolist() == want[2].tolist() and np.array_equal(got[1], want[1])
    assert np.all(got[0][int(want[2][0]):] == ids.size), "sentinels past the padded count"
    assert align_ref.segments(*got, block, ids.size) == align_ref.segments(*want, block, ids.size)
    # per global expert (the map may merge several into -1): the same entries in that expert's own span
    valid = ids[(ids >= 0) & (ids < e)]
    counts = np.bincount(valid, minlength=e)
    starts = np.concatenate([[0], np.cumsum(-(-counts // block) * block)])
    for x in np.unique(valid):
        seg = got[0][starts[x]:starts[x + 1]]
        assert sorted(seg[seg < ids.size].tolist()) == np.flatnonzero(ids.reshape(-1) == x).tolist(), f"expert {x}"
        assert np.count_nonzero(seg == ids.size) == starts[x + 1] - starts[x] - counts[x], f"expert {x} padding"


def test_moe_align_cuda_empty_routing():
    """M = 0 tokens: nothing routed, padded count 0, every output element still written (sentinels and zeros)."""
    got = [cp.asnumpy(x) for x in moe.moe_align_block_size(cp.empty((0, 4), dtype=np.int32), 16, 8)]
    want = align_ref.moe_align_block_size(np.empty((0, 4), np.int32), 16, 8)
    assert [x.tolist() for x in got] == [x.tolist() for x in want]


def test_moe_align_cuda_rejects_bad_input():
    ids = cp.asarray(np.random.default_rng().integers(0, 4, (4, 2)).astype(np.int32))
    with pytest.raises(TypeError, match="int32"):
        moe.moe_align_block_size(ids.astype(np.int64), 8, 4)
    with pytest.raises(ValueError, match="num_experts = 2000"):
        moe.moe_align_block_size(ids, 8, 2000)
    with pytest.raises(ValueError, match="block_size = -8"):
        moe.moe_align_block_size(ids, -8, 4)
    with pytest.raises(ValueError, match=r"expert_map must be a contiguous \(4,\) array"):
        moe.moe_align_block_size(ids, 8, 4, cp.zeros(3, dtype=np.int32))
    with pytest.raises(TypeError, match="expert_map dtype = int64"):
        moe.moe_align_block_size(ids, 8, 4, cp.zeros(4, dtype=np.int64))
    with pytest.raises(ValueError, match="contiguous 2-D"):
        moe.moe_align_block_size(cp.asfortranarray(cp.asarray(np.arange(12, dtype=np.int32).reshape(4, 3) % 4)),
                                 8, 4)
    with pytest.raises(TypeError, match="not on GPU"):
        moe.moe_align_block_size(np.zeros((4, 2), np.int32), 8, 4)


# ------------------------------------------------------------------------------------------------------------------
# one GEMM phase: fused vs batched vs dense loop vs reference
# ------------------------------------------------------------------------------------------------------------------
def phase_reference(a, w_ref, ids_flat, top_k, weights_flat, act):
    """C[i] = rnd(w_i · a[i // top_k] @ W[e_i]) for every routed entry i (NaN where no expert)."""
    rows = np.full((ids_flat.size, w_ref.shape[2]), np.nan, np.float32)
    bound = np.zeros_like(rows)
    k = a.shape[1]
    for i, e in enumerate(ids_flat):
        if e < 0:
            continue
        x = a[i // top_k].astype(np.float32)
        w = 1.0 if weights_flat is None else weights_flat[i]
        rows[i] = (w * (x @ w_ref[e])).astype(act).astype(np.float32)
        # + u: the weights the reference rounds and a late-scaling kernel does not (tests/gpu/test_gemm.py error_bound)
        u = U[np.dtype(act).name]
        bound[i] = (2 * (u + k * 2.0 ** -22) + u) * abs(w) * (np.abs(x) @ np.abs(w_ref[e]))
    return rows, bound


@pytest.mark.parametrize("wt,gs,act,blocks", phase_cases(), ids=str)
def test_fused_phase_every_type(wt, gs, act, blocks, rng, monkeypatch):
    """Every weight type, both activation types, two block sizes each, with and without router weights, on the
    one-CTA-per-SM kernel and (16-row items) the 128-register two-CTA kernel, which must give the same bits when it
    runs the same tile shape and applies the scales the same way (same arithmetic in the same order; only the ring
    depth differs)."""
    e, k, n, m, top_k = 8, 256, 192, 19, 2
    w, w_ref = moe.random_expert_stack(e, k, n, wt, gs, act_dtype=act, seed=int(rng.integers(1 << 20)))
    stack = moe.MarlinExpertStack(gemm.upload_weight(w))
    a = rng.standard_normal((m, k), dtype=np.float32).astype(act)
    ids, weights = routing(rng, m, top_k, e)
    for block in blocks:
        sorted_ids, expert_ids, post = align_ref.moe_align_block_size(ids, block, e)
        for mul in (False, True):
            ref, bound = phase_reference(a, w_ref, ids.reshape(-1), top_k, weights.reshape(-1) if mul else None, act)
            outs = {}
            for blocks_per_sm in (1, 2):
                policy = dataclasses.replace(DEFAULT_MOE_POLICY, blocks_per_sm=blocks_per_sm)
                out = cp.full((m * top_k, n), np.nan, dtype=act)
                stack.gemm_phase_fused(cp.asarray(a), cp.asarray(sorted_ids), cp.asarray(expert_ids),
                                       cp.asarray(post), out, m, block, top_k,
                                       topk_weights=cp.asarray(weights) if mul else None, policy=policy)
                got = cp.asnumpy(out).astype(np.float32)
                where = f"block={block} mul={mul} blocks_per_sm={blocks_per_sm}"
                assert np.all(np.isfinite(got)), f"{where}: unwritten rows"
                assert np.all(np.abs(got - ref) <= bound), f"{where}: max err {np.max(np.abs(got - ref))}"
                outs[blocks_per_sm] = cp.asnumpy(out).view(np.uint16)
            props = gemm.device_properties(cp.cuda.Device().id)
            cfgs = [moe.choose_moe_config(gemm.act_scalar_type(act), wt, block, n, k, gs, min(expert_ids.size,
                                          m * top_k), props[1], props[2], props[3], b) for b in (1, 2)]
            # (a kernel that scales fp32 partial sums rounds differently from one that scales each weight)
            if (cfgs[0].n_tiles, cfgs[0].k_warp, cfgs[0].late_scale) == (cfgs[1].n_tiles, cfgs[1].k_warp,
                                                                         cfgs[1].late_scale):
                assert np.array_equal(outs[1], outs[2]), f"block={block} mul={mul}: two-CTA kernel changed bits"


def test_fused_phase_skips_minus_one_experts_and_sentinels(rng):
    e, k, n, m, top_k, block = 4, 128, 128, 33, 2, 16
    w, w_ref = moe.random_expert_stack(e, k, n, S.U4B8, 128, seed=int(rng.integers(1 << 20)))
    stack = moe.MarlinExpertStack(gemm.upload_weight(w))
    a = rng.standard_normal((m, k), dtype=np.float32).astype(np.float16)
    ids, _ = routing(rng, m, top_k, e)
    emap = np.array([0, -1, 2, -1], np.int32)  # experts 1 and 3 live on another device
    sorted_ids, expert_ids, post = align_ref.moe_align_block_size(ids, block, e, expert_map=emap)
    out = cp.full((m * top_k, n), np.nan, dtype=np.float16)
    stack.gemm_phase_fused(cp.asarray(a), cp.asarray(sorted_ids), cp.asarray(expert_ids), cp.asarray(post), out, m,
                           block, top_k)
    local = np.where(emap[ids.reshape(-1)] >= 0, ids.reshape(-1), -1)
    ref, bound = phase_reference(a, w_ref, local, top_k, None, np.float16)
    got = cp.asnumpy(out).astype(np.float32)
    skipped = local < 0
    assert skipped.any() and np.all(np.isnan(got[skipped])), "rows of -1 experts must stay untouched"
    assert np.all(np.abs(got[~skipped] - ref[~skipped]) <= bound[~skipped])


@pytest.mark.parametrize("case", ["no_tokens_for_most", "all_to_one"])
def test_phase_paths_agree(case, rng):
    e, k, n, m, top_k = 8, 384, 256, 64, 1
    w, w_ref = moe.random_expert_stack(e, k, n, S.U4, 128, seed=int(rng.integers(1 << 20)))
    stack = moe.MarlinExpertStack(gemm.upload_weight(w))
    a = rng.standard_normal((m, k), dtype=np.float32).astype(np.float16)
    ids, _ = routing(rng, m, top_k, e, only=[3] if case == "all_to_one" else [1, 6])
    order = np.argsort(ids.reshape(-1), kind="stable")
    a_sorted = cp.asarray(a[order])
    dispatches, start = [], 0
    for x in np.unique(ids):
        c = int(np.sum(ids == x))
        dispatches.append((int(x), start, start, c))
        start += c
    batched = cp.full((m, n), np.nan, dtype=np.float16)
    stack.gemm_phase_batched(a_sorted, dispatches, batched)
    loop = cp.full((m, n), np.nan, dtype=np.float16)
    for x, r0, _, c in dispatches:
        gemm.marlin_gemm(a_sorted[r0:r0 + c], stack.weight.expert(x), c=loop[r0:r0 + c])
    block = moe.choose_block_size(m, top_k, e)
    sorted_ids, expert_ids, post = align_ref.moe_align_block_size(ids, block, e)
    fused = cp.full((m, n), np.nan, dtype=np.float16)
    stack.gemm_phase_fused(cp.asarray(a), cp.asarray(sorted_ids), cp.asarray(expert_ids), cp.asarray(post), fused,
                           m, block, top_k)
    ref, bound = phase_reference(a, w_ref, ids.reshape(-1), 1, None, np.float16)
    for name, got in (("batched", cp.asnumpy(batched)[np.argsort(order)]), ("loop", cp.asnumpy(loop)[np.argsort(order)]),
                      ("fused", cp.asnumpy(fused))):
        got = got.astype(np.float32)
        assert np.all(np.abs(got - ref) <= bound), name
    # batched and the dense loop run the same kernel on the same rows: identical bits
    assert np.array_equal(cp.asnumpy(batched).view(np.uint16), cp.asnumpy(loop).view(np.uint16))


# ------------------------------------------------------------------------------------------------------------------
# the whole layer
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("e,top_k,m,k,n,wt,gs,act", LAYER_CASES, ids=str)
def test_fused_moe_paths_match_reference(e, top_k, m, k, n, wt, gs, act, rng):
    w13, w2, w13_ref, w2_ref = layer_stacks(rng, e, k, n, wt, gs, act)
    hidden = rng.standard_normal((m, k), dtype=np.float32).astype(act)
    ids, weights = routing(rng, m, top_k, e)
    outs = {}
    for path in moe.PATHS:
        outs[path] = moe.fused_moe(cp.asarray(hidden), w13, w2, cp.asarray(weights), cp.asarray(ids), path=path)
        check_layer(outs[path], hidden, w13_ref, w2_ref, weights, ids, act, f"path={path}")
    assert np.array_equal(cp.asnumpy(outs["batched"]).view(np.uint16), cp.asnumpy(outs["dense_loop"]).view(np.uint16))


def test_fused_moe_expert_parallel_and_empty_experts(rng):
    e_global, k, n, m, top_k = 8, 256, 128, 33, 2
    w13, w2, w13_ref, w2_ref = layer_stacks(rng, 3, k, n, S.U4B8, 128, F16)  # this device: 3 local experts
    emap = np.array([-1, 0, -1, 1, -1, -1, 2, -1], np.int32)
    hidden = rng.standard_normal((m, k), dtype=np.float32).astype(np.float16)
    ids, weights = routing(rng, m, top_k, e_global, only=[0, 1, 3, 5])  # local expert 2 (global 6) gets nothing
    for path in moe.PATHS:
        out = moe.fused_moe(cp.asarray(hidden), w13, w2, cp.asarray(weights), cp.asarray(ids), path=path,
                            expert_map=cp.asarray(emap))
        check_layer(out, hidden, w13_ref, w2_ref, weights, ids, np.float16, f"path={path}", expert_map=emap)


def _bits(x):
    return cp.asnumpy(x).view(np.uint16)


@pytest.mark.parametrize("programmatic", [False, True])
def test_layers_back_to_back_chain(programmatic, rng, monkeypatch):
    """Four fused_moe layers, each reading the one before's output, queued without a sync (the first call of a key
    takes the checked path, the rest the layer plan), plain and as programmatic launches (MoePolicy.programmatic_launch,
    sm_90): each of the five kernels may start while the one before finishes and must wait before it touches data.
    Every output equals the same layer run alone, bitwise."""
    if programmatic and gemm.device_properties(cp.cuda.Device().id)[0] < 90:
        pytest.skip("programmatic dependent launch needs sm_90")
    policy = dataclasses.replace(DEFAULT_MOE_POLICY, programmatic_launch=programmatic)
    e, k, n, m, top_k = 8, 256, 128, 5, 2
    w13, w2, _, _ = layer_stacks(rng, e, k, n, S.U4B8, 128, F16)
    ids, weights = (cp.asarray(x) for x in routing(rng, m, top_k, e))
    hidden = cp.asarray((rng.standard_normal((m, k)) * 0.5).astype(np.float16))
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        alone, x = [], hidden
        for _ in range(4):
            x = moe.fused_moe(x, w13, w2, weights, ids, stream=stream, policy=policy)
            stream.synchronize()
            alone.append(x)
        chained, x = [], hidden
        for _ in range(4):
            x = moe.fused_moe(x, w13, w2, weights, ids, stream=stream, policy=policy)
            chained.append(x)
        stream.synchronize()
    assert all(np.isfinite(cp.asnumpy(x).astype(np.float32)).all() for x in alone)
    for i, (got, want) in enumerate(zip(chained, alone)):
        assert np.array_equal(_bits(got), _bits(want)), f"layer {i}"


@pytest.mark.parametrize("programmatic", [False, True])
def test_fused_phases_back_to_back_in_a_graph(programmatic, rng, monkeypatch):
    """gemm_phase_fused calls, each reading the one before's output (square experts, top_k = 1), back to back on a
    stream and captured in a CUDA graph, plain and programmatic: outputs bitwise equal to lone calls."""
    if programmatic and gemm.device_properties(cp.cuda.Device().id)[0] < 90:
        pytest.skip("programmatic dependent launch needs sm_90")
    policy = dataclasses.replace(DEFAULT_MOE_POLICY, programmatic_launch=programmatic)
    e, k, m, block = 4, 256, 7, 8
    w, _ = moe.random_expert_stack(e, k, k, S.U4B8, 128, seed=int(rng.integers(1 << 20)))
    stack = moe.MarlinExpertStack(gemm.upload_weight(w))
    ids, _ = routing(rng, m, 1, e)
    sorted_ids, expert_ids, post = (cp.asarray(x) for x in align_ref.moe_align_block_size(ids, block, e))
    a = cp.asarray((rng.standard_normal((m, k)) * 0.5).astype(np.float16))
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        outs = [cp.full((m, k), np.nan, dtype=np.float16) for _ in range(3)]

        def chain():
            x = a
            for out in outs:
                stack.gemm_phase_fused(x, sorted_ids, expert_ids, post, out, m, block, 1, stream=stream,
                                       policy=policy)
                x = out

        chain()
        stream.synchronize()
        alone = [cp.asnumpy(o).copy() for o in outs]
        for o in outs:
            o.fill(np.nan)
        replay_in_graph(stream, chain)
    x = a
    for i, out in enumerate(outs):  # each against a lone call on the same input
        lone = cp.full((m, k), np.nan, dtype=np.float16)
        stack.gemm_phase_fused(x, sorted_ids, expert_ids, post, lone, m, block, 1)
        cp.cuda.Device().synchronize()
        assert np.isfinite(cp.asnumpy(lone).astype(np.float32)).all()
        assert np.array_equal(_bits(out), _bits(lone)) and np.array_equal(alone[i].view(np.uint16), _bits(lone)), i
        x = lone


def test_expert_linear_with_bias_on_gpu(rng):
    w, w_ref = moe.random_expert_stack(2, 256, 256, S.U4, 64, seed=int(rng.integers(1 << 20)))
    stack = moe.MarlinExpertStack(gemm.upload_weight(w))
    bias = rng.standard_normal(128).astype(np.float16)
    view = stack.make_expert_linear(256 + 64, 128, bias=cp.asarray(bias))
    a = rng.standard_normal((5, 256), dtype=np.float32).astype(np.float16)
    got = cp.asnumpy(view(cp.asarray(a))).astype(np.float32)
    exact = a.astype(np.float32) @ w_ref[1][:, 64:192]
    ref = exact + bias.astype(np.float32)
    # GEMM bound (one rounding + accumulation) plus the rounding of the bias add
    # (+ u: late scaling, as in expected_rows)
    bound = (3 * U["float16"] + 2 * 256 * 2.0 ** -22) * (np.abs(a.astype(np.float32)) @ np.abs(w_ref[1][:, 64:192])) \
        + U["float16"] * np.abs(ref)
    assert np.all(np.abs(got - ref) <= bound)


@pytest.mark.parametrize("act", [F16, BF16], ids=str)
def test_fused_moe_on_torch_tensors_allocates_from_torch(act, rng):
    """Torch stacks and inputs give the CuPy result bit for bit on every path, as a torch tensor, and every output
    and intermediate (plan buffers, workspace, partial sums, gathered rows) comes from torch's caching allocator:
    CuPy's pool grows by nothing."""
    torch = pytest.importorskip("torch")
    e, top_k, m, k, n = 8, 2, 7, 512, 256
    seed = int(rng.integers(1 << 20))
    w13, _ = moe.random_expert_stack(e, k, 2 * n, S.U4, 128, act_dtype=act, seed=seed)
    w2, _ = moe.random_expert_stack(e, n, k, S.U4, 128, act_dtype=act, seed=seed + 1)
    tdt = torch.float16 if act == F16 else torch.bfloat16

    def tensor(x):
        x = np.ascontiguousarray(x)
        if x.dtype == act:
            return torch.from_numpy(x.view(np.int16)).cuda().view(tdt)
        return torch.from_numpy(x).cuda()

    def torch_stack(w):
        return moe.MarlinExpertStack(dataclasses.replace(w, qweight=tensor(w.qweight), scales=tensor(w.scales),
                                                         zeros=None if w.zeros is None else tensor(w.zeros)))

    c13, c2 = moe.MarlinExpertStack(gemm.upload_weight(w13)), moe.MarlinExpertStack(gemm.upload_weight(w2))
    t13, t2 = torch_stack(w13), torch_stack(w2)
    hidden = rng.standard_normal((m, k), dtype=np.float32).astype(act)
    ids, weights = routing(rng, m, top_k, e)
    pool = cp.get_default_memory_pool()
    got = None
    for path in moe.PATHS:
        want = moe.fused_moe(cp.asarray(hidden), c13, c2, cp.asarray(weights), cp.asarray(ids), path=path)
        cp.cuda.Device().synchronize()
        used, held = pool.used_bytes(), pool.total_bytes()
        got = None  # (the previous path's output: freed, so the one below is counted)
        before = torch.cuda.memory_allocated()
        for call in range(2):  # the checked call, then (fused path) the layer plan's
            got = moe.fused_moe(tensor(hidden), t13, t2, tensor(weights), tensor(ids), path=path)
            assert isinstance(got, torch.Tensor) and got.dtype == tdt and got.is_cuda, (path, call)
            assert np.array_equal(got.view(torch.int16).cpu().numpy().view(np.uint16), _bits(want)), (path, call)
        torch.cuda.synchronize()
        assert (pool.used_bytes(), pool.total_bytes()) == (used, held), f"{path}: CuPy's pool was used"
        assert torch.cuda.memory_allocated() > before, path  # (at least the output: torch's allocator holds it)

