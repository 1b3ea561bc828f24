"""MarlinLinear, MarlinMoE and replace_linears without a GPU: construction (from a MarlinWeight, quantized on the fly),
buffers bit for bit against the reference, state_dict round trips, .to(device), replace_linears on a small torch
model, forward refusing CPU input, and the forward's shapes through the fakes (meta tensors), also compiled."""
import io

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install '.[test]' pins the CPU wheel)")
from torch import nn  # noqa: E402

import workbench.torch as wt  # noqa: E402
from workbench import ops as wb  # noqa: E402
from workbench.moe import random_expert_stack  # noqa: E402
from workbench.quantize import quantize_weights  # noqa: E402
from workbench.scalar_types import ScalarType as S  # noqa: E402
from workbench.weight import random_marlin_weight  # noqa: E402

FIELDS = ("qweight", "scales", "zeros", "g_idx", "perm")


def same_bits(t: torch.Tensor, a) -> bool:
    """Exact equality of a buffer and a NumPy array, compared as raw bytes (bf16 scales included)."""
    a = np.ascontiguousarray(a)
    return tuple(t.shape) == a.shape and t.contiguous().view(torch.uint8).numpy().tobytes() == a.tobytes()


def assert_buffers_equal(module, weight, prefix=""):
    for f in FIELDS:
        ref, got = getattr(weight, f), getattr(module, prefix + f)
        assert (ref is None) == (got is None), f
        if ref is not None:
            assert same_bits(got, ref), f


@pytest.mark.parametrize("wt_type,group,act_order", [(S.U4B8, 128, False), (S.U4, 64, False), (S.U8B128, -1, False),
                                                     (S.U4B8, 128, True), (S.FE4M3FN, 128, False)])
@pytest.mark.parametrize("act", [np.float16, "bfloat16"])
def test_from_weight_holds_the_weight_bit_for_bit(wt_type, group, act_order, act):
    import ml_dtypes

    act = np.dtype(ml_dtypes.bfloat16) if act == "bfloat16" else np.dtype(act)
    w, _ = random_marlin_weight(256, 128, wt_type, group, act_order=act_order, act_dtype=act, seed=3)
    m = wt.MarlinLinear.from_weight(w)
    assert_buffers_equal(m, w)
    back = m.marlin_weight()
    assert (back.size_k, back.size_n, back.group_size, back.weight_type, back.act_dtype) == \
        (w.size_k, w.size_n, w.group_size, w.weight_type, w.act_dtype)
    assert m.scales.dtype == (torch.bfloat16 if act != np.float16 else torch.float16)


def test_from_weight_copies_and_does_not_mutate():
    w, _ = random_marlin_weight(256, 128, S.U4B8, 128, seed=1)
    before = w.qweight.copy()
    m = wt.MarlinLinear.from_weight(w)
    m.qweight.zero_()
    assert np.array_equal(w.qweight, before)


def test_from_weight_refuses_stacks_and_bad_bias():
    stack, _ = random_expert_stack(2, 256, 128, S.U4B8, 128)
    with pytest.raises(ValueError, match="stack of 2 experts"):
        wt.MarlinLinear.from_weight(stack)
    w, _ = random_marlin_weight(256, 128, S.U4B8, 128)
    with pytest.raises(ValueError, match=r"bias has shape \(64,\), expected \(128,\)"):
        wt.MarlinLinear.from_weight(w, torch.zeros(64))


def test_from_linear_quantizes_with_the_reference_quantizer():
    torch.manual_seed(0)
    lin = nn.Linear(256, 128).half()
    m = wt.MarlinLinear.from_linear(lin, "u4", 64)
    q = quantize_weights(lin.weight.detach().float().numpy().T, "u4", 64, act_dtype=np.float16)
    codes = wb.marlin_to_codes(m.qweight.numpy(), 256, 128, 4)
    assert np.array_equal(codes, q.codes)
    assert same_bits(m.scales, wb.marlin_permute_scales(q.scales, 256, 128, 64, backend="numpy"))
    assert torch.equal(m.bias, lin.bias.detach())
    assert m.scales.dtype == torch.float16 and m.bias.dtype == torch.float16


