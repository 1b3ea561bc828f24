"""The torch surface on a real GPU: the ops against the CuPy entry points bit for bit, identity activations against
the reference exactly, opcheck with the real kernels, torch.compile with a symbolic M, CUDA-graph capture and
replay after every temporary of the capture was freed, side-stream ordering, the layout ops and moe_align on CUDA
tensors, and MarlinMoE against the MoE reference (workbench.moe.moe_error_bound, derived there); MarlinLinear on
shapes that are not tile multiples against the fp32 reference, and the batch-invariant mode through the ops.

Bitwise comparisons between the torch op and the CuPy path: both launch the same kernel with the same tile choice
on the same data; with the fp32 (lock-ordered) reduction the result does not depend on block timing.
"""
import gc

import numpy as np
import pytest

from workbench import gemm, hardware, moe
from workbench.formats import moe_align as align_ref
from workbench.scalar_types import ScalarType as S
from workbench.weight import random_marlin_weight

torch = pytest.importorskip("torch", reason="torch is not installed")
cp = pytest.importorskip("cupy", reason="CuPy is not installed")

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not (torch.cuda.is_available() and hardware.cupy_available()),
                                 reason="needs a CUDA GPU visible to both torch and CuPy")]

import workbench.torch as wt  # noqa: E402
from workbench.torch._tensors import from_numpy  # noqa: E402

OPS = torch.ops.workbench
DEV = "cuda"
CASES = [(S.U4B8, 128, False), (S.U4, 64, False), (S.U8B128, -1, False), (S.U4B8, 128, True), (S.FE4M3FN, 128, False)]


def torch_weight(w):
    """A host MarlinWeight's arrays as CUDA tensors, in the order of the GEMM's arguments."""
    up = (lambda x: None if x is None else from_numpy(np.ascontiguousarray(x)).to(DEV))
    return up(w.qweight), up(w.scales), up(w.zeros), up(w.g_idx), up(w.perm)


def gemm_args(a, w, tensors, workspace, c=None):
    q, s, z, g, p = tensors
    return [a, c, q, None, s, None, None, z, g, p, workspace, wt.vllm_id(w.weight_type), a.shape[0], w.size_n,
            w.size_k, w.is_k_full, False, True, False]


@pytest.mark.parametrize("wt_type,group,act_order", CASES)
@pytest.mark.parametrize("m", [1, 13, 64])
def test_gemm_op_equals_the_cupy_path_bitwise(wt_type, group, act_order, m):
    w, _ = random_marlin_weight(256, 256, wt_type, group, act_order=act_order, seed=m)
    a = (torch.randn(m, 256, device=DEV) * 0.5).half()
    out = OPS.marlin_gemm(*gemm_args(a, w, torch_weight(w), wt.make_workspace(DEV)))
    ref = gemm.marlin_gemm(cp.asarray(a.cpu().numpy()), gemm.upload_weight(w), use_fp32_reduce=True)
    assert np.array_equal(out.cpu().numpy().view(np.uint16), cp.asnumpy(ref).view(np.uint16))
    alias = OPS.gptq_marlin_gemm(*gemm_args(a, w, torch_weight(w), wt.make_workspace(DEV)))
    assert torch.equal(alias, out)


@pytest.mark.parametrize("wt_type,group,act_order", CASES[:3])
def test_identity_activations_give_the_dequantized_weight_exactly(wt_type, group, act_order):
    w, q = random_marlin_weight(256, 128, wt_type, group, act_order=act_order)
    eye = torch.eye(256, device=DEV, dtype=torch.float16)
    out = wt.marlin_gemm(*gemm_args(eye, w, torch_weight(w), wt.make_workspace(DEV)))
    assert np.array_equal(out.cpu().numpy(), q.w_ref.astype(np.float16))


