"""The wgmma kernel family (workbench.gemm.hopper, kernels_cuda/hopper_gemm.cu) on an sm_90 GPU, against the fp32
NumPy reference ``a.astype(f32) @ q.w_ref`` and against the mma.sync kernel.

Order: identity activations (the output *is* the dequantized weight: exact), arange-coded weights on inputs whose
fp32 sums are exact (exact, and bit for bit the mma.sync kernel's), random data over M = 32..1024 with odd M and
both grids (split K over blocks and not), then the dispatch (policy table, forced families, clear refusals).
Outputs are poisoned (NaN) before every launch so an unwritten element fails.
"""
import dataclasses

import numpy as np
import pytest

from workbench import gemm, hardware
from workbench.gemm import hopper
from workbench.policy import DEFAULT_GEMM_POLICY
from workbench.quantize import dequantize
from workbench.scalar_types import ScalarType as S
from workbench.weight import make_marlin_weight, random_marlin_weight

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not hardware.cupy_available(), reason="no CUDA GPU visible to CuPy")]

cp = pytest.importorskip("cupy")
F16 = np.dtype(np.float16)


@pytest.fixture(scope="module", autouse=True)
def sm90():
    cc = gemm.device_properties(cp.cuda.Device().id)[0]
    if cc != 90:
        pytest.skip(f"the wgmma family runs on sm_90a only; this GPU is compute capability {cc // 10}.{cc % 10}")


def run(a_host, w_dev, sms=-1, family="wgmma", policy=None):
    """Upload a, launch into a poisoned C, return C on the host as float32 (and check the split-K counters are
    left zero for the next launch)."""
    a = cp.asarray(a_host)
    c = cp.full((a.shape[0], w_dev.size_n), np.nan, dtype=a.dtype)
    out = gemm.marlin_gemm(a, w_dev, c=c, sms=sms, family=family, policy=policy)
    assert out is c
    for scratch in hopper._scratch.values():
        if isinstance(scratch.counters, cp.ndarray):  # (the torch test checks its own)
            assert int(cp.count_nonzero(scratch.counters)) == 0, "split-K counters must be left zero"
    return cp.asnumpy(out).astype(np.float32)


def bound(a, w_ref, k):
    """|C - ref| bound per element, S = |a| @ |w_ref| bounding every partial sum: one rounding of the output to fp16
    (u S; the split-K partials stay fp32) and fp32 tensor-core accumulation, which aligns products before adding
    (K 2^-22 S); the weight is rounded to fp16 after its scale as in w_ref, so no term for it."""
    s = np.abs(a.astype(np.float32)) @ np.abs(w_ref)
    return gemm.error_bound_factor(F16, k, output_roundings=1, weight_rounding=False) * s + 1e-30


@pytest.mark.parametrize("gs", [64, 128])
@pytest.mark.parametrize("m,i0", [(32, 0), (33, 5), (64, 900), (100, 17), (128, 256), (250, 3), (1024, 0)])
def test_identity_rows_give_the_dequantized_weight_exactly(m, i0, gs):
    k, n = 1024 + 128, 512  # 9 stages of 128: splits of unequal length
    mw, q = random_marlin_weight(k, n, S.U4B8, gs, act_dtype=F16, seed=m + gs)
    w_dev = gemm.upload_weight(mw)
    eye = np.eye(k, dtype=np.float32).astype(F16)
    for sms in (-1, 2):  # split K over blocks, and one block per tile
        out = run(eye[i0:i0 + m], w_dev, sms=sms)
        # exact: each output is one product 1 * w (exact in fp32), every other partial sum an exact zero, and w is
        # representable in fp16
        np.testing.assert_array_equal(out, q.w_ref[i0:i0 + m], err_msg=f"M={m} rows from {i0}, sms={sms}")


@pytest.mark.parametrize("m", [32, 33, 64, 96, 128, 129, 256, 511, 1024])
@pytest.mark.parametrize("k,n", [(4096, 512), (1024, 2048)])
def test_random_data_within_the_fp32_accumulation_bound(m, k, n):
    mw, q = random_marlin_weight(k, n, S.U4B8, 128, act_dtype=F16, seed=m + k)
    w_dev = gemm.upload_weight(mw)
    a = (np.random.default_rng(m).standard_normal((m, k)) * 0.5).astype(F16)
    ref = a.astype(np.float32) @ q.w_ref
    for sms in (-1, 3):
        out = run(a, w_dev, sms=sms)
        assert np.isfinite(out).all()
        err = np.abs(out - ref)
        b = bound(a, q.w_ref, k)
        assert (err <= b).all(), f"M={m} sms={sms}: worst error / bound = {np.max(err / b):.3g}"


def test_split_k_is_deterministic():
    k, n, m = 8192, 512, 64
    mw, _ = random_marlin_weight(k, n, S.U4B8, 128, act_dtype=F16, seed=7)
    w_dev = gemm.upload_weight(mw)
    a = (np.random.default_rng(8).standard_normal((m, k))).astype(F16)
    assert hopper.grid(m, n, k, 64, gemm.device_properties(0)[1], DEFAULT_GEMM_POLICY)[2] > 1
    first = run(a, w_dev)
    for _ in range(3):
        np.testing.assert_array_equal(run(a, w_dev), first)