@pytest.mark.parametrize("wt_type,group,act_order", [(S.U4B8, 128, False), (S.U4, 128, True), (S.FE4M3FN, -1, False)])
def test_state_dict_round_trip_is_bit_exact(wt_type, group, act_order):
    w, _ = random_marlin_weight(256, 192, wt_type, group, act_order=act_order, seed=7)
    bias = torch.randn(192).half()
    m = wt.MarlinLinear.from_weight(w, bias)
    buf = io.BytesIO()
    torch.save(m.state_dict(), buf)
    buf.seek(0)
    fresh = wt.MarlinLinear(256, 192, wt_type, group, bias=True, act_order=act_order)
    fresh.load_state_dict(torch.load(buf))
    assert_buffers_equal(fresh, w)
    assert torch.equal(fresh.bias, bias)
    assert "workspace" not in m.state_dict()  # scratch, not state


def test_loading_another_layout_says_which_parameter_differs():
    w, _ = random_marlin_weight(256, 128, S.U4B8, 128)
    sd = wt.MarlinLinear.from_weight(w).state_dict()
    other = wt.MarlinLinear(256, 128, "u8b128", 128)
    with pytest.raises(ValueError, match=r"weight_type = 'u4b8', this module 'u8b128'"):
        other.load_state_dict(sd)


def test_to_device_moves_every_buffer_and_keeps_dtypes():
    w, _ = random_marlin_weight(256, 128, S.U4, 128, act_order=True)
    m = wt.MarlinLinear.from_weight(w, torch.zeros(128)).to("meta")
    names = [n for n, _ in m.named_buffers()]
    assert {"qweight", "scales", "zeros", "g_idx", "perm", "bias", "workspace"} <= set(names)
    assert all(b.device.type == "meta" for b in m.buffers())
    assert (m.qweight.dtype, m.scales.dtype, m.workspace.dtype) == (torch.int32, torch.float16, torch.int32)


def test_forward_on_cpu_needs_a_cuda_device():
    w, _ = random_marlin_weight(256, 128, S.U4B8, 128)
    with pytest.raises(RuntimeError, match=r"MarlinLinear.forward needs a CUDA device.*input is on cpu"):
        wt.MarlinLinear.from_weight(w)(torch.randn(2, 256).half())


