"""The fused MoE on the microscaled formats (NVFP4 fp16 / bf16, MXFP4 and MXFP8 bf16: every pair vLLM's Marlin MoE
runs) and gpt-oss's expert block, on a real GPU, against the NumPy references: the formats' exact dequantizers
(workbench.formats.microscale), workbench.moe.moe_reference (roundings where the kernels write activations) and
workbench.formats.gpt_oss.moe_forward (float64, gpt-oss's interleaved layout).

Weights are drawn as codes (every E2M1 code, finite E4M3 bytes, E8M0 codes / E4M3 block scales around 2^-5), so a
gpt-oss-like shape (H = I = 2880, top-4; 8 experts instead of 32 or 128, to keep the host work small) builds in
seconds, through the same ops as the dense layers (workbench.moe.microscale_expert_stack).

Tolerances (reasons beside them):
* identity rows: exact. A unit row of A reads out one weight row; the kernel's one rounding of (moved bits x scale)
  is exact for these formats (E2M1 / E4M3 times an E4M3 or power-of-two scale fits the activation type's
  significand), the mma with 1.0 is exact, NVFP4's fp32 global-scale multiply and the output rounding round as the
  reference's fp32 cast then activation cast do (the dense test's argument, tests/gpu/test_fp4_gemm.py);
* one phase with bias and router weight: (2 (u + K 2^-22) + 2^-22)(|A| @ |W|) + u |b|, all x |w|: the output
  rounding, fp32 tensor-core accumulation, NVFP4's global-scale multiply (2^-22), the bias in the one rounding,
  doubled (router-weighted rows round the weighted value);
* the layer: workbench.moe.moe_error_bound with the clamped SwiGLU (derived there: min / clip are 1-Lipschitz,
  |d(g sigmoid(alpha g))/dg| <= 1.1) and gemm_extra = 2^-22 (NVFP4's global scale), plus a mean relative error below
  8u: at K = 2880 the worst-case bound sums every rounding with one sign and is far above the typical error, so the
  mean check is what catches a systematic error (a wrong scale, a missing bias, a permuted column);
* gpt-oss against the float64 reference: the same bound (it bounds each side's distance from the exact value, doubled).
Outputs are poisoned (NaN) before every launch: phase outputs directly, the layer's by filling the pool block it gets.
"""
import ml_dtypes
import numpy as np
import pytest

from workbench import gemm, hardware, moe
from workbench.formats import gpt_oss
from workbench.formats import moe_align as align_ref
from workbench.formats.moe_align import aligned_capacity
from workbench.moe.activation import GPT_OSS, Activation
from workbench.scalar_types import ScalarType as S

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not hardware.cupy_available(), reason="no CUDA GPU visible to CuPy")]

cp = pytest.importorskip("cupy")

F16, BF16 = np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)
CASES = (("nvfp4", F16), ("nvfp4", BF16), ("mxfp4", BF16), ("mxfp8", BF16))
IDS = [f"{f}-{a.name}" for f, a in CASES]
U = moe.UNIT_ROUNDOFF
GS_EXTRA = 2.0 ** -22  # NVFP4's fp32 global-scale multiply of the fp32 sums: one more rounding
WEIGHT_TYPE = {"nvfp4": (S.FE2M1F, 16, False), "mxfp4": (S.FE2M1F, 32, True), "mxfp8": (S.FE4M3FN, 32, True)}
SMALL = dict(e=4, k=256, n=128, m=16, top_k=2, blocks=(8, 64))  # one phase
LAYER = dict(e=8, hidden=256, inter=128, m=7, top_k=2)
GPT_OSS_SHAPE = dict(e=8, hidden=2880, inter=2880, top_k=4, ms=(1, 64))


