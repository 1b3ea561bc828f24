"""The NumPy MoE reference, its error bound, and everything in workbench.moe that needs no GPU: validation before
any launch, stacking, single-expert column views (exact against repacking the sliced checkpoint)."""
import dataclasses

import ml_dtypes
import numpy as np
import pytest

from workbench import moe
from workbench.quantize import quantize_weights
from workbench.scalar_types import ScalarType as S
from workbench.weight import make_marlin_weight

BF16 = np.dtype(ml_dtypes.bfloat16)
ACTS = (np.dtype(np.float16), BF16)


def _layer(rng, m, k, n, e, top_k, act):
    hidden = (rng.standard_normal((m, k), dtype=np.float32)).astype(act)
    w13 = rng.standard_normal((e, k, 2 * n), dtype=np.float32) * 0.1
    w2 = rng.standard_normal((e, n, k), dtype=np.float32) * 0.1
    w13, w2 = w13.astype(act).astype(np.float32), w2.astype(act).astype(np.float32)  # representable, like w_ref
    ids = np.stack([rng.choice(e, top_k, replace=False) for _ in range(m)]).astype(np.int32)
    weights = rng.uniform(0.1, 1.0, (m, top_k)).astype(np.float32)
    return hidden, w13, w2, weights, ids


def _exact(hidden, w13, w2, weights, ids):
    """float64, no intermediate rounding: what the bound's derivation measures every rounding against."""
    a = hidden.astype(np.float64)
    n = w2.shape[1]
    out = np.zeros((hidden.shape[0], hidden.shape[1]))
    for t in range(hidden.shape[0]):
        for j, e in enumerate(ids[t]):
            g = a[t] @ w13[e].astype(np.float64)
            h = g[:n] / (1 + np.exp(-g[:n])) * g[n:]
            out[t] += weights[t, j] * (h @ w2[e].astype(np.float64))
    return out


@pytest.mark.parametrize("act", ACTS, ids=str)
@pytest.mark.parametrize("m,e,top_k", [(1, 4, 1), (7, 8, 2), (13, 64, 6), (5, 8, 8)])
def test_reference_within_its_bound_of_the_exact_layer(m, e, top_k, act, rng):
    layer = _layer(rng, m, 128, 64, e, top_k, act)
    ref = moe.moe_reference(*layer)
    assert ref.dtype == act and ref.shape == (m, 128)
    bound = moe.moe_error_bound(*layer)
    err = np.abs(ref.astype(np.float64) - _exact(*layer))
    # the reference is one of the two sides the bound covers: it must use at most half of it
    assert np.all(err <= bound / 2), float(np.max(err / bound))
    # typical elements see a few roundings of ~u each: the mean relative error stays well below 8u (the GPU tests'
    # second criterion, which keeps the worst-case bound above from hiding a systematic error)
    u = moe.UNIT_ROUNDOFF[np.dtype(act).name]
    assert np.mean(err) / np.mean(np.abs(_exact(*layer))) < 8 * u


@pytest.mark.parametrize("act", ACTS, ids=str)
def test_reference_with_biases_within_its_bound_of_the_exact_layer(act, rng):
    """Per-expert biases (gpt-oss's, the seed's expert-linear bias): g = a @ W13[e] + b13[e], y = w (h @ W2[e] +
    b2[e]); the reference rounds once after each bias, its bound covers the biases' share of each rounding."""
    m, k, n, e, top_k = 9, 128, 64, 8, 2
    hidden, w13, w2, weights, ids = _layer(rng, m, k, n, e, top_k, act)
    b13 = (rng.standard_normal((e, 2 * n)) * 2).astype(act)
    b2 = (rng.standard_normal((e, k)) * 2).astype(act)
    ref = moe.moe_reference(hidden, w13, w2, weights, ids, w13_bias=b13, w2_bias=b2)
    bound = moe.moe_error_bound(hidden, w13, w2, weights, ids, w13_bias=b13, w2_bias=b2)
    a = hidden.astype(np.float64)
    exact = np.zeros((m, k))
    for t in range(m):
        for j, x in enumerate(ids[t]):
            g = a[t] @ w13[x].astype(np.float64) + b13[x].astype(np.float64)
            h = g[:n] / (1 + np.exp(-g[:n])) * g[n:]
            exact[t] += weights[t, j] * (h @ w2[x].astype(np.float64) + b2[x].astype(np.float64))
    err = np.abs(ref.astype(np.float64) - exact)
    assert np.all(err <= bound / 2), float(np.max(err / bound))
    assert not np.array_equal(ref, moe.moe_reference(hidden, w13, w2, weights, ids))  # (the biases count)
    with pytest.raises(ValueError, match=r"w2_bias has shape \(8, 127\), expected \(E, 128\)"):
        moe.moe_reference(hidden, w13, w2, weights, ids, w2_bias=b2[:, :127])


