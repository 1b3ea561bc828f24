"""The fused MoE GEMM and the batched phase on shapes that are not tile multiples, with the per-expert bias, on a real
GPU (docs/formats.md, "Shapes that are not tile multiples"). Weights: tests/gpu/test_gemm_odd.py odd_weight (the
storage rule's padded arrays of random codes); references and tolerances: tests/gpu/test_moe.py phase_reference, plus
the bias's rounding (reasons beside them). Outputs are poisoned with NaN; A's columns past K are NaN too.
"""
import numpy as np
import pytest

from workbench import gemm, hardware, moe
from workbench.formats import moe_align as align_ref
from workbench.scalar_types import ScalarType as S

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not hardware.cupy_available(), reason="no CUDA GPU visible to CuPy")]

cp = pytest.importorskip("cupy")

from gpu.test_gemm_odd import odd_weight  # noqa: E402  (tests/ is on the pytest pythonpath)
from gpu.test_moe import phase_reference, routing  # noqa: E402

F16 = np.dtype(np.float16)
U = moe.UNIT_ROUNDOFF


@pytest.mark.parametrize("wt,gs,k,n", [(S.U4B8, 128, 10944, 200), (S.U4, 64, 200, 97), (S.U8B128, -1, 4100, 200),
                                       (S.FE4M3FN, 128, 1000, 130)], ids=str)
def test_fused_phase_odd_shapes_and_bias(wt, gs, k, n, rng):
    """The fused kernel on odd N and K (partial last group, 8-bit K ending mid-chunk with A's rows padded by NaN
    that must not be read), with a per-expert bias (E, N) added before the router weight: C[i] = rnd(w_i (a @ W[e] +
    bias[e])). Tolerance: phase_reference's, plus one rounding of w |bias|."""
    e, m, top_k = 4, 21, 2
    act = F16
    experts = [odd_weight(k, n, wt, gs, act, seed=int(rng.integers(1 << 20))) for _ in range(e)]
    stack = moe.MarlinExpertStack(gemm.upload_weight(moe.stack_marlin_weights([w for w, _ in experts])))
    w_ref = np.stack([r for _, r in experts])
    bias = (rng.standard_normal((e, n)) * 2).astype(act)
    a = rng.standard_normal((m, k), dtype=np.float32).astype(act)
    buf = np.full((m, -(-k // 8) * 8 + 8), np.nan, act)
    buf[:, :k] = a
    ids, weights = routing(rng, m, top_k, e)
    u = U[np.dtype(act).name]
    refs = {}  # (the references do not depend on the block size)
    for mul, with_bias in ((False, True), (True, True), (True, False)):
        wf = weights.reshape(-1) if mul else None
        ref, bound = phase_reference(a, w_ref, ids.reshape(-1), top_k, wf, act)
        if with_bias:
            flat = ids.reshape(-1)
            scale = np.ones(flat.size, np.float32) if wf is None else wf
            exact = np.stack([scale[i] * (a[i // top_k].astype(np.float32) @ w_ref[flat[i]] +
                                          bias[flat[i]].astype(np.float32)) for i in range(flat.size)])
            ref = exact.astype(act).astype(np.float32)
            bound = bound + 2 * u * np.abs(scale)[:, None] * np.abs(bias[flat].astype(np.float32))
        refs[mul, with_bias] = ref, bound
    for block in (8, 16, 64):
        sorted_ids, expert_ids, post = align_ref.moe_align_block_size(ids, block, e)
        for (mul, with_bias), (ref, bound) in refs.items():
            out = cp.full((m * top_k, n), np.nan, dtype=act)
            stack.gemm_phase_fused(cp.asarray(buf)[:, :k], cp.asarray(sorted_ids), cp.asarray(expert_ids),
                                   cp.asarray(post), out, m, block, top_k,
                                   topk_weights=cp.asarray(weights) if mul else None,
                                   bias=cp.asarray(bias) if with_bias else None)
            got = cp.asnumpy(out).astype(np.float32)
            where = f"block={block} mul={mul} bias={with_bias}"
            assert np.all(np.isfinite(got)), f"{where}: unwritten rows"
            assert np.all(np.abs(got - ref) <= bound), f"{where}: max err {np.max(np.abs(got - ref))}"


def test_batched_phase_with_bias_and_odd_n(rng):
    """gemm_phase_batched's per-expert bias through the dense GEMM's epilogue, on an odd N."""
    e, k, n = 3, 10944, 97
    experts = [odd_weight(k, n, S.U4B8, 128, F16, seed=int(rng.integers(1 << 20))) for _ in range(e)]
    stack = moe.MarlinExpertStack(gemm.upload_weight(moe.stack_marlin_weights([w for w, _ in experts])))
    bias = (rng.standard_normal((e, n)) * 2).astype(F16)
    a = rng.standard_normal((20, k), dtype=np.float32).astype(F16)
    out = cp.full((20, n), np.nan, dtype=F16)
    dispatches = [(0, 0, 0, 5), (2, 5, 5, 9), (1, 14, 14, 6)]
    stack.gemm_phase_batched(cp.asarray(a), dispatches, out, bias=cp.asarray(bias))
    got = cp.asnumpy(out).astype(np.float32)
    u = U["float16"]
    for ex, r0, _, rows in dispatches:
        x = a[r0:r0 + rows].astype(np.float32)
        ref = x @ experts[ex][1] + bias[ex].astype(np.float32)
        bound = (2 * u + k * 2.0 ** -22) * (np.abs(x) @ np.abs(experts[ex][1])) + u * np.abs(ref)
        assert np.all(np.abs(got[r0:r0 + rows] - ref) <= bound), ex
