"""The torch.library surface (workbench.torch) without a GPU: registration, vLLM's argument lists and type ids, the
layout ops on CPU tensors against workbench.ops (exact), opcheck, fakes on meta tensors, torch.compile with a
symbolic M, bad input, inference-only autograd.

The CUDA-only GEMMs are exercised here through their fakes (meta tensors: the Meta kernel of a registered fake is the
fake); their values are tests/gpu/test_torch_gpu.py's.
"""
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install '.[test]' pins the CPU wheel)")

import workbench.torch as wt  # noqa: E402  (registers torch.ops.workbench)
from workbench import ops as wb  # noqa: E402
from workbench.formats import moe_align as ma  # noqa: E402
from workbench.formats import packing  # noqa: E402
from workbench.scalar_types import ScalarType as S  # noqa: E402
from workbench.torch import scalar_ids  # noqa: E402
from workbench.torch._tensors import from_numpy  # noqa: E402

OPS = torch.ops.workbench
U4B8 = wt.vllm_id(S.U4B8)

# vLLM's argument lists at the pinned commit (csrc/torch_bindings.cpp; csrc/moe/torch_bindings.cpp via the
# vllm/_custom_ops.py wrapper that calls it positionally): a positional vLLM call must bind the same way here
VLLM_GEMM_ARGS = ["a", "c", "b_q_weight", "b_bias", "b_scales", "a_scales", "global_scale", "b_zeros", "g_idx", "perm",
                  "workspace", "b_q_type", "size_m", "size_n", "size_k", "is_k_full", "use_atomic_add",
                  "use_fp32_reduce", "is_zp_float"]
VLLM_MOE_ARGS = ["a", "c", "b_q_weight", "b_bias", "b_scales", "a_scales", "global_scale", "b_zeros", "g_idx", "perm",
                 "workspace", "sorted_token_ids", "expert_ids", "num_tokens_past_padded", "topk_weights",
                 "moe_block_size", "top_k", "mul_topk_weights", "b_q_type", "size_m", "size_n", "size_k", "is_k_full",
                 "use_atomic_add", "use_fp32_reduce", "is_zp_float", "thread_k", "thread_n", "blocks_per_sm"]
VLLM_REPACK_ARGS = {"gptq_marlin_repack": ["b_q_weight", "perm", "size_k", "size_n", "num_bits", "is_a_8bit"],
                    "awq_marlin_repack": ["b_q_weight", "size_k", "size_n", "num_bits", "is_a_8bit"],
                    "moe_align_block_size": ["topk_ids", "num_experts", "block_size", "sorted_token_ids",
                                             "experts_ids", "num_tokens_post_pad", "maybe_expert_map"]}
ALL_OPS = ["marlin_gemm", "marlin_gemm_out", "gptq_marlin_gemm", "gptq_marlin_gemm_out", "moe_wna16_marlin_gemm",
           "moe_wna16_marlin_gemm_out", "moe_align_block_size", "gptq_marlin_repack", "awq_marlin_repack",
           "marlin_permute_scales", "marlin_unpermute_scales", "marlin_zero_points", "awq_to_marlin_zero_points",
           "marlin_to_gptq_qweight", "marlin_to_awq_qweight"]


def arg_names(op):
    """The positional arguments (a positional vLLM call binds these); keyword-only ones are workbench's own."""
    return [a.name for a in getattr(OPS, op).default._schema.arguments if not a.kwarg_only]


def kwarg_only_names(op):
    return [a.name for a in getattr(OPS, op).default._schema.arguments if a.kwarg_only]


# ---------------------------------------------------------------------------------------------------------------
# registration and vLLM compatibility
# ---------------------------------------------------------------------------------------------------------------
def test_every_op_is_registered():
    assert all(hasattr(OPS, name) for name in ALL_OPS), [n for n in ALL_OPS if not hasattr(OPS, n)]


@pytest.mark.parametrize("op", ["marlin_gemm", "gptq_marlin_gemm", "marlin_gemm_out", "gptq_marlin_gemm_out"])
def test_gemm_takes_vllms_19_arguments_in_order(op):
    assert arg_names(op) == VLLM_GEMM_ARGS
    # workbench's modes come after them, by keyword only (off by default), so no positional call changes meaning
    assert kwarg_only_names(op) == ["deterministic", "batch_invariant"]
    schema = getattr(OPS, op).default._schema
    assert all(a.default_value is False for a in schema.arguments if a.kwarg_only)


def test_gemm_out_declares_that_it_writes_c_and_the_functional_op_writes_nothing():
    out = OPS.marlin_gemm_out.default._schema
    assert [a.name for a in out.arguments if a.alias_info is not None and a.alias_info.is_write] == ["c"]
    functional = OPS.marlin_gemm.default._schema.arguments
    assert not any(a.alias_info is not None and a.alias_info.is_write for a in functional)