def exact_weight(k, n, gs, seed):
    """Weights whose products with small integers sum exactly in fp32: codes arange-coded (code of (k, n) =
    (k + 3 n) % 16, so a misplaced element changes the sum) and power-of-two scales 2^-2 .. 2^1."""
    rng = np.random.default_rng(seed)
    _, q = random_marlin_weight(k, n, S.U4B8, gs, act_dtype=F16, seed=seed)
    codes = ((np.arange(k)[:, None] + 3 * np.arange(n)[None, :]) % 16).astype(np.uint8)
    scales = (2.0 ** rng.integers(-2, 2, size=q.scales.shape)).astype(F16)
    w_ref = dequantize(codes, scales, None, S.U4B8, gs, act_dtype=F16)
    q = dataclasses.replace(q, codes=codes, scales=scales, w_ref=w_ref)
    return make_marlin_weight(q), q


@pytest.mark.parametrize("m", [32, 47, 64, 128, 256, 512])
def test_arange_coded_weights_exact_and_equal_to_the_mma_sync_kernel(m):
    k, n = 2048, 768
    mw, q = exact_weight(k, n, 128, seed=m)
    w_dev = gemm.upload_weight(mw)
    rng = np.random.default_rng(m + 1)
    a = rng.integers(-3, 4, size=(m, k)).astype(F16)
    # exact: |sum| <= 3 * 8 * 2 * 2048 < 2^17 in multiples of 2^-2, so every partial sum is exact in fp32; the output
    # is rounded to fp16 once, the same rounding in both families
    ref = (a.astype(np.float32) @ q.w_ref).astype(F16).astype(np.float32)
    out = run(a, w_dev)
    np.testing.assert_array_equal(out, ref)
    np.testing.assert_array_equal(out, run(a, w_dev, family="mma_sync"))


def test_the_default_policy_keeps_mma_sync_and_the_table_routes():
    k, n, m = 1024, 512, 64
    mw, q = random_marlin_weight(k, n, S.U4B8, 128, act_dtype=F16, seed=3)
    w_dev = gemm.upload_weight(mw)
    assert hopper.choose_family(0, m) == "mma_sync"
    table = dataclasses.replace(DEFAULT_GEMM_POLICY, kernel_families=((90, 32, 1024, "wgmma"),))
    assert hopper.choose_family(0, m, table) == "wgmma"
    assert hopper.choose_family(0, 16, table) == "mma_sync"
    assert hopper.choose_family(0, m, table, family="mma_sync") == "mma_sync"
    a = (np.random.default_rng(4).standard_normal((m, k))).astype(F16)
    np.testing.assert_array_equal(run(a, w_dev, family=None, policy=table), run(a, w_dev, family="wgmma"))
    # a type the family does not take: the table leaves it with mma.sync, forcing the family names why
    mw8, q8 = random_marlin_weight(k, n, S.U8B128, 128, act_dtype=F16, seed=5)
    w8 = gemm.upload_weight(mw8)
    out = run(a, w8, family=None, policy=table)
    assert (np.abs(out - a.astype(np.float32) @ q8.w_ref) <= 2 * bound(a, q8.w_ref, k)).all()
    with pytest.raises(ValueError, match="u4b8 weights so far, not u8b128"):
        run(a, w8, family="wgmma")
    with pytest.raises(ValueError, match="family = 'tcgen05'"):
        run(a, w_dev, family="tcgen05")


def test_torch_tensors_give_the_cupy_result_bit_for_bit():
    """Torch tensors go through views of the same plan; outputs and split-K scratch come from torch's allocator,
    on torch's current stream."""
    torch = pytest.importorskip("torch")
    k, n, m = 4096, 512, 48
    mw, _ = random_marlin_weight(k, n, S.U4B8, 128, act_dtype=F16, seed=11)
    w_cp = gemm.upload_weight(mw)
    a = (np.random.default_rng(12).standard_normal((m, k))).astype(F16)
    want = run(a, w_cp)
    w_t = dataclasses.replace(w_cp, qweight=torch.as_tensor(w_cp.qweight, device="cuda"),
                              scales=torch.as_tensor(w_cp.scales, device="cuda"))
    a_t = torch.from_numpy(a).cuda()
    c_t = torch.full((m, n), float("nan"), dtype=torch.float16, device="cuda")
    assert gemm.marlin_gemm(a_t, w_t, c=c_t, family="wgmma") is c_t
    fresh = gemm.marlin_gemm(a_t, w_t, family="wgmma")
    assert isinstance(fresh, torch.Tensor)
    torch.cuda.synchronize()
    np.testing.assert_array_equal(c_t.float().cpu().numpy(), want)
    np.testing.assert_array_equal(fresh.float().cpu().numpy(), want)
    for scratch in hopper._scratch.values():
        if isinstance(scratch.counters, torch.Tensor):
            assert int(torch.count_nonzero(scratch.counters)) == 0