def test_out_variant_writes_c_and_leaves_the_workspace_zero():
    w, _ = random_marlin_weight(256, 128, S.U4B8, 128)
    a = torch.randn(8, 256, device=DEV).half()
    ws = wt.make_workspace(DEV)
    c = torch.full((8, 128), float("nan"), device=DEV, dtype=torch.float16)
    assert wt.marlin_gemm(*gemm_args(a, w, torch_weight(w), ws, c=c)) is c
    assert torch.equal(c, OPS.marlin_gemm(*gemm_args(a, w, torch_weight(w), ws)))
    assert int(torch.count_nonzero(ws)) == 0


def test_bad_input_on_a_gpu_machine_fails_before_any_launch():
    w, _ = random_marlin_weight(256, 128, S.U4B8, 128)
    q, s, _, _, _ = torch_weight(w)
    ws = wt.make_workspace(DEV)
    a = torch.randn(4, 256, device=DEV).half()
    with pytest.raises(RuntimeError, match="a is on cpu, but this op runs on CUDA devices only"):
        OPS.marlin_gemm(*gemm_args(a.cpu(), w, (q, s, None, None, None), ws))
    with pytest.raises(ValueError, match=r"b_scales is on cpu but a is on cuda:0"):
        OPS.marlin_gemm(*gemm_args(a, w, (q, s.cpu(), None, None, None), ws))
    with pytest.raises(ValueError, match=r"A.stride\(1\) is not 1"):
        OPS.marlin_gemm(*gemm_args(torch.randn(256, 4, device=DEV).half().t(), w, (q, s, None, None, None), ws))
    with pytest.raises(Exception, match=r"b_scales dtype = float32 must equal a dtype = float16"):
        torch.compile(lambda *xs: OPS.marlin_gemm(*xs), fullgraph=True)(
            *gemm_args(a, w, (q, s.float(), None, None, None), ws))


def test_opcheck_on_cuda():
    w, _ = random_marlin_weight(256, 128, S.U4, 128)
    a = torch.randn(5, 256, device=DEV).half()
    args = gemm_args(a, w, torch_weight(w), wt.make_workspace(DEV))
    torch.library.opcheck(OPS.marlin_gemm.default, tuple(args))
    args[1] = torch.empty((5, 128), device=DEV, dtype=torch.float16)
    torch.library.opcheck(OPS.marlin_gemm_out.default, tuple(args))
    q = torch.randint(-2 ** 31, 2 ** 31 - 1, (32, 128), dtype=torch.int32, device=DEV)
    torch.library.opcheck(OPS.gptq_marlin_repack.default, (q, torch.empty(0, dtype=torch.int32, device=DEV), 256,
                                                          128, 4))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_marlin_linear_with_symbolic_m(backend):
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    w, _ = random_marlin_weight(256, 128, S.U4B8, 128)
    layer = wt.MarlinLinear.from_weight(w, torch.randn(128).half()).to(DEV)
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(layer, backend=counter, fullgraph=True, dynamic=True)
    for m in (3, 17, 200):
        x = torch.randn(m, 256, device=DEV).half()
        assert torch.equal(compiled(x), layer(x))
    assert counter.frame_count == 1


def test_compile_reduce_overhead_marlin_linear_under_cuda_graph_trees():
    """Inductor's CUDA graph trees warm up and record on their own stream into their own pool, and refuse a live
    allocation there that no output owns: the op's scratch on such a stream is a temporary of the call. Fresh
    layer and shapes, so the first call of the op on any stream happens inside the trees."""
    torch._dynamo.reset()
    w, _ = random_marlin_weight(512, 256, S.U4B8, 128, seed=5)
    layer = wt.MarlinLinear.from_weight(w, torch.randn(256).half()).to(DEV)
    x = torch.randn(7, 512, device=DEV).half()
    compiled = torch.compile(layer, fullgraph=True, dynamic=False, mode="reduce-overhead")
    outs = []
    for _ in range(4):  # warm-up, record, replays
        torch.compiler.cudagraph_mark_step_begin()
        outs.append(compiled(x).clone())
    want = layer(x)
    assert all(torch.equal(o, want) for o in outs)