@pytest.mark.parametrize("op", ["moe_wna16_marlin_gemm", "moe_wna16_marlin_gemm_out"])
def test_moe_gemm_takes_vllms_29_arguments_in_order(op):
    assert arg_names(op) == VLLM_MOE_ARGS
    assert kwarg_only_names(op) == ["batch_invariant"]


@pytest.mark.parametrize("op", sorted(VLLM_REPACK_ARGS))
def test_layout_and_align_ops_take_vllms_arguments(op):
    assert arg_names(op) == VLLM_REPACK_ARGS[op]


def test_importing_workbench_does_not_import_torch():
    code = "import sys, workbench, workbench.ops, workbench.weight; assert 'torch' not in sys.modules, 'torch'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_vllm_scalar_type_ids():
    # uint4b8 = 1 << 50 (NaN repr IEEE) | 8 << 17 (bias) | 4 << 8 (mantissa): the value vLLM's ScalarType.id gives
    assert wt.vllm_id("u4b8") == 1125899907892224 == (1 << 50) | (8 << 17) | (4 << 8)
    fields = scalar_ids.unpack_id(wt.vllm_id(S.FE4M3FN))
    assert fields == {"exponent": 4, "mantissa": 3, "signed": 1, "bias": 0, "finite_only": 1, "nan_repr": 2}
    ids = {t: wt.vllm_id(t) for t in scalar_ids.VLLM_ID}
    assert len(set(ids.values())) == len(ids)  # distinct
    for t, i in ids.items():
        assert wt.from_vllm_id(i) is t and scalar_ids.pack_id(*scalar_ids.unpack_id(i).values()) == i


def test_type_argument_forms():
    class VllmLike:  # vLLM's ScalarType: an object with an integer .id
        id = U4B8

    assert {wt.as_type_id(x) for x in (S.U4B8, "u4b8", U4B8, VllmLike())} == {U4B8}
    with pytest.raises(ValueError, match=r"b_q_type = 12345 .* is not a type these ops know"):
        wt.from_vllm_id(12345)
    with pytest.raises(TypeError, match="b_q_type must be an int"):
        wt.from_vllm_id(1.5)


# ---------------------------------------------------------------------------------------------------------------
# layout ops on CPU tensors: equal to workbench.ops (the NumPy reference), exactly
# ---------------------------------------------------------------------------------------------------------------
def gptq_qweight(rng, k, n, bits):
    codes = rng.integers(0, 1 << bits, (k, n), dtype=np.uint8)
    return packing.pack_rows(codes, bits)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_repack_matches_reference_and_inverts(bits, act_order, rng):
    k, n = 256, 128
    q = gptq_qweight(rng, k, n, bits)
    perm = rng.permutation(k).astype(np.int32) if act_order else None
    ref = wb.gptq_marlin_repack(q, perm, k, n, bits, backend="numpy")
    perm_t = torch.from_numpy(perm) if act_order else torch.empty(0, dtype=torch.int32)
    out = OPS.gptq_marlin_repack(torch.from_numpy(q), perm_t, k, n, bits)
    assert out.dtype == torch.int32 and np.array_equal(out.numpy(), ref)
    assert np.array_equal(wt.gptq_marlin_repack(torch.from_numpy(q), perm_t if act_order else None, k, n,
                                                bits).numpy(), ref)
    back = wt.marlin_to_gptq_qweight(out, perm_t if act_order else None, k, n, bits)
    assert np.array_equal(back.numpy(), q)


@pytest.mark.parametrize("bits", [4, 8])
def test_awq_repack_matches_reference_and_inverts(bits, rng):
    k, n = 128, 256
    q = packing.awq_pack(rng.integers(0, 1 << bits, (k, n), dtype=np.uint8), bits)
    out = wt.awq_marlin_repack(torch.from_numpy(q), k, n, bits)
    assert np.array_equal(out.numpy(), wb.awq_marlin_repack(q, k, n, bits, backend="numpy"))
    assert np.array_equal(wt.marlin_to_awq_qweight(out, k, n, bits).numpy(), q)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
@pytest.mark.parametrize("group_size", [-1, 128])
def test_permute_scales_matches_reference_and_inverts(dtype, group_size, rng):
    k, n = 256, 128
    ng = 1 if group_size == -1 else k // group_size
    s = rng.standard_normal((ng, n)).astype(dtype)
    out = wt.marlin_permute_scales(from_numpy(s), k, n, group_size)
    ref = wb.marlin_permute_scales(s, k, n, group_size, backend="numpy")
    assert out.dtype == from_numpy(s).dtype
    assert np.array_equal(out.view(torch.int16).numpy(), ref.view(np.int16))  # bit for bit
    back = wt.marlin_unpermute_scales(out, k, n, group_size)
    assert np.array_equal(back.view(torch.int16).numpy(), s.view(np.int16))