def test_router_weights_scale_exactly_and_slots_commute(rng):
    hidden, w13, w2, weights, ids = _layer(rng, 9, 64, 64, 8, 2, np.float16)
    ref = moe.moe_reference(hidden, w13, w2, weights, ids)
    # a power-of-two weight scales every rounded value exactly
    assert np.array_equal(moe.moe_reference(hidden, w13, w2, weights * 2, ids).astype(np.float32),
                          2 * ref.astype(np.float32))
    # swapping the two slots (ids and weights together) leaves the layer unchanged (a + b == b + a in fp32)
    assert np.array_equal(moe.moe_reference(hidden, w13, w2, weights[:, ::-1], ids[:, ::-1]), ref)


def test_unused_experts_and_dropped_entries_contribute_nothing(rng):
    hidden, w13, w2, weights, ids = _layer(rng, 6, 64, 64, 8, 2, np.float16)
    ids[:, :] = rng.choice([2, 5], size=ids.shape)
    ids[:, 1] = np.where(ids[:, 0] == 2, 5, 2)
    ref = moe.moe_reference(hidden, w13, w2, weights, ids)
    w13b, w2b = w13.copy(), w2.copy()
    w13b[[0, 1, 3]] = rng.standard_normal(w13b[[0, 1, 3]].shape)
    w2b[7] = 1e3
    assert np.array_equal(moe.moe_reference(hidden, w13b, w2b, weights, ids), ref)
    dropped = ids.copy()
    dropped[:, 1] = -1
    zeroed = weights.copy()
    zeroed[:, 1] = 0
    # (dropping a slot gives experts 2 and 5 fewer rows per matmul, and BLAS may then sum a row in another order: a
    # fp32 product can differ in its last bit, a rounded fp16 intermediate by one step, which the later products
    # carry; measured over 2,000 seeds: 23 differ, by at most 4.1e-4 of the largest output, within 2^-10 of it)
    got = moe.moe_reference(hidden, w13, w2, weights, dropped).astype(np.float32)
    want = moe.moe_reference(hidden, w13, w2, zeroed, ids).astype(np.float32)
    np.testing.assert_allclose(got, want, rtol=0, atol=2**-10 * np.abs(want).max())
    # expert parallelism: this device holds only global expert 2 (local 0); global 5 lives elsewhere (-1)
    emap = np.full(8, -1, np.int32)
    emap[2] = 0
    only2 = weights * (ids == 2)
    local = np.where(ids == 2, 0, 1).astype(np.int32)
    assert np.array_equal(moe.moe_reference(hidden, w13[[2]], w2[[2]], weights, ids, expert_map=emap),
                          moe.moe_reference(hidden, w13[[2, 5]], w2[[2, 5]], only2, local))


def test_reference_rejects_bad_shapes(rng):
    hidden, w13, w2, weights, ids = _layer(rng, 3, 64, 64, 4, 2, np.float16)
    with pytest.raises(ValueError, match=r"w2_ref has shape \(4, 64, 32\), expected \(E, N, K\)"):
        moe.moe_reference(hidden, w13, w2[:, :, :32], weights, ids)
    with pytest.raises(ValueError, match=r"topk_ids \(3, 2\) and topk_weights \(3, 1\)"):
        moe.moe_reference(hidden, w13, w2, weights[:, :1], ids)


# ------------------------------------------------------------------------------------------------------------------
# stacks and single-expert views
# ------------------------------------------------------------------------------------------------------------------
FORMATS = [(S.U4B8, 128), (S.U4, 64), (S.U8B128, 32), (S.U8, -1), (S.FE4M3FN, 128), (S.U4B8, -1)]


@pytest.mark.parametrize("wt,gs", FORMATS, ids=str)
@pytest.mark.parametrize("act", ACTS, ids=str)
def test_expert_linear_is_the_repack_of_the_sliced_checkpoint(wt, gs, act, rng):
    k, n, e = 256, 192, 3
    qs = [quantize_weights(rng.standard_normal((k, n), dtype=np.float32) * 0.1, wt, gs, act_dtype=act,
                           seed=int(rng.integers(1 << 30))) for _ in range(e)]
    stack = moe.MarlinExpertStack(moe.stack_marlin_weights([make_marlin_weight(q) for q in qs]))
    assert (stack.num_experts, stack.k, stack.n_per_expert) == (e, k, n)
    for expert, col, width in [(0, 0, 192), (1, 64, 128), (2, 128, 64)]:
        view = stack.make_expert_linear(expert * n + col, width)
        q = qs[expert]
        sl = slice(col, col + width)
        sliced = dataclasses.replace(q, codes=q.codes[:, sl], scales=q.scales[:, sl],
                                     zeros=None if q.zeros is None else q.zeros[:, sl], w_ref=q.w_ref[:, sl])
        want = make_marlin_weight(sliced)
        assert (view.expert, view.column_offset, view.weight.size_n) == (expert, col, width)
        for field in ("qweight", "scales", "zeros"):
            got, exp = getattr(view.weight, field), getattr(want, field)
            if exp is None:
                assert got is None
                continue
            assert got.flags["C_CONTIGUOUS"] and got.dtype == exp.dtype
            assert np.array_equal(got.view(np.uint8), np.ascontiguousarray(exp).view(np.uint8)), field