def test_graph_replay_after_the_captures_temporaries_were_freed():
    w, _ = random_marlin_weight(256, 256, S.U4, 128, act_order=True)  # act-order: the op allocates a_tmp too
    layer = wt.MarlinLinear.from_weight(w).to(DEV)
    static_x = torch.randn(16, 256, device=DEV).half()
    layer(static_x)  # compile the kernel and build the scratch outside the capture
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        static_y = layer(static_x)
    del w
    gc.collect()
    torch.cuda.empty_cache()
    cp.get_default_memory_pool().free_all_blocks()
    junk = [torch.full((1 << 20,), float("nan"), device=DEV) for _ in range(64)]  # reuse anything freed
    fresh = torch.randn(16, 256, device=DEV).half()
    static_x.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_y, layer(fresh))
    del junk


def test_side_stream_ordering():
    """The op runs on the caller's current torch stream: an input written late on a side stream is read after it
    is written (a launch on another stream would read the stale zeros)."""
    w, _ = random_marlin_weight(256, 128, S.U4B8, 128)
    layer = wt.MarlinLinear.from_weight(w).to(DEV)
    src = torch.randn(64, 256, device=DEV).half()
    expected = layer(src)
    side = torch.cuda.Stream()
    x = torch.zeros_like(src)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # ~tens of ms on the side stream before x is written
        x.copy_(src)
        y = layer(x)
    side.synchronize()
    assert torch.equal(y, expected)