@pytest.fixture(scope="module", autouse=True)
def compile_everything_once():
    """Every fused instantiation the module launches (the choice mirrors fused_grid), the elementwise kernels and
    the dense kernels of the batched paths, compiled in parallel threads (NVRTC runs outside the GIL)."""
    from concurrent.futures import ThreadPoolExecutor
    import dataclasses

    device = cp.cuda.Device().id
    props = gemm.device_properties(device)
    sms, smem, sm_smem = props[1], props[2], props[3]
    fused, dense = set(), set()

    def add_fused(fmt, act, bs, n, k, numel, e):
        wt, group, e8m0 = WEIGHT_TYPE[fmt]
        items = min(aligned_capacity(numel, bs, e) // bs, numel)
        fused.add(moe.choose_moe_config(gemm.act_scalar_type(act), wt, bs, n, k, group, items, sms, smem, sm_smem,
                                        e8m0_scales=e8m0))

    for fmt, act in CASES:
        s = SMALL
        for bs in s["blocks"]:
            add_fused(fmt, act, bs, s["n"], s["k"], s["m"] * s["top_k"], s["e"])
        lay = LAYER
        bs = moe.choose_block_size(lay["m"], lay["top_k"], lay["e"])
        add_fused(fmt, act, bs, 2 * lay["inter"], lay["hidden"], lay["m"] * lay["top_k"], lay["e"])
        add_fused(fmt, act, bs, lay["hidden"], lay["inter"], lay["m"] * lay["top_k"], lay["e"])
        wt, group, e8m0 = WEIGHT_TYPE[fmt]
        for n, k in ((2 * lay["inter"], lay["hidden"]), (lay["hidden"], lay["inter"])):
            cfg = gemm.config_for(gemm.act_scalar_type(act), wt, 1, n, k, group, False, device)
            dense.add(dataclasses.replace(cfg, e8m0_scales=e8m0))
        g = GPT_OSS_SHAPE
        for m in g["ms"] if act == BF16 else ():
            bs = moe.choose_block_size(m, g["top_k"], g["e"])
            add_fused(fmt, act, bs, 2 * g["inter"], g["hidden"], m * g["top_k"], g["e"])
            add_fused(fmt, act, bs, g["hidden"], g["inter"], m * g["top_k"], g["e"])
    names = [(c.name_expression, c.smem_bytes) for c in fused]
    names += [(f"mwb::{f}<{t}>", 0) for f in ("silu_and_mul", "swiglu_oai_and_mul", "moe_sum")
              for t in ("__half", "__nv_bfloat16")] + [("mwb::gather_rows", 0), ("mwb::moe_align", 0)]
    with ThreadPoolExecutor(max_workers=16) as pool:
        jobs = [pool.submit(moe.get_moe_kernel, name, device, smem_bytes) for name, smem_bytes in names]
        jobs.append(pool.submit(gemm.precompile, sorted(dense, key=lambda c: c.name_expression), device, 8))
        for job in jobs:
            job.result()


def build(fmt, act, e, k, n, rng, bias=False, ref_dtype=np.float64):
    """(stack on the GPU, w_ref [E, K, N] float32, bias [E, N] float32 or None). ``ref_dtype`` float32: the fast
    dequantizer (NVFP4's value rounded once to float32, 2^-24 relative: inside every bound but the identity test's)."""
    elements, scales, g = moe.random_microscale_experts(fmt, e, k, n, rng)
    w, gs, w_ref = moe.microscale_expert_stack(fmt, elements, scales, g, k, n, act, ref_dtype=ref_dtype)
    b = (rng.standard_normal((e, n)) * 0.5).astype(act) if bias else None
    stack = moe.MarlinExpertStack(gemm.upload_weight(w), global_scale=None if gs is None else cp.asarray(gs),
                                  bias=None if b is None else cp.asarray(b))
    assert (stack.microscale.name, stack.microscale.group_size) == (fmt.upper(), WEIGHT_TYPE[fmt][1])
    return stack, w_ref.astype(np.float32), None if b is None else b.astype(np.float32)


def routing(rng, m, top_k, e):
    ids = np.stack([rng.choice(e, top_k, replace=False) for _ in range(m)]).astype(np.int32)
    return ids, rng.uniform(0.05, 1.0, (m, top_k)).astype(np.float32)


def run_phase(stack, a, ids, block, e, top_k, weights=None):
    sorted_ids, expert_ids, post = align_ref.moe_align_block_size(ids, block, e)
    out = cp.full((a.shape[0] * top_k, stack.n_per_expert), np.nan, dtype=a.dtype)
    stack.gemm_phase_fused(cp.asarray(a), cp.asarray(sorted_ids), cp.asarray(expert_ids), cp.asarray(post), out,
                           a.shape[0], block, top_k, topk_weights=None if weights is None else cp.asarray(weights))
    return cp.asnumpy(out).astype(np.float32)


@pytest.mark.parametrize("fmt,act", CASES, ids=IDS)
def test_identity_rows_give_the_exact_weight(fmt, act, rng):
    s = SMALL
    stack, w_ref, _ = build(fmt, act, s["e"], s["k"], s["n"], rng)
    rows = rng.choice(s["k"], size=s["m"], replace=False)
    a = np.zeros((s["m"], s["k"]), act)
    a[np.arange(s["m"]), rows] = 1
    ids, _ = routing(rng, s["m"], s["top_k"], s["e"])
    for block in s["blocks"]:
        got = run_phase(stack, a, ids, block, s["e"], s["top_k"])
        flat = ids.reshape(-1)
        want = np.stack([w_ref[flat[i], rows[i // s["top_k"]]] for i in range(flat.size)]).astype(act).astype(
            np.float32)
        bad = got != want
        assert not bad.any(), (f"{fmt} {act} block={block}: {int(bad.sum())} of {bad.size} differ, first at "
                               f"{np.argwhere(bad)[0]}: got {got[bad][0]}, want {want[bad][0]}")


@pytest.mark.parametrize("fmt,act", CASES, ids=IDS)
def test_random_phase_with_bias_and_router_weights(fmt, act, rng):
    s = SMALL
    stack, w_ref, b = build(fmt, act, s["e"], s["k"], s["n"], rng, bias=True)
    a = rng.standard_normal((s["m"], s["k"])).astype(act)
    ids, weights = routing(rng, s["m"], s["top_k"], s["e"])
    u = U[act.name]
    flat, wflat = ids.reshape(-1), weights.reshape(-1)
    af = a.astype(np.float64)
    for block in s["blocks"]:
        for mul in (False, True):
            got = run_phase(stack, a, ids, block, s["e"], s["top_k"], weights if mul else None)
            assert np.isfinite(got).all(), f"{fmt} block={block}: unwritten rows"
            for i, ex in enumerate(flat):
                w = wflat[i] if mul else 1.0
                x = af[i // s["top_k"]]
                ref = w * (x @ w_ref[ex] + b[ex])
                bound = abs(w) * (2 * (2 * (u + s["k"] * 2.0 ** -22) + GS_EXTRA) * (np.abs(x) @ np.abs(w_ref[ex]))
                                  + 2 * u * np.abs(b[ex])) + 1e-30
                err = np.abs(got[i] - ref)
                assert (err <= bound).all(), (f"{fmt} {act} block={block} mul={mul} row {i}: max err / bound "
                                              f"{float((err / bound).max()):.3g}")


def poison_pool(shape, dtype):
    """Fill the pool block the next allocation of this size gets with NaN (so an unwritten output element shows)."""
    x = cp.full(shape, np.nan, dtype=dtype)
    cp.cuda.get_current_stream().synchronize()
    del x


def check_layer(out, want, bound, act, where):
    out = cp.asnumpy(out).astype(np.float64)
    assert np.isfinite(out).all(), f"{where}: unwritten or overflowing outputs"
    err = np.abs(out - want)
    assert (err <= bound).all(), (f"{where}: worst err / bound {float((err / bound).max()):.3g} at "
                                  f"{np.unravel_index(int(np.argmax(err / bound)), err.shape)}")
    denom = np.mean(np.abs(want))
    assert np.mean(err) / denom < 8 * U[act.name], f"{where}: mean relative error {np.mean(err) / denom:.3g}"


@pytest.mark.parametrize("fmt,act", CASES, ids=IDS)
@pytest.mark.parametrize("activation", ("silu", "swigluoai"))
def test_layer_every_path_with_biases(fmt, act, activation, rng):
    """fused, batched and dense_loop (the dense FP4 GEMM with each expert's global scale) on a small layer with
    biases, SiLU or the clamped SwiGLU, against moe_reference within moe_error_bound."""
    lay = LAYER
    w13, w13_ref, b13 = build(fmt, act, lay["e"], lay["hidden"], 2 * lay["inter"], rng, bias=True)
    w2, w2_ref, b2 = build(fmt, act, lay["e"], lay["inter"], lay["hidden"], rng, bias=True)
    hidden = rng.standard_normal((lay["m"], lay["hidden"])).astype(act)
    ids, weights = routing(rng, lay["m"], lay["top_k"], lay["e"])
    spec = Activation("swigluoai", 1.702, 7.0) if activation == "swigluoai" else Activation("silu")
    kw = dict(act_dtype=act, w13_bias=b13, w2_bias=b2, activation=spec)
    want = moe.moe_reference(hidden, w13_ref, w2_ref, weights, ids, **kw).astype(np.float64)
    bound = moe.moe_error_bound(hidden, w13_ref, w2_ref, weights, ids, gemm_extra=GS_EXTRA, **kw)
    for path in moe.PATHS:
        poison_pool((lay["m"], lay["hidden"]), act)
        out = moe.fused_moe(cp.asarray(hidden), w13, w2, cp.asarray(weights), cp.asarray(ids), path=path,
                            activation=spec)
        check_layer(out, want, bound, act, f"{fmt} {act} {activation} path={path}")


def gpt_oss_like(fmt, act, rng):
    g = GPT_OSS_SHAPE
    w13, w13_ref, b13 = build(fmt, act, g["e"], g["hidden"], 2 * g["inter"], rng, bias=True, ref_dtype=np.float32)
    w2, w2_ref, b2 = build(fmt, act, g["e"], g["inter"], g["hidden"], rng, bias=True, ref_dtype=np.float32)
    return w13, w13_ref, b13, w2, w2_ref, b2


GPT_OSS_LIKE_CASES = (("nvfp4", BF16), ("mxfp8", BF16))  # gpt-oss runs in bf16; NVFP4 fp16 at the small shapes


@pytest.mark.parametrize("fmt,act", GPT_OSS_LIKE_CASES, ids=[f"{f}-{a.name}" for f, a in GPT_OSS_LIKE_CASES])
def test_gpt_oss_like_shape(fmt, act, rng):
    """The gpt-oss expert block's shape and semantics (biases, clamped SwiGLU, top-4 softmax routing) on NVFP4 and
    MXFP8 stacks, fused path, M = 1 and 64 (MXFP4, gpt-oss's own format, runs through GptOssExperts below)."""
    g = GPT_OSS_SHAPE
    w13, w13_ref, b13, w2, w2_ref, b2 = gpt_oss_like(fmt, act, rng)
    for m in g["ms"]:
        hidden = rng.standard_normal((m, g["hidden"])).astype(act)
        logits = rng.standard_normal((m, g["e"])).astype(np.float32)
        weights, ids = moe.route_topk_softmax(cp.asarray(logits), g["top_k"])
        want_w, want_ids = gpt_oss.route(logits.astype(np.float64), g["top_k"])
        assert np.array_equal(cp.asnumpy(ids), want_ids) and np.allclose(cp.asnumpy(weights), want_w, atol=1e-6)
        w, i = cp.asnumpy(weights), cp.asnumpy(ids)
        kw = dict(act_dtype=act, w13_bias=b13, w2_bias=b2, activation=GPT_OSS)
        want = moe.moe_reference(hidden, w13_ref, w2_ref, w, i, **kw).astype(np.float64)
        bound = moe.moe_error_bound(hidden, w13_ref, w2_ref, w, i, gemm_extra=GS_EXTRA, **kw)
        poison_pool((m, g["hidden"]), act)
        out = moe.fused_moe(cp.asarray(hidden), w13, w2, weights, ids, activation=GPT_OSS)
        check_layer(out, want, bound, act, f"{fmt} {act} gpt-oss-like M={m}")


def random_gpt_oss_checkpoint(rng, e, hidden, inter):
    """gpt-oss's tensors as transformers stores them: interleaved gate_up rows, [E, N, K/32, 16] blocks; E8M0 codes
    around 2^-5 at K = 2880 (2^-2 at K <= 256), so that gate_up's outputs reach the clamp (|h| > 7)."""
    def stack(n, k):
        blocks = rng.integers(0, 256, size=(e, n, k // 32, 16), dtype=np.uint8)
        log2 = -5 if k > 1024 else -2
        return blocks, (rng.integers(-1, 2, size=(e, n, k // 32)) + 127 + log2).astype(np.uint8)
    gu, gu_s = stack(2 * inter, hidden)
    dn, dn_s = stack(hidden, inter)
    bias = (lambda n: (rng.standard_normal((e, n)) * 0.5).astype(BF16).astype(np.float32))
    return dict(gate_up_blocks=gu, gate_up_scales=gu_s, gate_up_bias=bias(2 * inter), down_blocks=dn,
                down_scales=dn_s, down_bias=bias(hidden))


@pytest.mark.parametrize("shape", ("small", "gpt-oss-like"))
def test_gpt_oss_experts_match_the_gpt_oss_reference(shape, rng):
    """GptOssExperts (MXFP4 from gpt-oss's checkpoint layout: interleaved gate_up de-interleaved at build time,
    biases, clamped SwiGLU, router top-k softmax over the k) against workbench.formats.gpt_oss.moe_forward, float64
    on the interleaved weights; the bound is moe_error_bound's on the de-interleaved exact weights."""
    if shape == "small":
        e, hidden, inter, top_k, ms = LAYER["e"], LAYER["hidden"], LAYER["inter"], 2, (LAYER["m"],)
    else:
        g = GPT_OSS_SHAPE
        e, hidden, inter, top_k, ms = g["e"], g["hidden"], g["inter"], g["top_k"], g["ms"]
    t = random_gpt_oss_checkpoint(rng, e, hidden, inter)
    experts = moe.GptOssExperts(**t, top_k=top_k)
    w_gu = gpt_oss.dequantize_stack(t["gate_up_blocks"], t["gate_up_scales"])  # [E, 2I, H], interleaved
    w_dn = gpt_oss.dequantize_stack(t["down_blocks"], t["down_scales"])
    perm = moe.gate_up_permutation(2 * inter)
    w13_ref = np.ascontiguousarray(np.transpose(w_gu[:, perm], (0, 2, 1)), np.float32)
    w2_ref = np.ascontiguousarray(np.transpose(w_dn, (0, 2, 1)), np.float32)
    router_w, router_b = rng.standard_normal((e, hidden)) * 0.05, rng.standard_normal(e) * 0.1
    clamped = False
    for m in ms:
        hidden_x = rng.standard_normal((m, hidden)).astype(BF16)
        x = hidden_x.astype(np.float64)
        logits = x @ router_w.T + router_b
        want = gpt_oss.moe_forward(x, router_w, router_b, w_gu, t["gate_up_bias"], w_dn, t["down_bias"], top_k)
        weights, ids = gpt_oss.route(logits, top_k)
        kw = dict(act_dtype=BF16, w13_bias=t["gate_up_bias"][:, perm], w2_bias=t["down_bias"], activation=GPT_OSS)
        bound = moe.moe_error_bound(hidden_x, w13_ref, w2_ref, weights.astype(np.float32), ids, **kw)
        h = x.astype(np.float32) @ w13_ref[np.unique(ids)]
        clamped |= bool((np.abs(h) > 7).any())
        # (the batched path on the small shape only: at gpt-oss's it would compile a dense kernel per row count)
        for path in (("fused", "batched") if shape == "small" else ("fused",)):
            poison_pool((m, hidden), BF16)
            out = experts(cp.asarray(hidden_x), cp.asarray(logits.astype(np.float32)), path=path)
            check_layer(out, want, bound, BF16, f"gpt-oss {shape} M={m} path={path}")
    assert clamped, "the data must reach the clamp"