def test_expert_linear_rejects_bad_slices(rng):
    stack, _ = moe.random_expert_stack(2, 128, 128, S.U4B8, 128, seed=int(rng.integers(1 << 20)))
    s = moe.MarlinExpertStack(stack)
    for off, n, msg in [(32, 64, "multiples of 64"), (0, 96, "multiples of 64"), (64, 128, "cross the boundary"),
                        (192, 128, r"exceed the stack's 2 x 128 = 256 columns"), (0, 0, "positive")]:
        with pytest.raises(ValueError, match=msg):
            s.make_expert_linear(off, n)
    with pytest.raises(ValueError, match=r"bias has shape \(3,\), expected \(64,\)"):
        s.make_expert_linear(0, 64, bias=np.zeros(3))
    bias = rng.standard_normal(64).astype(np.float32)
    assert np.array_equal(s.make_expert_linear(64, 64, bias=bias).bias, bias.astype(np.float16))


def test_stack_marlin_weights_checks_and_matches_views(rng):
    stack, w_ref = moe.random_expert_stack(3, 128, 64, S.U4, 64, seed=int(rng.integers(1 << 20)))
    assert stack.num_experts == 3 and stack.zeros.shape == (3, 2, 8) and w_ref.shape == (3, 128, 64)
    one = stack.expert(1)
    assert one.qweight.shape == (8, 128) and np.shares_memory(one.qweight, stack.qweight)
    other, _ = moe.random_expert_stack(1, 128, 64, S.U4B8, 64)
    with pytest.raises(ValueError, match=r"experts\[1\] is \(K, N, group, type"):
        moe.stack_marlin_weights([stack.expert(0), other.expert(0)])
    with pytest.raises(ValueError, match="single layer"):
        moe.MarlinExpertStack(one)
    with pytest.raises(ValueError, match="num_streams = 0"):
        moe.MarlinExpertStack(stack, num_streams=0)


def test_dispatch_validation_names_the_bad_dispatch(rng):
    stack, _ = moe.random_expert_stack(4, 128, 64, S.U4B8, 128, seed=int(rng.integers(1 << 20)))
    s = moe.MarlinExpertStack(stack)
    ok = s.check_dispatches((10, 128), (12, 64), [(0, 0, 0, 4), (3, 4, 6, 6), (1, 0, 4, 0)])
    assert ok == [(0, 0, 0, 4), (3, 4, 6, 6)]  # m = 0 dropped
    cases = [([(4, 0, 0, 1)], r"dispatches\[0\]: expert_idx = 4 is outside \[0, 4\)"),
             ([(0, 0, 0, 1), (1, 8, 0, 3)], r"dispatches\[1\]: input rows \[8, 11\) exceed input rows = 10"),
             ([(0, 0, 10, 3)], r"output rows \[10, 13\) exceed output rows = 12"),
             ([(0, 0, 0, 4), (1, 0, 3, 2)], r"overlapping output rows \[0, 4\) and \[3, 5\)"),
             ([(0, -1, 0, 1)], "negative"),
             ([(0, 0, 0)], r"is not \(expert_idx"),
             ([(0, 0.5, 0, 1)], None)]
    for dispatches, msg in cases:
        with pytest.raises((ValueError, TypeError), match=msg):
            s.check_dispatches((10, 128), (12, 64), dispatches)


def test_gpu_paths_reject_host_arrays_before_any_launch(rng):
    stack, _ = moe.random_expert_stack(2, 128, 128, S.U4B8, 128, seed=int(rng.integers(1 << 20)))
    w13 = moe.MarlinExpertStack(stack)
    down, _ = moe.random_expert_stack(2, 64, 128, S.U4B8, 64)
    w2 = moe.MarlinExpertStack(down)
    hidden = rng.standard_normal((3, 128)).astype(np.float16)
    ids = np.zeros((3, 1), np.int32)
    weights = np.ones((3, 1), np.float32)
    with pytest.raises(TypeError, match="hidden is not on GPU"):
        moe.fused_moe(hidden, w13, w2, weights, ids)
    with pytest.raises(ValueError, match="path = 'cuda'"):
        moe.fused_moe(hidden, w13, w2, weights, ids, path="cuda")
    with pytest.raises(ValueError, match="w13 n_per_expert = 128 must be 2 x w2's K = 128"):
        moe.fused_moe(hidden, w13, w13, weights, ids)
    with pytest.raises(TypeError, match="input is not on GPU"):
        w13.gemm_phase_batched(hidden, [(0, 0, 0, 3)], np.zeros((3, 128), np.float16))


def test_block_size_choice_follows_the_fill_rule():
    assert moe.choose_block_size(1, 8, 256) == 8
    assert moe.choose_block_size(64, 2, 8) == 32  # 16 rows per expert: 16/16 = 1.0 >= 0.9, 16/32 < 0.9
    assert moe.choose_block_size(4096, 8, 8) == 64