def compiles_once_with_symbolic_m(m, rows=(3, 9, 40)) -> None:
    """A meta MarlinLinear compiled with fullgraph=True, dynamic=True gives (M, out_features) for every M in
    ``rows`` from one frame (the fake's shapes; no recompile per batch size)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()  # (every layer compiles MarlinLinear.forward anew: keep under Dynamo's recompile limit)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(m, backend=counter, fullgraph=True, dynamic=True)
    for r in rows:
        out = compiled(torch.empty((r, m.in_features), dtype=torch.float16, device="meta"))
        assert tuple(out.shape) == (r, m.out_features)
    assert counter.frame_count == 1


def test_forward_shapes_through_the_fake_and_compiled_with_symbolic_m():
    w, _ = random_marlin_weight(256, 128, S.U4B8, 128)
    m = wt.MarlinLinear.from_weight(w, torch.zeros(128)).to("meta")
    assert tuple(m(torch.empty((2, 3, 256), dtype=torch.float16, device="meta")).shape) == (2, 3, 128)
    compiles_once_with_symbolic_m(m)
    with pytest.raises(ValueError, match=r"x has 128 features .* in_features = 256"):
        m(torch.empty((2, 128), dtype=torch.float16, device="meta"))


# ---------------------------------------------------------------------------------------------------------------
# shapes that are not tile multiples (docs/formats.md): padded buffers, the true sizes in the extra state
# ---------------------------------------------------------------------------------------------------------------
ODD = [(200, 100, S.U4B8, 128, False), (200, 100, S.U4, 64, False), (40, 96, S.U8B128, -1, False),
       (312, 72, S.U4B8, 128, True), (200, 100, S.FE4M3FN, 128, False), (264, 136, S.U8B128, 32, True),
       (36, 100, S.U8B128, 32, False)]  # (the last: an 8-bit K that ends inside a 16-byte chunk of fp16 rows)


@pytest.mark.parametrize("k,n,wt_type,group,act_order", ODD)
def test_odd_shape_from_linear_buffers_are_the_formats_padded_arrays(k, n, wt_type, group, act_order):
    """The buffers of an odd-shaped layer quantized on the fly are the formats' padded Marlin arrays of the
    reference quantizer's result, byte for byte; the inverses with the true sizes give the quantizer's codes and
    scales back, so the padding holds nothing of the weight."""
    from workbench.weight import make_marlin_weight

    torch.manual_seed(k + n)
    lin = nn.Linear(k, n).half()
    m = wt.MarlinLinear.from_linear(lin, wt_type, group, act_order=act_order, seed=4)
    q = quantize_weights(lin.weight.detach().float().numpy().T, wt_type, group, act_order=act_order,
                         act_dtype=np.float16, seed=4)
    ref = make_marlin_weight(q)
    ref.require_padded_arrays()
    assert_buffers_equal(m, ref)
    kp, np_ = -(-k // 16) * 16, -(-n // 64) * 64
    pf = wt_type.pack_factor
    assert tuple(m.qweight.shape) == (kp // 16, np_ * 16 // pf)
    assert tuple(m.scales.shape) == ((1 if group == -1 else -(-k // group)), np_)
    assert (m.in_features, m.out_features) == (k, n) and tuple(m.bias.shape) == (n,)
    back = m.marlin_weight()
    back.require_padded_arrays()
    assert (back.size_k, back.size_n, back.group_size) == (k, n, group)
    if not act_order:  # (act-order codes are in the permuted row order; the reference compare above covers them)
        assert np.array_equal(wb.marlin_to_codes(m.qweight.numpy(), k, n, wt_type.bits), q.codes)
    if wt_type is not S.FE4M3FN:
        back_scales = wb.marlin_unpermute_scales(m.scales.numpy(), k, n, group, backend="numpy")
        want = np.asarray(q.scales, np.float16)
        assert back_scales.shape == want.shape and back_scales.tobytes() == want.tobytes()


@pytest.mark.parametrize("k,n,wt_type,group,act_order", ODD)
def test_odd_shape_state_dict_round_trip_is_bit_exact(k, n, wt_type, group, act_order):
    w, _ = random_marlin_weight(k, n, wt_type, group, act_order=act_order, seed=11)
    w.require_padded_arrays()
    bias = torch.randn(n).half()
    m = wt.MarlinLinear.from_weight(w, bias)
    assert_buffers_equal(m, w)
    buf = io.BytesIO()
    torch.save(m.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf)
    state = sd["_extra_state"][""]
    assert (state["size_k"], state["size_n"], state["group_size"]) == (k, n, group)  # the true sizes travel
    fresh = wt.MarlinLinear(k, n, wt_type, group, bias=True, act_order=act_order)
    fresh.load_state_dict(sd)
    assert_buffers_equal(fresh, w)
    assert torch.equal(fresh.bias, bias)


def test_equal_padded_buffers_of_another_true_size_are_refused_by_name():
    """N = 100 and N = 120 both pad to 128 columns (and K = 200, 208 to 13 tile rows): the buffers alone would load,
    the extra state's true sizes refuse them."""
    w, _ = random_marlin_weight(200, 100, S.U4B8, 128)
    sd = wt.MarlinLinear.from_weight(w).state_dict()
    for k, n, name, got in ((200, 120, "size_n", 100), (208, 100, "size_k", 200)):
        other = wt.MarlinLinear(k, n, "u4b8", 128)
        assert all(other.state_dict()[f].shape == sd[f].shape for f in ("qweight", "scales"))
        with pytest.raises(ValueError, match=rf"has {name} = {got}, this module {k if name == 'size_k' else n}"):
            other.load_state_dict(sd)