@pytest.mark.parametrize("bits", [4, 8])
def test_layout_ops_on_cuda_equal_the_cpu_ops(bits, rng):
    k, n = 512, 256
    q = torch.from_numpy(rng.integers(-2 ** 31, 2 ** 31 - 1, (k * bits // 32, n), dtype=np.int64).astype(np.int32))
    perm = torch.from_numpy(rng.permutation(k).astype(np.int32))
    for p in (None, perm):
        on_gpu = wt.gptq_marlin_repack(q.to(DEV), None if p is None else p.to(DEV), k, n, bits)
        assert torch.equal(on_gpu.cpu(), wt.gptq_marlin_repack(q, p, k, n, bits))
        assert torch.equal(wt.marlin_to_gptq_qweight(on_gpu, None if p is None else p.to(DEV), k, n, bits).cpu(), q)
    for dtype in (torch.float16, torch.bfloat16):
        s = torch.randn(4, n).to(dtype)
        on_gpu = wt.marlin_permute_scales(s.to(DEV), k, n, 128)
        assert on_gpu.dtype == dtype and torch.equal(on_gpu.cpu(), wt.marlin_permute_scales(s, k, n, 128))


def test_moe_align_on_cuda_matches_the_reference(rng):
    m, top_k, e, block = 33, 4, 16, 16
    ids = np.stack([rng.choice(e, top_k, replace=False) for _ in range(m)]).astype(np.int32)
    t = torch.from_numpy(ids).to(DEV)
    bufs = wt.allocate_align_buffers(t, e, block)
    wt.moe_align_block_size(t, e, block, *bufs)
    got = align_ref.segments(*(b.cpu().numpy() for b in bufs[:3]), block, ids.size)
    assert got == align_ref.segments(*align_ref.moe_align_block_size(ids, block, e), block, ids.size)


class MoECase:
    """One fused-MoE GEMM set-up: an expert stack (u4b8 g128, or an NVFP4 / MXFP4 one built by the dense layer's ops),
    random top-k routing aligned by the op, random routing weights, and vLLM's 29 positional arguments of
    moe_wna16_marlin_gemm for it (NVFP4: its [E] float32 global scales, E4M3 scale bytes as float8_e4m3fn; MXFP4:
    E8M0 codes as uint8, bf16 activations)."""

    def __init__(self, rng, e=8, k=256, n=256, m=16, top_k=2, block=16, fmt="u4b8"):
        self.e, self.m, self.n, self.top_k, self.block = e, m, n, top_k, block
        self.global_scale = None
        if fmt == "u4b8":
            self.stack, _ = moe.random_expert_stack(e, k, n, S.U4B8, 128)
            self.act, scales, w_type = np.dtype(np.float16), from_numpy(self.stack.scales), S.U4B8
        else:
            import ml_dtypes
            self.act = np.dtype(np.float16 if fmt == "nvfp4" else ml_dtypes.bfloat16)
            elements, scale_codes, g = moe.random_microscale_experts(fmt, e, k, n, rng)
            self.stack, self.global_scale, _ = moe.microscale_expert_stack(fmt, elements, scale_codes, g, k, n,
                                                                           self.act, ref_dtype=None)
            scales = torch.from_numpy(np.ascontiguousarray(self.stack.scales))
            scales, w_type = (scales.view(torch.float8_e4m3fn) if fmt == "nvfp4" else scales), S.FE2M1F
        ids = np.stack([rng.choice(e, top_k, replace=False) for _ in range(m)]).astype(np.int32)
        self.a = from_numpy(rng.standard_normal((m, k)).astype(self.act)).to(DEV)
        self.t_ids = torch.from_numpy(ids).to(DEV)
        self.bufs = wt.allocate_align_buffers(self.t_ids, e, block)
        wt.moe_align_block_size(self.t_ids, e, block, *self.bufs)
        self.weights = torch.rand(m, top_k, device=DEV)
        self.q, self.s = from_numpy(self.stack.qweight).to(DEV), scales.to(DEV)
        gs = None if self.global_scale is None else torch.from_numpy(self.global_scale).to(DEV)
        self.args = (self.a, None, self.q, None, self.s, None, gs, None, None, None, wt.make_workspace(DEV),
                     *self.bufs, self.weights, block, top_k, True, wt.vllm_id(w_type), m, n, k, True, False, True,
                     False, -1, -1, -1)

    def fused_phase(self, **mode) -> np.ndarray:
        """What the CuPy entry point computes (MarlinExpertStack.gemm_phase_fused) on the same data, as 16-bit
        patterns. It takes whole blocks (vLLM's sizing leaves a partial one): the slices the op passes it."""
        gs = None if self.global_scale is None else cp.asarray(self.global_scale)
        ref_stack = moe.MarlinExpertStack(gemm.upload_weight(self.stack), global_scale=gs)
        ref = cp.zeros((self.m * self.top_k, self.n), dtype=self.act)
        whole = self.bufs[0].shape[0] // self.block
        ref_bufs = (self.bufs[0][:whole * self.block], self.bufs[1][:whole], self.bufs[2])
        a = cp.asarray(self.a.cpu().view(torch.int16).numpy()).view(self.act)
        ref_stack.gemm_phase_fused(a, *(cp.asarray(b.cpu().numpy()) for b in ref_bufs),
                                   ref, self.m, self.block, self.top_k,
                                   topk_weights=cp.asarray(self.weights.cpu().numpy()), **mode)
        return cp.asnumpy(ref).view(np.uint16)


def bits16(x: torch.Tensor) -> np.ndarray:
    return x.cpu().view(torch.int16).numpy().view(np.uint16)


def test_moe_gemm_op_equals_the_fused_phase_bitwise_and_passes_opcheck(rng):
    c = MoECase(rng)
    # (the Python function, given the type object; opcheck calls the op with vLLM's id)
    out = wt.moe_wna16_marlin_gemm(*c.args[:18], S.U4B8, *c.args[19:22])
    torch.library.opcheck(OPS.moe_wna16_marlin_gemm.default, c.args)
    torch.library.opcheck(OPS.moe_align_block_size.default,
                          (c.t_ids, c.e, c.block, *wt.allocate_align_buffers(c.t_ids, c.e, c.block)))
    assert np.array_equal(bits16(out), c.fused_phase())


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_microscaled_moe_gemm_op_equals_the_fused_phase_bitwise(fmt, rng):
    """The fused MoE op on NVFP4 (vLLM's [E] float32 global_scale) and MXFP4 stacks: the CuPy stack's bits, and
    opcheck with the real kernels; new global-scale values at the same address are read by the next call."""
    c = MoECase(rng, fmt=fmt)
    out = OPS.moe_wna16_marlin_gemm(*c.args)
    torch.library.opcheck(OPS.moe_wna16_marlin_gemm.default, c.args)
    assert np.array_equal(bits16(out), c.fused_phase())
    if fmt == "nvfp4":
        c.args[6].mul_(2.0)  # (a power of two: every sum doubles exactly)
        c.global_scale = c.global_scale * 2
        twice = OPS.moe_wna16_marlin_gemm(*c.args)
        assert np.array_equal(bits16(twice), c.fused_phase())
        assert not np.array_equal(bits16(twice), bits16(out))


@pytest.mark.parametrize("h,i", [(256, 128), (264, 136)], ids=str)  # (the second: no tile multiples, partial groups)
def test_marlin_moe_against_the_reference(h, i, rng):
    e, m, top_k = 8, 7, 2
    w13, w13_ref = moe.random_expert_stack(e, h, 2 * i, S.U4, 128, seed=1)
    w2, w2_ref = moe.random_expert_stack(e, i, h, S.U4, 128, seed=2)
    layer = wt.MarlinMoE.from_weights(w13, w2, top_k).to(DEV)
    hidden = torch.randn(m, h, device=DEV).half()
    logits = torch.randn(m, e, device=DEV)
    out = layer(hidden, logits).float().cpu().numpy()
    weights, ids = layer.route(logits)
    args = (hidden.cpu().numpy(), w13_ref, w2_ref, weights.cpu().numpy(), ids.cpu().numpy())
    ref = moe.moe_reference(*args)
    assert np.all(np.abs(out - ref) <= moe.moe_error_bound(*args))


def test_dispatcher_bypass_and_compiled_calls_agree_bitwise_and_repeat_calls_recheck_addresses():
    """The ways into one GEMM (the dispatcher, the packet's and .default's fast paths, the Python wrapper's eager
    bypass, a compiled graph) launch the same plan; a repeated call with an equal key re-checks what the key leaves
    out (alignment of an address)."""
    w, _ = random_marlin_weight(256, 128, S.U4B8, 128)
    a = torch.randn(9, 256, device=DEV).half()
    args = gemm_args(a, w, torch_weight(w), wt.make_workspace(DEV))
    via_dispatcher = OPS.marlin_gemm.default._op.through_dispatcher(*args)
    via_packet, via_default = OPS.marlin_gemm(*args), OPS.marlin_gemm.default(*args)
    via_bypass = wt.marlin_gemm(*args)
    compiled = torch.compile(lambda *xs: OPS.marlin_gemm(*xs), fullgraph=True)(*args)
    for other in (via_packet, via_default, via_bypass, compiled):
        assert torch.equal(via_dispatcher, other)
    base = torch.empty(9 * 256 + 1, device=DEV, dtype=torch.float16)
    misaligned = base[1:].view(9, 256)  # equal shape, strides and dtype: the plan cache's key; 2-byte aligned
    misaligned.copy_(a)
    with pytest.raises(ValueError, match="aligned to 16 bytes"):
        OPS.marlin_gemm(misaligned, *args[1:])


def test_module_to_cuda_and_state_dict_round_trip_on_the_gpu(tmp_path):
    """A layer moved with .to('cuda') computes what a layer built from its saved state dict computes (bit for bit);
    the state dict saved from the GPU loads into a fresh CPU-built module."""
    w, _ = random_marlin_weight(256, 128, S.U4, 64, act_order=True)
    layer = wt.MarlinLinear.from_weight(w, torch.randn(128).half()).to(DEV)
    assert all(b.device.type == "cuda" for b in layer.buffers())
    x = torch.randn(5, 256, device=DEV).half()
    torch.save(layer.state_dict(), tmp_path / "layer.pt")
    fresh = wt.MarlinLinear(256, 128, "u4", 64, bias=True, act_order=True)
    fresh.load_state_dict(torch.load(tmp_path / "layer.pt"))
    assert all(b.device.type == "cpu" for b in fresh.buffers())
    assert torch.equal(fresh.to(DEV)(x), layer(x))


# ---------------------------------------------------------------------------------------------------------------
# shapes that are not tile multiples (docs/formats.md): padded buffers, the true sizes to the kernel
# ---------------------------------------------------------------------------------------------------------------
# (K, N, type, group, act-order): N inside a 64-column tile, K a partial k16 tile and a partial last group, K below
# one pipeline step, an act-order partial group, block-FP8 partial blocks, an 8-bit K that ends inside a 16-byte
# chunk of fp16 rows (MarlinLinear passes such rows as a view of padded ones)
ODD_CASES = [(200, 100, S.U4B8, 128, False), (1000, 200, S.U4, 64, False), (40, 96, S.U8B128, -1, False),
             (312, 72, S.U4B8, 128, True), (200, 100, S.FE4M3FN, 128, False), (264, 136, S.U8B128, 32, False),
             (36, 100, S.U8B128, 32, False)]


def cupy_rows(x):
    """x (M, K) as a CuPy view of rows padded with NaN to a multiple of 8 (the GEMM's 16-byte rows; it must not read
    past K), as MarlinLinear hands a K that ends inside a chunk to the op."""
    m, k = x.shape
    buf = cp.full((m, -(-k // 8) * 8), np.nan, dtype=np.float16)
    buf[:, :k] = cp.asarray(x.cpu().numpy())
    return buf[:, :k]


@pytest.mark.parametrize("k,n,wt_type,group,act_order", ODD_CASES, ids=str)
@pytest.mark.parametrize("m", [1, 33])
def test_odd_shape_marlin_linear_against_the_fp32_reference(k, n, wt_type, group, act_order, m):
    """y (M, N) = x @ w_ref + bias within the GEMM's bound, and bit for bit what the CuPy entry point computes on
    the same padded weight (one kernel, one tile choice, the fp32 lock-ordered reduction). Tolerance (reason):
    |y - ref| <= c (|x| @ |w_ref|) + u |bias|, c = gemm.error_bound_factor (the output's one rounding, the weight
    rounding a late-scaling kernel leaves out, fp32 tensor-core accumulation), u |bias| the output rounding the bias
    goes through."""
    w, q = random_marlin_weight(k, n, wt_type, group, act_order=act_order, seed=k + n + m)
    w.require_padded_arrays()
    bias = (torch.randn(n) * 0.1).half()
    layer = wt.MarlinLinear.from_weight(w, bias).to(DEV)
    x = (torch.randn(m, k, device=DEV) * 0.5).half()
    y = layer(x)
    assert tuple(y.shape) == (m, n) and y.is_contiguous()
    got = y.float().cpu().numpy()
    assert np.all(np.isfinite(got))
    xf = x.float().cpu().numpy()
    ref = xf @ q.w_ref + bias.float().numpy()
    u = gemm.UNIT_ROUNDOFF["float16"]
    bound = (gemm.error_bound_factor(np.float16, k) * (np.abs(xf) @ np.abs(q.w_ref))
             + u * np.abs(bias.float().numpy()) + 1e-30)
    err = np.abs(got - ref)
    assert np.all(err <= bound), f"max err {err.max()} (bound there {bound.flat[np.argmax(err - bound)]})"
    # (the mma.sync family, as the op's prepared launch: the CuPy entry point may route other shapes to wgmma)
    cupy_y = gemm.marlin_gemm(cupy_rows(x), gemm.upload_weight(w), use_fp32_reduce=True,
                              bias=cp.asarray(bias.numpy()), family="mma_sync")
    assert np.array_equal(y.cpu().numpy().view(np.uint16), cp.asnumpy(cupy_y).view(np.uint16))


def test_odd_shape_out_op_writes_exactly_size_n_columns():
    """c (M, size_n) starts as NaN: every element is written, and the op's padded arrays never widen it."""
    k, n, m = 200, 100, 17
    w, _ = random_marlin_weight(k, n, S.U4B8, 128, seed=2)
    a = torch.randn(m, k, device=DEV).half()
    c = torch.full((m, n), float("nan"), device=DEV, dtype=torch.float16)
    assert wt.marlin_gemm(*gemm_args(a, w, torch_weight(w), wt.make_workspace(DEV), c=c)) is c
    assert bool(torch.isfinite(c).all())
    assert torch.equal(c, OPS.marlin_gemm(*gemm_args(a, w, torch_weight(w), wt.make_workspace(DEV))))


# ---------------------------------------------------------------------------------------------------------------
# batch invariance through the ops (docs/performance.md, "Batch invariance")
# ---------------------------------------------------------------------------------------------------------------
INVARIANT_CASES = [(1024, 512, S.U4B8, 128, False), (1000, 200, S.U4B8, 128, False), (1024, 512, S.U4, 64, True),
                   (1024, 512, S.FE4M3FN, -1, False)]


@pytest.mark.parametrize("k,n,wt_type,group,act_order", INVARIANT_CASES, ids=str)
def test_batch_invariant_rows_through_the_op_and_the_module(k, n, wt_type, group, act_order, rng):
    """A probe row's output bits alone (M = 1) and at a random position of batches of fresh rows (every M class:
    one m16 block, several, 64-row launches) are the same, through torch.ops.workbench.marlin_gemm(...,
    batch_invariant=True), the Python function, and MarlinLinear(batch_invariant=True); and they equal what the CuPy
    entry point computes in that mode (bitwise: the same launch)."""
    w, _ = random_marlin_weight(k, n, wt_type, group, act_order=act_order, seed=int(rng.integers(1 << 20)))
    tensors, ws = torch_weight(w), wt.make_workspace(DEV)
    layer = wt.MarlinLinear.from_weight(w, batch_invariant=True).to(DEV)
    probe = (torch.randn(1, k, device=DEV) * 0.5).half()
    alone = OPS.marlin_gemm(*gemm_args(probe, w, tensors, ws), batch_invariant=True)
    cupy_alone = gemm.marlin_gemm(cp.asarray(probe.cpu().numpy()), gemm.upload_weight(w), use_fp32_reduce=True,
                                  batch_invariant=True, family="mma_sync")
    assert np.array_equal(alone.cpu().numpy().view(np.uint16), cp.asnumpy(cupy_alone).view(np.uint16))
    assert torch.equal(layer(probe), alone)
    for m in (5, 17, 64, 130):
        batch = (torch.randn(m, k, device=DEV) * 0.5).half()
        row = int(rng.integers(m))
        batch[row] = probe[0]
        for out in (OPS.marlin_gemm(*gemm_args(batch, w, tensors, ws), batch_invariant=True),
                    wt.marlin_gemm(*gemm_args(batch, w, tensors, ws), batch_invariant=True, deterministic=True),
                    layer(batch)):
            assert torch.equal(out[row], alone[0]), (
                f"M = {m}, row {row}: {int((out[row] != alone[0]).sum())} of {n} outputs differ from M = 1")


def test_batch_invariant_and_default_calls_of_one_shape_keep_their_own_plans():
    """The mode is part of the op's plan key: a default call after an invariant one of the same shapes runs the
    default launch (bit for bit the CuPy default), and the invariant one again its own."""
    w, _ = random_marlin_weight(1024, 512, S.U4B8, 128, seed=9)
    a = (torch.randn(9, 1024, device=DEV) * 0.5).half()
    args, up = gemm_args(a, w, torch_weight(w), wt.make_workspace(DEV)), gemm.upload_weight(w)
    a_cp = cp.asarray(a.cpu().numpy())
    for flags in ({"batch_invariant": True}, {}, {"batch_invariant": True}, {}):
        out = OPS.marlin_gemm(*args, **flags)
        ref = gemm.marlin_gemm(a_cp, up, use_fp32_reduce=True, family="mma_sync", **flags)
        assert np.array_equal(out.cpu().numpy().view(np.uint16), cp.asnumpy(ref).view(np.uint16)), flags


def test_moe_gemm_op_batch_invariant_equals_the_fused_phase_in_that_mode_bitwise(rng):
    c = MoECase(rng)
    out = OPS.moe_wna16_marlin_gemm(*c.args, batch_invariant=True)
    torch.library.opcheck(OPS.moe_wna16_marlin_gemm.default, c.args, {"batch_invariant": True})
    assert np.array_equal(bits16(out), c.fused_phase(batch_invariant=True))