@pytest.mark.parametrize("bits", [4, 8])
def test_zero_point_ops_match_reference(bits, rng):
    k, n, ng = 256, 128, 2
    zp = rng.integers(0, 1 << bits, (ng, n), dtype=np.uint8)
    out = wt.marlin_zero_points(torch.from_numpy(zp), k, n, bits)
    assert np.array_equal(out.numpy(), wb.marlin_zero_points(zp, k, n, bits, backend="numpy"))
    awq = packing.awq_pack(zp, bits)
    out = wt.awq_to_marlin_zero_points(torch.from_numpy(awq), k, n, bits)
    assert np.array_equal(out.numpy(), wb.awq_to_marlin_zero_points(awq, k, n, bits, backend="numpy"))


def test_layout_ops_do_not_mutate_their_inputs(rng):
    q = torch.from_numpy(gptq_qweight(rng, 256, 128, 4))
    perm = torch.from_numpy(rng.permutation(256).astype(np.int32))
    before = (q.clone(), perm.clone())
    wt.gptq_marlin_repack(q, perm, 256, 128, 4)
    assert torch.equal(q, before[0]) and torch.equal(perm, before[1])


# ---------------------------------------------------------------------------------------------------------------
# opcheck, fakes, torch.compile
# ---------------------------------------------------------------------------------------------------------------
def layout_cases(rng):
    """(op name, CPU args) for every layout op."""
    k, n = 256, 128
    q4 = torch.from_numpy(gptq_qweight(rng, k, n, 4))
    perm = torch.from_numpy(rng.permutation(k).astype(np.int32))
    marlin = OPS.gptq_marlin_repack(q4, torch.empty(0, dtype=torch.int32), k, n, 4)
    awq = torch.from_numpy(packing.awq_pack(rng.integers(0, 16, (k, n), dtype=np.uint8), 4))
    s = torch.from_numpy(rng.standard_normal((2, n)).astype(np.float16))
    zp = torch.from_numpy(rng.integers(0, 16, (2, n), dtype=np.uint8))
    return [("gptq_marlin_repack", (q4, perm, k, n, 4)), ("gptq_marlin_repack", (q4, torch.empty(0, dtype=torch.int32),
                                                                              k, n, 4)),
            ("awq_marlin_repack", (awq, k, n, 4)), ("marlin_permute_scales", (s, k, n, 128)),
            ("marlin_unpermute_scales", (s, k, n, 128)), ("marlin_zero_points", (zp, k, n, 4)),
            ("awq_to_marlin_zero_points", (torch.from_numpy(packing.awq_pack(zp.numpy(), 4)), k, n, 4)),
            ("marlin_to_gptq_qweight", (marlin, perm, k, n, 4)), ("marlin_to_awq_qweight", (marlin, k, n, 4))]


def test_opcheck_layout_ops_on_cpu(rng):
    for name, args in layout_cases(rng):
        torch.library.opcheck(getattr(OPS, name).default, args)


def test_layout_fakes_match_the_cpu_results(rng):
    for name, args in layout_cases(rng):
        real = getattr(OPS, name)(*args)
        meta = getattr(OPS, name)(*(a.to("meta") if isinstance(a, torch.Tensor) else a for a in args))
        assert (meta.shape, meta.dtype, meta.device.type) == (real.shape, real.dtype, "meta"), name


def test_compile_fullgraph_repack_on_cpu(rng):
    k, n = 256, 128
    q = torch.from_numpy(gptq_qweight(rng, k, n, 4))
    empty = torch.empty(0, dtype=torch.int32)

    def repack_and_unpack(x):
        m = OPS.gptq_marlin_repack(x, empty, k, n, 4)
        return OPS.marlin_to_gptq_qweight(m, empty, k, n, 4), m

    back, m = torch.compile(repack_and_unpack, backend="aot_eager", fullgraph=True)(q)
    assert torch.equal(back, q) and torch.equal(m, OPS.gptq_marlin_repack(q, empty, k, n, 4))