def test_odd_shape_weights_of_the_wrong_padding_are_refused_by_name():
    w, _ = random_marlin_weight(200, 100, S.U4B8, 128)
    import dataclasses

    unpadded = dataclasses.replace(w, scales=np.ascontiguousarray(w.scales[:, :100]))
    with pytest.raises(ValueError, match=r"scales has shape \(2, 100\) and dtype torch.float16, expected \(2, 128\)"):
        wt.MarlinLinear.from_weight(unpadded)


def test_odd_shape_forward_shapes_through_the_fake_and_compiled():
    w, _ = random_marlin_weight(200, 100, S.U4, 64)
    m = wt.MarlinLinear.from_weight(w, torch.zeros(100)).to("meta")
    assert tuple(m(torch.empty((2, 3, 200), dtype=torch.float16, device="meta")).shape) == (2, 3, 100)
    compiles_once_with_symbolic_m(m, (3, 9))


def test_an_8bit_k_inside_a_16_byte_chunk_reaches_the_gemm_as_padded_rows():
    """K = 36 (8-bit: a multiple of the pack factor 4, not of the 8 fp16 values of a 16-byte chunk): forward hands
    the op a view of rows padded to 40, which the GEMM's stride rule takes; traced with a symbolic M."""
    w, _ = random_marlin_weight(36, 100, S.U8B128, 32)
    m = wt.MarlinLinear.from_weight(w).to("meta")
    compiles_once_with_symbolic_m(m, (3, 9))
    a = torch.empty((5, 36), dtype=torch.float16, device="meta")  # the contiguous rows themselves: refused by name
    args = [a, None, m.qweight, None, m.scales, None, None, None, None, None, m.workspace, wt.vllm_id(S.U8B128), 5,
            100, 36, True, False, True, False]
    with pytest.raises(ValueError, match=r"A.stride\(0\) = 36 must be >= size_k = 36 and divisible by 8"):
        wt.marlin_gemm(*args)


# ---------------------------------------------------------------------------------------------------------------
# the GEMM's modes: deterministic, batch_invariant
# ---------------------------------------------------------------------------------------------------------------
def gemm_calls(counter):
    return [n for g in counter.graphs for n in g.graph.nodes if "marlin_gemm" in str(n.target)]


@pytest.mark.parametrize("modes", [{}, {"batch_invariant": True}, {"deterministic": True},
                                   {"deterministic": True, "batch_invariant": True}])
def test_modes_reach_the_op_in_the_traced_graph_and_stay_out_of_the_state_dict(modes):
    from torch._dynamo.testing import CompileCounterWithBackend

    w, _ = random_marlin_weight(256, 128, S.U4B8, 128)
    sd = wt.MarlinLinear.from_weight(w, **modes).state_dict()
    m = wt.MarlinLinear.from_weight(w, **modes).to("meta")
    assert all(getattr(m, f) is modes.get(f, False) for f in ("deterministic", "batch_invariant"))
    torch._dynamo.reset()  # (every layer compiles MarlinLinear.forward anew: keep under Dynamo's recompile limit)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(m, backend=counter, fullgraph=True, dynamic=True)
    for rows in (3, 9):
        assert tuple(compiled(torch.empty((rows, 256), dtype=torch.float16, device="meta")).shape) == (rows, 128)
    assert counter.frame_count == 1
    calls = gemm_calls(counter)
    assert calls and all(n.kwargs == modes for n in calls), [n.kwargs for n in calls]
    assert all(f"{f}=True" in repr(m) for f in modes)
    plain = wt.MarlinLinear(256, 128)
    plain.load_state_dict(sd)  # a mode is how the layer runs, not what it stores
    assert not plain.batch_invariant and not plain.deterministic


