"""The host side of the fused MoE on the microscaled formats (NVFP4, MXFP4, MXFP8) and gpt-oss's expert semantics,
without a GPU: the stacks' format by the dense MICROSCALE_RULES and the errors that name the values; the kernel a
stack launches (weight code, the per-expert global scales in the zero-point slot, the clamped SwiGLU and its alpha
and limit) on the stand-in CuPy and driver (tests/fake_device.py), for the checked call and the layer plan alike;
the de-interleave of gpt-oss's gate_up (a row permutation of blocks, scales and bias) and the whole gpt-oss expert
block in NumPy on the Marlin stacks, against workbench.formats.gpt_oss."""
import dataclasses

import ml_dtypes
import numpy as np
import pytest

from fake_device import FakeArray, installed
from workbench import moe, ops
from workbench.formats import gpt_oss
from workbench.moe.activation import GPT_OSS, Activation, activation_of
from workbench.scalar_types import ScalarType as S
from workbench.weight import MarlinWeight

BF16, F16 = np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16)
E, HID, INTER = 4, 256, 128


def fake_weight(k, n, wt, act, group, experts=E, scale_dtype=np.uint8):
    pf = wt.pack_factor
    return MarlinWeight(FakeArray((experts, k // 16, n * 16 // pf), np.int32),
                        FakeArray((experts, k // group, n), scale_dtype), None, None, None, k, n, group, wt,
                        np.dtype(act), num_experts=experts)


FORMATS = {"nvfp4": (S.FE2M1F, 16, True), "mxfp4": (S.FE2M1F, 32, False), "mxfp8": (S.FE4M3FN, 32, False)}


def fake_stack(fmt, k, n, act, **kw):
    wt, group, has_gs = FORMATS[fmt]
    gs = FakeArray((E,), np.float32) if has_gs else None
    return moe.MarlinExpertStack(fake_weight(k, n, wt, act, group), global_scale=gs, **kw)


@pytest.fixture
def fake():
    with installed() as (cupy, driver):
        yield cupy, driver


# ---- formats and their refusals -----------------------------------------------------------------------------
@pytest.mark.parametrize("fmt,act", [("nvfp4", F16), ("nvfp4", BF16), ("mxfp4", BF16), ("mxfp8", BF16)])
def test_stack_format_follows_the_dense_rules(fake, fmt, act):
    stack = fake_stack(fmt, HID, 2 * INTER, act)
    assert stack.microscale.name == fmt.upper() and stack.microscale.group_size == FORMATS[fmt][1]
    assert (stack.global_scale is not None) == FORMATS[fmt][2]


def test_bad_combinations_are_refused_by_name(fake):
    def refused(weight, global_scale=None, **kw):
        with pytest.raises((ValueError, TypeError)) as err:
            moe.MarlinExpertStack(weight, global_scale=global_scale, **kw)
        return str(err.value)

    gs = FakeArray((E,), np.float32)
    assert "NVFP4 expert stack needs global_scale" in refused(fake_weight(HID, 128, S.FE2M1F, F16, 16))
    assert "E = 4" in refused(fake_weight(HID, 128, S.FE2M1F, F16, 16))
    # MXFP4 runs in bf16 only (E8M0 reaches 2^127)
    msg = refused(fake_weight(HID, 128, S.FE2M1F, F16, 32))
    assert "MXFP4" in msg and "bf16" in msg and "f16" in msg
    assert "MXFP8" in refused(fake_weight(HID, 128, S.FE4M3FN, F16, 32))
    # fe2m1f weights always take scale bytes
    assert "takes scale bytes" in refused(fake_weight(HID, 128, S.FE2M1F, BF16, 32, scale_dtype=BF16))
    # NVFP4 (a global scale given) has groups of 16
    assert "groups of 16, got group size 32" in refused(fake_weight(HID, 128, S.FE2M1F, BF16, 32), gs)
    # a global scale is NVFP4's only
    assert "takes none" in refused(fake_weight(HID, 128, S.U4B8, F16, 128, scale_dtype=F16), gs)
    assert "no global scale" in refused(fake_weight(HID, 128, S.FE4M3FN, BF16, 32), gs)
    # one fp32 per expert
    msg = refused(fake_weight(HID, 128, S.FE2M1F, F16, 16), FakeArray((1,), np.float32))
    assert "one value per expert" in msg and "(1,)" in msg and "E = 4" in msg
    assert "float16" in refused(fake_weight(HID, 128, S.FE2M1F, F16, 16), FakeArray((E,), np.float16))
    # an expert N that is not whole 64-column tiles: the dense rule (the padded arrays are valid, the kernels'
    # microscaled edge tiles not yet checked on a GPU)
    w = fake_weight(HID, 128, S.FE2M1F, BF16, 32)
    odd = dataclasses.replace(w, size_n=100)
    assert "MXFP4 with size_n = 100" in refused(odd)
    # bias rows [E, N] in the act dtype
    assert "expected (4, 128)" in refused(fake_weight(HID, 128, S.FE2M1F, BF16, 32), bias=FakeArray((E, 64), BF16))
    assert "activation dtype" in refused(fake_weight(HID, 128, S.FE2M1F, BF16, 32), bias=FakeArray((E, 128), F16))


def test_activation_specs():
    assert activation_of(None) == activation_of("silu") == Activation("silu")
    assert activation_of("swiglu_oai") == activation_of({"name": "swiglu_oai"}) == GPT_OSS
    assert activation_of({"name": "swigluoai", "alpha": 1.5, "limit": 5.0}) == Activation("swigluoai", 1.5, 5.0)
    with pytest.raises(ValueError, match="'gelu' is not one of"):
        activation_of("gelu")
    with pytest.raises(ValueError, match=r"limit = -1.0 must be a finite number > 0"):
        Activation("swigluoai", 1.702, -1.0)
    with pytest.raises(ValueError, match=r"alpha = nan"):
        Activation("swigluoai", float("nan"))
    with pytest.raises(ValueError, match="unknown"):
        activation_of({"name": "swigluoai", "beta": 1})
    a, l = GPT_OSS.kernel_args
    assert np.array([a, l], np.int32).view(np.float32).tolist() == [np.float32(1.702), 7.0]


# ---- what the launches carry (stand-in driver) -------------------------------------------------------------
def launch_names(driver):
    return [(driver.moe_names[r[0]], r) for r in driver.launches]


@pytest.mark.parametrize("fmt,act,code", [("nvfp4", F16, 9), ("mxfp4", BF16, 25), ("mxfp8", BF16, 24)])
def test_fused_layer_launches_the_formats_kernels(fake, fmt, act, code):
    cupy, driver = fake
    b13, b2 = FakeArray((E, 2 * INTER), act), FakeArray((E, HID), act)
    w13 = fake_stack(fmt, HID, 2 * INTER, act, bias=b13)
    w2 = fake_stack(fmt, INTER, HID, act, bias=b2)
    args = dict(hidden=FakeArray((3, HID), act), w13_stack=w13, w2_stack=w2,
                topk_weights=FakeArray((3, 2), np.float32), topk_ids=FakeArray((3, 2), np.int32),
                activation=GPT_OSS)
    for call in ("checked", "planned"):
        driver.launches.clear()
        moe.fused_moe(**args)
        names = launch_names(driver)
        assert [n.split("<")[0] for n, _ in names] == ["mwb::moe_align", "mwb::marlin_moe", "mwb::swiglu_oai_and_mul",
                                                       "mwb::marlin_moe", "mwb::moe_sum"], call
        for (name, rec), stack, bias in ((names[1], w13, b13), (names[3], w2, b2)):
            assert name.split("<")[1].split(",")[1].strip() == str(code), name
            params = rec[-1]
            zero_slot = params[4]
            assert zero_slot == (0 if stack.global_scale is None else stack.global_scale.data.ptr), call
            assert params[9] == bias.data.ptr, "the stack's bias rows"
        act_params = names[2][1][-1]
        assert tuple(act_params[4:6]) == GPT_OSS.kernel_args, "alpha and limit as float32 bits"
    assert len(w13._fused_plans) == 1


def test_silu_layer_keeps_silu_and_changing_the_activation_gets_a_fresh_plan(fake):
    cupy, driver = fake
    w13, w2 = fake_stack("mxfp4", HID, 2 * INTER, BF16), fake_stack("mxfp4", INTER, HID, BF16)
    args = dict(hidden=FakeArray((2, HID), BF16), w13_stack=w13, w2_stack=w2,
                topk_weights=FakeArray((2, 2), np.float32), topk_ids=FakeArray((2, 2), np.int32))
    moe.fused_moe(**args)
    assert "silu_and_mul" in launch_names(driver)[2][0]
    moe.fused_moe(**args, activation=Activation("swigluoai", 1.702, 5.0))
    assert len(w13._fused_plans) == 2


# ---- gpt-oss: the de-interleave and the whole expert block in NumPy -------------------------------------------
def test_gate_up_permutation_is_the_deinterleave():
    perm = moe.gate_up_permutation(8)
    assert perm.tolist() == [0, 2, 4, 6, 1, 3, 5, 7]
    assert np.array_equal(np.argsort(perm)[perm], np.arange(8))
    h = np.random.default_rng(0).standard_normal((5, 8)) * 6
    assert np.allclose(GPT_OSS.reference(h[:, perm]), gpt_oss.swiglu_oai(h), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="7 rows"):
        moe.gate_up_permutation(7)


def gpt_oss_tensors(rng, e=4, hidden=128, inter=64):
    """Random gpt-oss expert tensors (blocks, scales, biases) with weights of a size that lets the clamp act."""
    def stack(n, k):
        blocks = rng.integers(0, 256, size=(e, n, k // 32, 16), dtype=np.uint8)
        scales = (rng.integers(-1, 2, size=(e, n, k // 32)) + 127 - 3).astype(np.uint8)
        return blocks, scales
    gu, gu_s = stack(2 * inter, hidden)
    dn, dn_s = stack(hidden, inter)
    return dict(gate_up_blocks=gu, gate_up_scales=gu_s,
                gate_up_bias=(rng.standard_normal((e, 2 * inter)) * 0.5).astype(BF16).astype(np.float32),
                down_blocks=dn, down_scales=dn_s,
                down_bias=(rng.standard_normal((e, hidden)) * 0.5).astype(BF16).astype(np.float32))


def test_gpt_oss_stacks_are_the_deinterleaved_checkpoint(rng):
    t = gpt_oss_tensors(rng)
    w13, b13, w2, b2 = moe.gpt_oss_expert_weights(**t)
    e, n2, g, _ = t["gate_up_blocks"].shape
    k = g * 32
    perm = moe.gate_up_permutation(n2)
    assert w13.weight_type is S.FE2M1F and w13.group_size == 32 and w13.num_experts == e
    for i in range(e):
        packed = ops.marlin_to_fp4(w13.qweight[i], k, n2, backend="numpy")
        assert np.array_equal(packed, t["gate_up_blocks"][i].reshape(n2, k // 2)[perm])
        codes = ops.marlin_to_mx_scales(w13.scales[i], k, n2, "mxfp4", backend="numpy")
        assert np.array_equal(np.asarray(codes).view(np.uint8), t["gate_up_scales"][i][perm])
        assert np.array_equal(b13[i].astype(np.float32), t["gate_up_bias"][i][perm])
    assert np.array_equal(b2.astype(np.float32), t["down_bias"])
    # a stack's bias rows must be contiguous: the column-permuted copy is made so (NumPy's fancy index is not)
    assert b13.flags["C_CONTIGUOUS"] and b2.flags["C_CONTIGUOUS"]


def test_gpt_oss_block_on_the_marlin_stacks_matches_the_reference(rng):
    """The whole block in NumPy on the stacks' exact weights (the de-interleaved gate_up, the clamped SwiGLU on
    gate | up, the biases, top-k softmax routing) against workbench.formats.gpt_oss.moe_forward (float64, interleaved):
    moe_reference rounds to bf16 where the kernels write activations, so it agrees within moe_error_bound, the
    bound the GPU tests use."""
    t = gpt_oss_tensors(rng)
    e, hidden, top_k = 4, 128, 2
    w_gu = gpt_oss.dequantize_stack(t["gate_up_blocks"], t["gate_up_scales"])  # [E, 2I, H] interleaved
    w_dn = gpt_oss.dequantize_stack(t["down_blocks"], t["down_scales"])
    x = rng.standard_normal((9, hidden)).astype(BF16)
    router_w, router_b = rng.standard_normal((e, hidden)), rng.standard_normal(e)
    want = gpt_oss.moe_forward(x.astype(np.float64), router_w, router_b, w_gu, t["gate_up_bias"], w_dn,
                               t["down_bias"], top_k)
    weights, ids = gpt_oss.route(x.astype(np.float64) @ router_w.T + router_b, top_k)
    perm = moe.gate_up_permutation(w_gu.shape[1])
    w13_ref = np.transpose(w_gu[:, perm], (0, 2, 1))  # [E, H, 2I] gates then ups
    w2_ref = np.transpose(w_dn, (0, 2, 1))
    h = np.einsum("th,ehn->etn", x.astype(np.float64), w13_ref) + t["gate_up_bias"][:, perm][:, None]
    assert (np.abs(h) > 7).any(), "the clamp must act in this test"
    kw = dict(act_dtype=BF16, w13_bias=t["gate_up_bias"][:, perm], w2_bias=t["down_bias"], activation=GPT_OSS)
    got = moe.moe_reference(x, w13_ref, w2_ref, weights.astype(np.float32), ids, **kw)
    bound = moe.moe_error_bound(x, w13_ref, w2_ref, weights.astype(np.float32), ids, **kw)
    err = np.abs(got.astype(np.float64) - want)
    assert (err <= bound).all(), float((err / bound).max())


def test_a_loaded_interleaved_stack_is_deinterleaved_or_refused(fake, rng):
    """workbench.load keeps gpt-oss's interleaved order (its manifest says so): deinterleave_marlin_stack permutes a
    loaded stack's rows once (the stack built from the raw tensors, bit for bit), and fused_moe refuses a stack still
    marked interleaved."""
    import dataclasses

    from workbench.checkpoint.microscale import MicroscaleMarlinWeight

    t = gpt_oss_tensors(rng)
    e, n2, g, _ = t["gate_up_blocks"].shape
    k = g * 32
    raw, _, _ = moe.microscale_expert_stack("mxfp4", t["gate_up_blocks"].reshape(e, n2, k // 2),
                                            t["gate_up_scales"], None, k, n2, BF16, ref_dtype=None)
    loaded = MicroscaleMarlinWeight(**{f.name: getattr(raw, f.name) for f in dataclasses.fields(raw)},
                                    microscale="mxfp4", gate_up="interleaved")
    fixed = moe.gpt_oss.deinterleave_marlin_stack(loaded)
    w13, _, _, _ = moe.gpt_oss_expert_weights(**t)
    assert np.array_equal(fixed.qweight, w13.qweight) and np.array_equal(fixed.scales, w13.scales)
    assert fixed.gate_up == ""
    fake_loaded = MicroscaleMarlinWeight(**{f.name: getattr(fake_weight(HID, 2 * INTER, S.FE2M1F, BF16, 32), f.name)
                                            for f in dataclasses.fields(MarlinWeight)},
                                         microscale="mxfp4", gate_up="interleaved")
    w13s, w2s = moe.MarlinExpertStack(fake_loaded), fake_stack("mxfp4", INTER, HID, BF16)
    with pytest.raises(ValueError, match="deinterleave_marlin_stack"):
        moe.fused_moe(FakeArray((2, HID), BF16), w13s, w2s, FakeArray((2, 2), np.float32),
                      FakeArray((2, 2), np.int32))