def meta_gemm_args(m, k=256, n=128, group=128, a_dtype=torch.float16, scale_dtype=None, device="meta"):
    """The 19 arguments of a u4b8 GEMM on meta tensors (c = None)."""
    a = torch.empty((m, k), dtype=a_dtype, device=device)
    q = torch.empty((k // 16, n * 16 // 8), dtype=torch.int32, device=device)
    s = torch.empty((k // group, n), dtype=scale_dtype or a_dtype, device=device)
    ws = torch.zeros(256, dtype=torch.int32, device=device)
    return [a, None, q, None, s, None, None, None, None, None, ws, U4B8, m, n, k, True, False, True, False]


@pytest.mark.parametrize("op", ["marlin_gemm", "gptq_marlin_gemm"])
def test_gemm_fake_shape_and_opcheck_on_meta(op):
    args = meta_gemm_args(5)
    out = getattr(OPS, op)(*args)
    assert (tuple(out.shape), out.dtype, out.device.type) == ((5, 128), torch.float16, "meta")
    torch.library.opcheck(getattr(OPS, op).default, tuple(args))
    args[1] = torch.empty((5, 128), dtype=torch.float16, device="meta")
    torch.library.opcheck(getattr(OPS, f"{op}_out").default, tuple(args))


@pytest.mark.parametrize("op", ["marlin_gemm", "gptq_marlin_gemm"])
def test_gemm_modes_by_keyword_through_the_op_the_fake_and_opcheck(op):
    """deterministic / batch_invariant reach the fake through the dispatcher (as keyword-only arguments) and the
    Python functions; opcheck's schema, fake and autograd-registration checks pass with them set."""
    args = meta_gemm_args(5)
    for flags in ({"deterministic": True}, {"batch_invariant": True}, {"deterministic": True, "batch_invariant": True}):
        assert tuple(getattr(OPS, op)(*args, **flags).shape) == (5, 128)
        assert tuple(getattr(OPS, op).default(*args, **flags).shape) == (5, 128)
        assert tuple(getattr(wt, op)(*args, **flags).shape) == (5, 128)
        torch.library.opcheck(getattr(OPS, op).default, tuple(args), flags)
        out = [args[0], torch.empty((5, 128), dtype=torch.float16, device="meta"), *args[2:]]
        torch.library.opcheck(getattr(OPS, f"{op}_out").default, tuple(out), flags)
        assert getattr(wt, op)(*out, **flags) is out[1]


@pytest.mark.parametrize("flag", ["deterministic", "batch_invariant"])
def test_gemm_modes_refuse_atomics_and_non_bools_by_name(flag):
    args = meta_gemm_args(5)
    args[16] = True  # use_atomic_add: atomics sum in arrival order
    for call in (OPS.marlin_gemm, wt.marlin_gemm, OPS.gptq_marlin_gemm_out.default):
        a = list(args)
        if call is OPS.gptq_marlin_gemm_out.default:
            a[1] = torch.empty((5, 128), dtype=torch.float16, device="meta")
        with pytest.raises(ValueError, match=rf"use_atomic_add cannot be {flag}"):
            call(*a, **{flag: True})
    with pytest.raises(TypeError, match=rf"marlin_gemm: {flag} must be a bool, got int"):
        wt.marlin_gemm(*meta_gemm_args(5), **{flag: 1})
    with pytest.raises(TypeError, match=r"positional"):  # keyword-only: a 20th positional argument is no mode
        wt.marlin_gemm(*meta_gemm_args(5), True)


def test_compile_gemm_with_batch_invariant_keeps_the_flag_in_the_graph():
    from torch._dynamo.testing import CompileCounterWithBackend

    args = meta_gemm_args(4)
    counter = CompileCounterWithBackend("aot_eager")

    def layer(x, q, s, ws):
        return OPS.marlin_gemm(x, None, q, None, s, None, None, None, None, None, ws, U4B8, x.shape[0], 128, 256,
                               True, False, True, False, batch_invariant=True)

    compiled = torch.compile(layer, backend=counter, fullgraph=True, dynamic=True)
    for m in (3, 7):
        assert tuple(compiled(torch.empty((m, 256), dtype=torch.float16, device="meta"), args[2], args[4],
                              args[10]).shape) == (m, 128)
    assert counter.frame_count == 1
    calls = [n for g in counter.graphs for n in g.graph.nodes if "marlin_gemm" in str(n.target)]
    assert calls and all(n.kwargs.get("batch_invariant") is True for n in calls), [n.kwargs for n in calls]


def test_gemm_bf16_fake():
    out = OPS.marlin_gemm(*meta_gemm_args(3, a_dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16


def test_compile_gemm_with_symbolic_m_compiles_once():
    from torch._dynamo.testing import CompileCounterWithBackend

    args = meta_gemm_args(4)
    counter = CompileCounterWithBackend("aot_eager")

    def layer(x, q, s, ws):
        return OPS.marlin_gemm(x, None, q, None, s, None, None, None, None, None, ws, U4B8, x.shape[0], 128, 256,
                               True, False, True, False)

    compiled = torch.compile(layer, backend=counter, fullgraph=True, dynamic=True)
    for m in (3, 7, 64, 129):
        out = compiled(torch.empty((m, 256), dtype=torch.float16, device="meta"), args[2], args[4], args[10])
        assert tuple(out.shape) == (m, 128)
    assert counter.frame_count == 1  # one graph for every M: no recompile per batch size


def test_python_wrapper_routes_a_given_c_to_the_out_op():
    args = meta_gemm_args(5)
    c = torch.empty((5, 128), dtype=torch.float16, device="meta")
    assert wt.marlin_gemm(args[0], c, *args[2:]) is c
    assert wt.gptq_marlin_gemm(args[0], None, *args[2:11], S.U4B8, *args[12:]).shape == (5, 128)


def moe_args(device="meta", e=4, k=256, n=128, m=6, top_k=2):
    """The 29 arguments of a u4b8 fused MoE GEMM (c = None)."""
    meta = {"device": device}
    a = torch.empty((m, k), dtype=torch.float16, **meta)
    args = [a, None, torch.empty((e, k // 16, n * 2), dtype=torch.int32, **meta), None,
            torch.empty((e, 2, n), dtype=torch.float16, **meta), None, None, None, None, None,
            torch.zeros(256, dtype=torch.int32, **meta), torch.empty(64, dtype=torch.int32, **meta),
            torch.empty(8, dtype=torch.int32, **meta), torch.empty(1, dtype=torch.int32, **meta),
            torch.empty((m, top_k), dtype=torch.float32, **meta), 16, top_k, True, U4B8, m, n, k, True, False, True,
            False, -1, -1, -1]
    return args


def test_moe_gemm_fake_and_opcheck_on_meta():
    m, top_k, n = 6, 2, 128
    meta = {"device": "meta"}
    args = moe_args()
    out = OPS.moe_wna16_marlin_gemm(*args)
    assert tuple(out.shape) == (m * top_k, n)
    torch.library.opcheck(OPS.moe_wna16_marlin_gemm.default, tuple(args))
    args[1] = torch.empty((m * top_k, n), dtype=torch.float16, **meta)
    torch.library.opcheck(OPS.moe_wna16_marlin_gemm_out.default, tuple(args))
    torch.library.opcheck(OPS.moe_wna16_marlin_gemm_out.default, tuple(args), {"batch_invariant": True})
    assert wt.moe_wna16_marlin_gemm(*args, batch_invariant=True) is args[1]
    args[1] = None
    assert tuple(wt.moe_wna16_marlin_gemm(*args, batch_invariant=True).shape) == (m * top_k, n)
    torch.library.opcheck(OPS.moe_wna16_marlin_gemm.default, tuple(args), {"batch_invariant": True})
    with pytest.raises(TypeError, match=r"moe_wna16_marlin_gemm: batch_invariant must be a bool, got str"):
        wt.moe_wna16_marlin_gemm(*args, batch_invariant="yes")
    args[1] = torch.empty((m * top_k, n), dtype=torch.float16, **meta)
    args[15] = 24
    with pytest.raises(ValueError, match=r"moe_block_size = 24 is not one of"):
        OPS.moe_wna16_marlin_gemm_out(*args)


# ---------------------------------------------------------------------------------------------------------------
# moe_align_block_size on CPU
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("m,top_k,experts,block", [(4, 3, 5, 4), (7, 2, 8, 16), (33, 2, 4, 48)])
def test_moe_align_matches_reference(m, top_k, experts, block, rng):
    ids = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(m)]).astype(np.int32)
    bufs = wt.allocate_align_buffers(torch.from_numpy(ids), experts, block)
    wt.moe_align_block_size(torch.from_numpy(ids), experts, block, *bufs)
    ref = ma.moe_align_block_size(ids, block, experts)
    assert int(bufs[2][0]) == int(ref[2][0])
    got = ma.segments(bufs[0].numpy(), bufs[1].numpy(), bufs[2].numpy(), block, ids.size)
    assert got == ma.segments(*ref, block, ids.size)
    assert bufs[0].shape[0] == ids.size + experts * (block - 1)  # vLLM's buffer size
    torch.library.opcheck(OPS.moe_align_block_size.default,
                          (torch.from_numpy(ids), experts, block, *wt.allocate_align_buffers(torch.from_numpy(ids),
                                                                                               experts, block)))


def test_moe_align_expert_map_and_small_buffers():
    ids = torch.tensor([[0, 1], [1, 2]], dtype=torch.int32)
    bufs = wt.allocate_align_buffers(ids, 3, 4)
    wt.moe_align_block_size(ids, 3, 4, *bufs, torch.tensor([0, -1, 1], dtype=torch.int32))
    assert bufs[1][:3].tolist() == [0, -1, 1]
    with pytest.raises(RuntimeError, match="sorted_token_ids has 9 entries, fewer than max_num_tokens_padded"):
        OPS.moe_align_block_size(ids, 3, 4, bufs[0][:9], bufs[1], bufs[2])


# ---------------------------------------------------------------------------------------------------------------
# bad input: a clear error naming the argument and the value, before any launch, also under torch.compile
# ---------------------------------------------------------------------------------------------------------------
def test_cpu_tensors_to_the_cuda_only_gemm():
    args = meta_gemm_args(4, device="cpu")
    with pytest.raises(RuntimeError, match=r"marlin_gemm: a is on cpu, but this op runs on CUDA devices only"):
        OPS.marlin_gemm(*args)
    with pytest.raises(RuntimeError, match=r"a is on cpu, but this op runs on CUDA devices only"):
        wt.marlin_gemm(*args)


def test_cpu_tensors_to_the_cuda_only_gemm_under_compile():
    args = meta_gemm_args(4, device="cpu")

    def f(*xs):
        return OPS.marlin_gemm(*xs)

    with pytest.raises(Exception, match=r"a is on cpu, but this op runs on CUDA devices only"):
        torch.compile(f, backend="aot_eager", fullgraph=True)(*args)


def test_cpu_tensors_to_the_cuda_only_moe_gemm_and_moe_refusals():
    with pytest.raises(RuntimeError, match=r"moe_wna16_marlin_gemm: a is on cpu, but this op runs on CUDA"):
        OPS.moe_wna16_marlin_gemm(*moe_args("cpu"))
    args = moe_args()
    args[8] = torch.empty(256, dtype=torch.int32, device="meta")  # g_idx
    with pytest.raises(NotImplementedError, match=r"moe_wna16_marlin_gemm: g_idx = a tensor of shape \(256,\)"):
        OPS.moe_wna16_marlin_gemm(*args)
    args = moe_args()
    args[11] = torch.empty(64, dtype=torch.int64, device="meta")
    with pytest.raises(TypeError, match=r"sorted_token_ids must be a contiguous 1-D int32 tensor .* got torch.int64"):
        OPS.moe_wna16_marlin_gemm(*args)
    args = moe_args()
    args[4] = torch.empty((3, 2, 128), dtype=torch.float16, device="meta")
    with pytest.raises(ValueError, match=r"b_scales has 3 experts .* b_q_weight has 4"):
        OPS.moe_wna16_marlin_gemm(*args)


def test_wrong_dtype_names_the_argument_and_value():
    with pytest.raises(TypeError, match=r"b_scales dtype = float32 must equal a dtype = float16"):
        OPS.marlin_gemm(*meta_gemm_args(4, scale_dtype=torch.float32))
    args = meta_gemm_args(4)
    args[0] = args[0].to(torch.float32)
    with pytest.raises(TypeError, match=r"unsupported `a` dtype = float32"):
        OPS.marlin_gemm(*args)


def test_non_contiguous_inputs():
    args = meta_gemm_args(4)
    args[2] = torch.empty((args[2].shape[1], args[2].shape[0]), dtype=torch.int32, device="meta").t()
    with pytest.raises(ValueError, match="b_q_weight is not contiguous"):
        OPS.marlin_gemm(*args)
    args = meta_gemm_args(4)
    args[0] = torch.empty((256, 4), dtype=torch.float16, device="meta").t()
    with pytest.raises(ValueError, match=r"A.stride\(1\) is not 1"):
        OPS.marlin_gemm(*args)
    # On the CPU the NumPy reference takes any strides (workbench.ops converts a host view once, never in place):
    # a transposed view repacks to the same tiles as its contiguous copy.
    gen = torch.Generator().manual_seed(3)
    q = torch.randint(-2**31, 2**31 - 1, (128, 32), dtype=torch.int32, generator=gen).t()  # [32, 128] view
    before = q.clone()
    assert torch.equal(wt.gptq_marlin_repack(q, None, 256, 128, 4),
                       wt.gptq_marlin_repack(q.contiguous(), None, 256, 128, 4))
    assert torch.equal(q, before)


def test_tensors_on_two_devices():
    args = meta_gemm_args(4)
    args[4] = torch.empty(tuple(args[4].shape), dtype=torch.float16)  # b_scales on the CPU, the rest on meta
    with pytest.raises(ValueError, match=r"b_scales is on cpu but a is on meta"):
        OPS.marlin_gemm(*args)
    q = torch.zeros((32, 128), dtype=torch.int32)
    with pytest.raises(ValueError, match=r"perm is on meta but b_q_weight is on cpu"):
        OPS.gptq_marlin_repack(q, torch.empty(0, dtype=torch.int32, device="meta"), 256, 128, 4)


def test_b_bias_is_checked_by_the_dense_rules():
    """vLLM's b_bias is implemented (the kernel's epilogue): (size_n,) in a's dtype, else refused by name."""
    for bias, exc, message in ((torch.empty(127, dtype=torch.float16, device="meta"), ValueError,
                                r"b_bias has shape \(127,\), expected \(128,\)"),
                               (torch.empty(128, dtype=torch.float32, device="meta"), TypeError,
                                "b_bias dtype = float32 must equal the activation dtype float16")):
        args = meta_gemm_args(4)
        args[3] = bias
        with pytest.raises(exc, match=message):
            OPS.marlin_gemm(*args)


@pytest.mark.parametrize("name,index,value", [
    ("a_scales", 5, torch.empty((4, 1), dtype=torch.float32, device="meta")),
    ("is_zp_float", 18, True)])
def test_unimplemented_arguments_are_refused_by_name(name, index, value):
    args = meta_gemm_args(4)
    args[index] = value
    with pytest.raises(NotImplementedError, match=rf"marlin_gemm: {name} = .* is not implemented"):
        OPS.marlin_gemm(*args)


def test_moe_b_bias_is_one_row_per_expert():
    """The fused MoE op takes vLLM's b_bias as [E, size_n] (the kernel's epilogue adds row e to expert e's sums)."""
    moe = moe_args()
    moe[3] = torch.empty(128, dtype=torch.float16, device="meta")
    with pytest.raises(ValueError, match=r"b_bias must be \[E = .*, size_n\]"):
        OPS.moe_wna16_marlin_gemm(*moe)


def test_global_scale_is_nvfp4s_only():
    """global_scale is implemented for NVFP4 (fe2m1f with E4M3 scale bytes); with any other weight it is refused by
    the dense GEMM's rule, and NVFP4 without it names what is missing."""
    args = meta_gemm_args(4)
    args[6] = torch.empty(1, dtype=torch.float32, device="meta")
    with pytest.raises(ValueError, match=r"global_scale is NVFP4's"):
        OPS.marlin_gemm(*args)
    args = meta_gemm_args(4)
    size_k, size_n = args[14], args[13]
    args[2] = torch.empty((size_k // 16, 2 * size_n), dtype=torch.int32, device="meta")
    args[4] = torch.empty((size_k // 16, size_n), dtype=torch.float8_e4m3fn, device="meta")
    args[11] = wt.vllm_id("fe2m1f")
    with pytest.raises(ValueError, match=r"NVFP4 needs global_scale"):
        OPS.marlin_gemm(*args)


def nvfp4_moe_args(e=4, k=256, n=128):
    """moe_args with an NVFP4 stack: fe2m1f words [E, K / 16, 2 N], E4M3 scale bytes [E, K / 16, N]."""
    args = moe_args(e=e, k=k, n=n)
    args[2] = torch.empty((e, k // 16, 2 * n), dtype=torch.int32, device="meta")
    args[4] = torch.empty((e, k // 16, n), dtype=torch.float8_e4m3fn, device="meta")
    args[18] = wt.vllm_id("fe2m1f")
    return args


def test_moe_global_scale_is_one_float32_per_expert():
    """The fused MoE op takes NVFP4's global_scale as vLLM's [E] float32 (each expert's, by the dense rule for one);
    another shape or dtype, or a global scale with a format that has none, is refused naming the values."""
    e, m, top_k, n = 4, 6, 2, 128
    args = nvfp4_moe_args(e=e, n=n)
    args[6] = torch.empty(e, dtype=torch.float32, device="meta")
    assert tuple(OPS.moe_wna16_marlin_gemm(*args).shape) == (m * top_k, n)
    torch.library.opcheck(OPS.moe_wna16_marlin_gemm.default, tuple(args))
    for bad in (torch.empty(e, dtype=torch.float16, device="meta"), torch.empty(e + 1, dtype=torch.float32,
                                                                                  device="meta")):
        args[6] = bad
        with pytest.raises(ValueError, match=rf"global_scale must be a contiguous float32 tensor with one value per "
                                             rf"expert, \[E = {e}\] .* got {bad.dtype} of shape \({bad.shape[0]},\)"):
            OPS.moe_wna16_marlin_gemm(*args)
    args[6] = None
    with pytest.raises(ValueError, match=r"NVFP4 needs global_scale"):
        OPS.moe_wna16_marlin_gemm(*args)
    args = moe_args(e=e)  # u4b8
    args[6] = torch.empty(e, dtype=torch.float32, device="meta")
    with pytest.raises(ValueError, match=r"global_scale is NVFP4's"):
        OPS.moe_wna16_marlin_gemm(*args)


def test_is_a_8bit_is_refused():
    q = torch.zeros((32, 128), dtype=torch.int32)
    with pytest.raises(NotImplementedError, match=r"gptq_marlin_repack: is_a_8bit = True is not implemented"):
        wt.gptq_marlin_repack(q, None, 256, 128, 4, is_a_8bit=True)


def test_functional_gemm_refuses_a_given_c():
    args = meta_gemm_args(4)
    args[1] = torch.empty((4, 128), dtype=torch.float16, device="meta")
    with pytest.raises(ValueError, match=r"c is given, .* call torch.ops.workbench.marlin_gemm_out"):
        OPS.marlin_gemm(*args)


def test_bad_scalar_type_and_shape():
    args = meta_gemm_args(4)
    args[11] = 7
    with pytest.raises(ValueError, match=r"b_q_type = 7 .* is not a type these ops know"):
        OPS.marlin_gemm(*args)
    args = meta_gemm_args(4)
    args[13] = 200  # (96 is fine now: its padded arrays are the 128-column ones given)
    with pytest.raises(ValueError, match=r"size_n = 200, actual_size_n = 128"):
        OPS.marlin_gemm(*args)
    with pytest.raises(ValueError, match=r"b_q_weight has shape \(32, 128\), expected \(64, 128\)"):
        wt.gptq_marlin_repack(torch.zeros((32, 128), dtype=torch.int32), None, 256, 128, 8)


# ---------------------------------------------------------------------------------------------------------------
# inference only
# ---------------------------------------------------------------------------------------------------------------
def test_backward_raises():
    s = torch.randn(2, 128, dtype=torch.float16, requires_grad=True)
    out = wt.marlin_permute_scales(s, 256, 128, 128)
    assert out.requires_grad
    with pytest.raises(RuntimeError, match="marlin_permute_scales is inference-only"):
        out.float().sum().backward()
    args = meta_gemm_args(4)
    args[0].requires_grad_(True)
    with pytest.raises(RuntimeError, match="marlin_gemm is inference-only"):
        OPS.marlin_gemm(*args).sum().backward()


def test_mutating_ops_refuse_tracked_inputs():
    args = meta_gemm_args(4)
    args[0].requires_grad_(True)
    args[1] = torch.empty((4, 128), dtype=torch.float16, device="meta")
    with pytest.raises(RuntimeError, match="marlin_gemm_out is inference-only, but a requires grad"):
        OPS.marlin_gemm_out(*args)
    with torch.no_grad():
        OPS.marlin_gemm_out(*args)


def test_eager_bypass_is_taken_only_for_plain_untracked_tensors():
    """The eager check reads the schema's tensor positions: plain CPU tensors pass, meta, tracked, subclassed and
    non-tensor values there do not, nor anything under vmap or the profiler."""
    eager = OPS.marlin_permute_scales.default.eager_device
    x = torch.zeros(2)
    assert eager((x, 3)) == "cpu" and eager((x.to("meta"), 3)) is None
    assert eager((torch.zeros(2, requires_grad=True), 3)) is None and eager(([1.0], 3)) is None

    class Sub(torch.Tensor):
        pass

    assert eager((x.as_subclass(Sub), 3)) is None
    with torch.no_grad():
        assert eager((torch.zeros(2, requires_grad=True), 3)) == "cpu"
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert eager((x, 3)) is None
    seen = []
    torch.vmap(lambda r: seen.append(eager((r, 3))) or r)(torch.zeros(3, 2))
    assert seen == [None]


def test_every_op_has_its_kernel_at_the_autograd_key_and_eager_calls_agree(rng):
    """One Python kernel per op at the Autograd key (no second Python layer that re-walks the arguments); a plain
    eager call through the dispatcher, the Python wrapper's bypass and the functional op under tracked inputs agree."""
    for op in ALL_OPS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"workbench::{op}", "Autograd"), op
    s = torch.from_numpy(rng.standard_normal((2, 128)).astype(np.float16))
    direct = OPS.marlin_permute_scales(s, 256, 128, 128)
    assert torch.equal(direct, wt.marlin_permute_scales(s, 256, 128, 128))
    tracked = OPS.marlin_permute_scales(s.clone().requires_grad_(True), 256, 128, 128)
    assert tracked.requires_grad and torch.equal(tracked.detach(), direct)


def test_modes_see_the_op_the_eager_fast_paths_step_aside():
    """Under a TorchDispatchMode or TorchFunctionMode the packet, .default and the Python functions take the
    dispatcher, so the mode sees the op (a fast path that skipped it would hide the call from fake modes, ...)."""
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    class SeenFunctions(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    s = torch.randn(2, 128).half()
    plain = OPS.marlin_permute_scales(s, 256, 128, 128)
    for mode in (Seen(), SeenFunctions()):
        with mode:
            a = OPS.marlin_permute_scales(s, 256, 128, 128)
            b = wt.marlin_permute_scales(s, 256, 128, 128)
            c = OPS.marlin_permute_scales.default(s, 256, 128, 128)
        assert sum("marlin_permute_scales" in op for op in mode.ops) >= 3, mode.ops
        assert torch.equal(a, plain) and torch.equal(b, plain) and torch.equal(c, plain)


def test_gemm_plan_key_separates_what_the_checks_read():
    """The dense GEMM's plan key (metadata only, so it is built on CPU tensors here): flags by truth value, every
    tensor's shape, strides, dtype and device, vLLM's empty-tensor "none" apart from None; no key for other types."""
    from workbench.torch.ops import _gemm_key

    a, q = torch.zeros((4, 256), dtype=torch.float16), torch.zeros((16, 256), dtype=torch.int32)
    s, ws = torch.zeros((2, 128), dtype=torch.float16), torch.zeros(64, dtype=torch.int32)

    def key(a=a, zeros=None, is_k_full=True, size_m=4):
        return _gemm_key(a, None, q, s, zeros, None, None, ws, U4B8, size_m, 128, 256, is_k_full, False, True)

    assert key() == key(is_k_full=1) and key() != key(is_k_full=False) and key(is_k_full=0) == key(is_k_full=False)
    assert key() != key(a=torch.zeros((256, 4), dtype=torch.float16).t()) != key(a=a.to(torch.bfloat16))
    assert key() != key(zeros=torch.empty(0, dtype=torch.int32))
    assert key(is_k_full=1.0) is None and key(size_m=torch.tensor(4)) is None

    def moded(**flags):
        return _gemm_key(a, None, q, s, None, None, None, ws, U4B8, 4, 128, 256, True, False, True, **flags)

    # the modes choose another launch (partition, tile, late scaling): each is its own plan
    keys = [moded(), moded(deterministic=True), moded(batch_invariant=True),
            moded(deterministic=True, batch_invariant=True)]
    assert keys[0] == key() and len(set(keys)) == 4
    assert moded(batch_invariant=1) is None  # not a bool: every check runs (and refuses it)