def test_modes_through_the_constructor_from_linear_and_replace_linears():
    m = wt.MarlinLinear(256, 128, batch_invariant=True)
    assert m.batch_invariant and not m.deterministic
    assert wt.MarlinLinear.from_linear(nn.Linear(256, 128), deterministic=True).deterministic
    model = nn.Sequential(nn.Linear(256, 128), nn.Linear(128, 64))
    w, _ = random_marlin_weight(256, 128, S.U4B8, 128)
    report = wt.replace_linears(model, "*", weights={"0": w}, batch_invariant=True)
    assert report.replaced == ["0", "1"]
    assert all(layer.batch_invariant and not layer.deterministic for layer in model)


def test_a_layer_switched_to_batch_invariant_after_tracing_recompiles():
    """The mode is read at trace time (a guarded attribute): switching it gives a new graph with the new flag, not
    a stale one."""
    from torch._dynamo.testing import CompileCounterWithBackend

    w, _ = random_marlin_weight(256, 128, S.U4B8, 128)
    m = wt.MarlinLinear.from_weight(w).to("meta")
    torch._dynamo.reset()  # (every layer compiles MarlinLinear.forward anew: keep under Dynamo's recompile limit)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(m, backend=counter, fullgraph=True)
    x = torch.empty((4, 256), dtype=torch.float16, device="meta")
    compiled(x)
    m.batch_invariant = True
    compiled(x)
    assert counter.frame_count == 2
    assert [n.kwargs for n in gemm_calls(counter)] == [{}, {"batch_invariant": True}]


# ---------------------------------------------------------------------------------------------------------------
# replace_linears
# ---------------------------------------------------------------------------------------------------------------
class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.ModuleDict({"q_proj": nn.Linear(256, 128), "k_proj": nn.Linear(256, 128, bias=False),
                                      "odd": nn.Linear(256, 96), "short": nn.Linear(40, 64),
                                      "unpacked": nn.Linear(36, 64)})
        self.head = nn.Linear(128, 64)
        self.norm = nn.LayerNorm(128)


def test_replace_linears_swaps_what_it_can_and_says_why_not():
    torch.manual_seed(1)
    model = Tiny().half()
    original_q = model.encoder.q_proj.weight.detach().clone()
    report = wt.replace_linears(model, ["encoder.*", "head", "missing.*"], "u4b8", 128)
    # N = 96 (not a multiple of 64) and K = 40 (not of 16; one partial group of 128) are layers now: padded buffers
    assert report.replaced == ["encoder.q_proj", "encoder.k_proj", "encoder.odd", "encoder.short", "head"]
    assert report.skipped == {  # the dense GEMM's own shape rules, on the buffers the layer would have
        "encoder.unpacked": "K x N = 36 x 64: size_k = 36 is not a multiple of the pack factor 8 of u4b8 weights "
                            "(GPTQ rows pack 8 codes per int32 word)"}
    assert report.unmatched_patterns == ["missing.*"]
    assert isinstance(model.encoder.q_proj, wt.MarlinLinear) and isinstance(model.encoder.unpacked, nn.Linear)
    assert (model.encoder.odd.out_features, tuple(model.encoder.odd.scales.shape)) == (96, (2, 128))
    assert model.encoder.k_proj.bias is None and model.encoder.q_proj.bias is not None
    q = quantize_weights(original_q.float().numpy().T, "u4b8", 128, act_dtype=np.float16)
    assert np.array_equal(wb.marlin_to_codes(model.encoder.q_proj.qweight.numpy(), 256, 128, 4), q.codes)
    assert "replaced 5 nn.Linear layers" in str(report) and "skipped encoder.unpacked" in str(report)


def test_replace_linears_group_size_reason_and_exclude():
    model = nn.Sequential(nn.Linear(192, 64), nn.Linear(512, 64), nn.Linear(256, 64))
    report = wt.replace_linears(model, "*", "u4b8", 256, exclude="2")
    # 512 rows: two groups of a size the GEMM has no kernel for; 192 rows: one partial group, which the GEMM would
    # run as channelwise, but the quantizer takes no such group size
    assert report.replaced == []
    assert report.skipped == {
        "0": "K x N = 192 x 64: group_size = 256 is not one of the reference quantizer's (-1, 32, 64, 128)",
        "1": "K x N = 512 x 64: group size = size_k / num_groups = 512 / 2 = 256 is not one of (32, 64, 128) (or "
             "channelwise)"}
    model = nn.Sequential(nn.Linear(192, 64), nn.Linear(512, 64), nn.Linear(256, 64))
    report = wt.replace_linears(model, "*", "u4b8", 128, exclude="2")
    assert report.replaced == ["0", "1"] and not report.skipped  # 192 = 128 + a partial group of 64
    assert tuple(model[0].scales.shape) == (2, 64)
    assert isinstance(model[2], nn.Linear)


def test_replace_linears_takes_loaded_weights_by_name():
    model = nn.Sequential(nn.Linear(256, 128), nn.Linear(128, 64))
    bias = model[0].bias.detach().half().clone()
    w, _ = random_marlin_weight(256, 128, S.U4, 64, seed=5)
    wrong, _ = random_marlin_weight(256, 64, S.U4, 64)
    report = wt.replace_linears(model, "*", weights={"0": w, "1": wrong})
    assert report.replaced == ["0"] and "the given weight is K x N = 256 x 64" in report.skipped["1"]
    assert_buffers_equal(model[0], w)
    assert torch.equal(model[0].bias, bias)


@pytest.mark.parametrize("k,n,wt_type,group,why", [
    (512, 128, "u4b8", 256, "group size = size_k / num_groups = 512 / 2 = 256 is not one of (32, 64, 128)"),
    (256, 128, "fe4m3fn", 64, "fe4m3fn weights take channelwise or group-128 scales, got group size 64")])
def test_unsupported_shapes_say_why(k, n, wt_type, group, why):
    assert why in wt.quantizable(nn.Linear(k, n), wt_type, group)
    assert wt.quantizable(nn.Linear(256, 128), "u4", 32) is None


def test_replace_linears_skips_unmaterialized_layers():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(256, 128))
    assert wt.replace_linears(model).skipped == {"0": "its weight is on the meta device (not materialized)"}


# ---------------------------------------------------------------------------------------------------------------
# MarlinMoE
# ---------------------------------------------------------------------------------------------------------------
def dense_experts(e=4, h=256, i=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(e, i, h, generator=g) * 0.1, torch.randn(e, i, h, generator=g) * 0.1,
            torch.randn(e, h, i, generator=g) * 0.1)


def test_moe_quantize_stacks_gate_and_up_columns_first():
    gate, up, down = dense_experts()
    moe = wt.MarlinMoE.quantize(gate, up, down, 2, "u4b8", 128)
    assert tuple(moe.w13_qweight.shape) == (4, 256 // 16, 256 * 16 // 8)
    assert tuple(moe.w2_qweight.shape) == (4, 128 // 16, 256 * 16 // 8)
    both = np.concatenate([gate[1].numpy().T, up[1].numpy().T], axis=1)
    q = quantize_weights(both, "u4b8", 128, act_dtype=np.float16, seed=1)
    assert np.array_equal(wb.marlin_to_codes(moe.w13_qweight[1].numpy(), 256, 256, 4), q.codes)


def test_moe_state_dict_round_trip_and_from_weights():
    w13, _ = random_expert_stack(3, 256, 256, S.U4, 128, seed=2)
    w2, _ = random_expert_stack(3, 128, 256, S.U4, 128, seed=3)
    moe = wt.MarlinMoE.from_weights(w13, w2, top_k=2)
    assert_buffers_equal(moe, w13, "w13_")
    assert_buffers_equal(moe, w2, "w2_")
    fresh = wt.MarlinMoE(3, 256, 128, 2, "u4", 128)
    fresh.load_state_dict(moe.state_dict())
    assert_buffers_equal(fresh, w13, "w13_")
    assert_buffers_equal(fresh, w2, "w2_")  # (both: assert_buffers_equal returns None, so no `and`)
    with pytest.raises(ValueError, match="do not form one layer"):
        wt.MarlinMoE.from_weights(w13, w13, top_k=2)


def test_moe_on_shapes_that_are_not_tile_multiples_holds_the_padded_stacks():
    """hidden 264 (K of w13: 16.5 k16 tiles, groups 128 + 128 + 8; N of w2), intermediate 136 (N of w13: 272
    columns, K of w2: groups 128 + 8): padded stacks bit for bit, a state-dict round trip, the forward's shapes on
    meta tensors (the MoE op reads the group size from the group count with a partial last group)."""
    h, i = 264, 136
    w13, _ = random_expert_stack(3, h, 2 * i, S.U4B8, 128, seed=4)
    w2, _ = random_expert_stack(3, i, h, S.U4B8, 128, seed=5)
    moe = wt.MarlinMoE.from_weights(w13, w2, top_k=2)
    assert_buffers_equal(moe, w13, "w13_")
    assert_buffers_equal(moe, w2, "w2_")
    assert tuple(moe.w13_scales.shape) == (3, 3, 320) and tuple(moe.w2_scales.shape) == (3, 2, 320)
    fresh = wt.MarlinMoE(3, h, i, 2, "u4b8", 128)
    fresh.load_state_dict(moe.state_dict())
    assert_buffers_equal(fresh, w13, "w13_")
    assert_buffers_equal(fresh, w2, "w2_")
    out = moe.to("meta")(torch.empty((5, h), dtype=torch.float16, device="meta"), torch.empty((5, 3), device="meta"))
    assert tuple(out.shape) == (5, h)


def test_moe_forward_on_cpu_needs_cuda_and_shapes_on_meta():
    gate, up, down = dense_experts()
    router = nn.Linear(256, 4, bias=False).half()
    moe = wt.MarlinMoE.quantize(gate, up, down, 2, router=router)
    with pytest.raises(RuntimeError, match="MarlinMoE.forward needs a CUDA device"):
        moe(torch.randn(3, 256).half())
    moe = moe.to("meta")
    out = moe(torch.empty((5, 256), dtype=torch.float16, device="meta"))
    assert tuple(out.shape) == (5, 256) and out.dtype == torch.float16


def test_moe_routing_renormalizes():
    moe = wt.MarlinMoE(4, 256, 128, 2)
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    weights, ids = moe.route(logits)
    assert ids.tolist() == [[3, 2]] and ids.dtype == torch.int32
    assert torch.allclose(weights.sum(-1), torch.ones(1))  # renormalized over the chosen experts: sums to 1 (fp32)


def test_moe_compiles_once_per_block_size_not_per_batch_size():
    """The MoE block size is chosen from M (moe.choose_block_size): one graph per block size, not per M."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from workbench.moe import choose_block_size

    moe = wt.MarlinMoE.quantize(*dense_experts(), top_k=2).to("meta")
    torch._dynamo.reset()  # (every layer compiles MarlinLinear.forward anew: keep under Dynamo's recompile limit)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(moe, backend=counter, fullgraph=True, dynamic=True)
    rows = (3, 5, 9, 40, 50)
    for m in rows:
        out = compiled(torch.empty((m, 256), dtype=torch.float16, device="meta"), torch.empty((m, 4), device="meta"))
        assert tuple(out.shape) == (m, 256)
    assert counter.frame_count == len({choose_block_size(m, 2, 4) for m in rows}) == 2


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_moe_batch_invariant_reaches_both_gemms_in_the_traced_graph(batch_invariant):
    from torch._dynamo.testing import CompileCounterWithBackend

    moe = wt.MarlinMoE.quantize(*dense_experts(), top_k=2, batch_invariant=batch_invariant).to("meta")
    assert moe.batch_invariant is batch_invariant and ("batch_invariant=True" in repr(moe)) is batch_invariant
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    out = torch.compile(moe, backend=counter, fullgraph=True)(torch.empty((5, 256), dtype=torch.float16,
                                                                          device="meta"),
                                                              torch.empty((5, 4), device="meta"))
    assert tuple(out.shape) == (5, 256)
    calls = [n for g in counter.graphs for n in g.graph.nodes if "moe_wna16_marlin_gemm" in str(n.target)]
    assert len(calls) == 2
    assert all(n.kwargs == ({"batch_invariant": True} if batch_invariant else {}) for n in calls), \
        [n.kwargs for n in calls]


def test_llama_shaped_decoder_of_marlin_linears_traces_to_one_graph():
    """The bench's decoder (workbench.torch.models.Decoder, one layer; GQA, RoPE, a static KV cache written in
    place), every nn.Linear a MarlinLinear, compiled whole with fullgraph=True on meta tensors: the GEMM's fake and
    schema let Dynamo and AOTAutograd trace every layer into one graph (no graph break, which fullgraph turns into
    an error)."""
    import torch._dynamo

    from workbench.torch import models

    c = dict(models.DECODER_CONFIG, num_hidden_layers=1, vocab_size=256)
    model = models.decoder(c).half().eval()
    report = wt.replace_linears(model, "*", "u4b8", 128)
    assert len(report.replaced) == 8 and not report.skipped
    model = model.to("meta")
    cache = model.new_cache(1, 32, torch.float16, "meta")
    tok = torch.zeros((1, 1), dtype=torch.long, device="meta")
    pos = torch.zeros(1, dtype=torch.long, device="meta")
    torch._dynamo.reset()
    with torch.no_grad():
        explained = torch._dynamo.explain(model)(tok, pos, cache)
        assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons
        gemms = [n for g in explained.graphs for n in g.graph.nodes if "marlin_gemm" in str(n.target)]
        assert len(gemms) == 8
        logits = torch.compile(model, fullgraph=True, backend="aot_eager")(tok, pos, cache)
    assert logits.shape == (1, 1, c["vocab_size"]) and logits.dtype == torch.float32


def test_models_swap_linears_gives_marlin_layers_and_an_fp16_copy_of_the_same_dequantized_weights():
    """workbench.torch.models.swap_linears (the tests' and bench_torch's one swap): every nn.Linear of the decoder
    becomes a MarlinLinear holding the reference quantizer's weight, the copy's nn.Linears hold exactly that weight
    dequantized (w_ref, in fp16), and the model it was given is left as it was."""
    from workbench.torch import models
    from workbench.weight import make_marlin_weight

    c = dict(models.DECODER_CONFIG, num_hidden_layers=1, vocab_size=256)
    model = models.decoder(c).half().eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ours, same, count = models.swap_linears(model, "u4b8", 128)
    assert count == 8
    for name, linear in model.named_modules():
        if isinstance(linear, nn.Linear):
            q = quantize_weights(linear.weight.detach().float().numpy().T, "u4b8", 128, act_dtype=np.float16)
            mine = ours.get_submodule(name)
            assert type(mine) is wt.MarlinLinear
            assert np.array_equal(mine.marlin_weight().qweight, make_marlin_weight(q).qweight)
            assert np.array_equal(same.get_submodule(name).weight.detach().numpy(), q.w_ref.T.astype(np.float16))
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_models_module_does_not_import_transformers():
    """bench_torch's GPU run imports workbench.torch.models where transformers may be missing."""
    import subprocess
    import sys

    code = "import sys, workbench.torch.models; assert 'transformers' not in sys.modules, 'imported transformers'"
    subprocess.run([sys.executable, "-c", code], check=True)
