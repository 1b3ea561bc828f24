"""GPU tier: the device-side value checks of issue 26 under the real compiler's integer semantics.

The simulator runs kernels with NumPy scalars; compiled Numba widens and wraps differently (tooling.md), so the
bounds test of ``perm_row`` (``0 <= v < K`` on int32), the repeat count of ``check_perm_kernel_source`` and the
code-range test of the zero-point kernel (``uint32(code) > mask``) are checked here on real hardware, with device
perms at a real K. Skipped with a reason without a GPU.
"""
import numpy as np
import pytest

from workbench import hardware

pytestmark = pytest.mark.gpu
if hardware.gpu_skip_reason():
    pytest.skip(hardware.gpu_skip_reason(), allow_module_level=True)

from numba import cuda  # noqa: E402

from kernels_numba import marlin_repack as kr  # noqa: E402
from kernels_numba._launch import poison_outputs  # noqa: E402
from workbench import ops  # noqa: E402
from workbench.formats import packing  # noqa: E402

K, N = 4096, 512


@pytest.fixture
def weights():
    rng = np.random.default_rng(26)
    codes = rng.integers(0, 16, size=(K, N), dtype=np.uint8)
    return packing.pack_rows(codes, 4), rng.permutation(K).astype(np.int32)


@pytest.mark.parametrize("bad,message", [(K, rf"perm\[1234\] = {K} is outside \[0, {K}\)"),
                                         (-1, r"perm\[1234\] = -1 is outside"),
                                         (-2 ** 31, r"perm\[1234\] = -2147483648 is outside"),
                                         (2 ** 31 - 1, r"perm\[1234\] = 2147483647 is outside"),
                                         ("repeat", r"appears 2 times")])
@pytest.mark.parametrize("op", ["repack", "inverse"])
def test_a_bad_device_perm_is_refused_after_a_device_check(weights, bad, message, op):
    q, perm = weights
    marlin = ops.gptq_marlin_repack(q, perm, K, N, 4, backend="numba")
    bad_perm = perm.copy()
    bad_perm[1234] = perm[1235] if bad == "repeat" else bad
    with pytest.raises(ValueError, match=message):
        if op == "repack":
            ops.gptq_marlin_repack(cuda.to_device(q), cuda.to_device(bad_perm), K, N, 4, backend="numba")
        else:
            ops.marlin_to_gptq_qweight(cuda.to_device(marlin), cuda.to_device(bad_perm), K, N, 4, backend="numba")
    cuda.synchronize()  # an out-of-bounds access would surface here as a CUDA error, not a ValueError
    good = ops.gptq_marlin_repack(cuda.to_device(q), cuda.to_device(perm), K, N, 4, backend="numba")
    assert np.array_equal(np.asarray(good.get() if hasattr(good, "get") else good.copy_to_host()), marlin)


@pytest.mark.parametrize("bits", [4, 8])
def test_perm_kernels_launched_directly_with_wild_perms_do_not_fault(bits):
    """No wrapper check in between: rows outside [0, K) must read row 0, never out of bounds (a fault would
    poison the context and fail every later test, so the launches end with a synchronize)."""
    pf = 32 // bits
    src = cuda.to_device(np.arange(K // pf * N, dtype=np.uint32).reshape((1, K // pf, N)))
    out = cuda.device_array((1, K // 16, N * 16 // pf), np.uint32)
    for value in (K, -1, -2 ** 31, 2 ** 31 - 1):
        perm = cuda.to_device(np.full((1, K), value, np.int32))
        kr.weight_repack_launch(src, perm, out, bits, "gptq_perm", K, N, 0,
                                cuda.device_array((1, K, N // pf), np.uint32))()
        kr._perm_repack_kernel(bits)[kr.perm_grid(K, N, bits, 1), kr.DIRECT_THREADS](src, perm, out, N)
        inverse = cuda.device_array((1, K), np.int32)
        kr._invert_perm_kernel()[64, 256](perm, inverse)
        kr._gather_rows_kernel(bits)[64, 256](src, perm, cuda.device_array((1, K // pf, N), np.uint32))
        cuda.synchronize()


@pytest.mark.parametrize("bits,bad", [(4, 16), (4, 255), (8, None)])
def test_device_zero_point_codes_out_of_range_are_reported(bits, bad):
    rng = np.random.default_rng(6)
    zp = rng.integers(0, 1 << bits, size=(32, N), dtype=np.uint8)
    if bad is None:  # every uint8 fits 8 bits: nothing to report, and the result equals NumPy's
        with poison_outputs():
            got = ops.marlin_zero_points(cuda.to_device(zp), K, N, bits, backend="numba")
        got = got.get() if hasattr(got, "get") else got.copy_to_host()
        assert np.array_equal(got, ops.marlin_zero_points(zp, K, N, bits, backend="numpy"))
        return
    zp[17, 300] = bad
    with pytest.raises(ValueError, match=rf"zp\[17, 300\] = {bad} is outside the 4-bit code range"):
        ops.marlin_zero_points(cuda.to_device(zp), K, N, bits, backend="numba")


def _planned_entries(op_name: str) -> list:
    from workbench import backends

    return [plan for key, (plan, _) in backends._plans.items() if key[0] == op_name and plan is not None]


@pytest.mark.parametrize("framework", ["cupy", "torch"])
def test_a_bad_device_perm_is_refused_when_its_call_is_replayed(weights, framework):
    """A call plan keeps the verdict's read-back: a bad perm with the metadata of good ones (whose plan is then
    replayed) is still refused with the check's message, and the next good call returns the right tiles."""
    if framework == "cupy":
        cp = pytest.importorskip("cupy")
        on, back = cp.asarray, cp.asnumpy
    else:
        torch = pytest.importorskip("torch")
        on, back = (lambda a: torch.from_numpy(a).cuda()), (lambda t: t.cpu().numpy())
    q, perm = weights
    expected = ops.gptq_marlin_repack(q, perm, K, N, 4, backend="numpy")
    q_d = on(q)
    for _ in range(3):  # the first call records, the others replay
        assert np.array_equal(back(ops.gptq_marlin_repack(q_d, on(perm), K, N, 4, backend="numba")), expected)
    assert _planned_entries("gptq_marlin_repack"), "the act-order call was not planned"
    for bad, message in ((K, rf"perm\[1234\] = {K} is outside"), ("repeat", r"appears 2 times")):
        bad_perm = perm.copy()
        bad_perm[1234] = perm[1235] if bad == "repeat" else bad
        with pytest.raises(ValueError, match=message):
            ops.gptq_marlin_repack(q_d, on(bad_perm), K, N, 4, backend="numba")
    assert np.array_equal(back(ops.gptq_marlin_repack(q_d, on(perm), K, N, 4, backend="numba")), expected)


@pytest.mark.parametrize("framework", ["cupy", "torch"])
def test_bad_device_zero_points_are_refused_when_their_call_is_replayed(framework):
    if framework == "cupy":
        cp = pytest.importorskip("cupy")
        on, back = cp.asarray, cp.asnumpy
    else:
        torch = pytest.importorskip("torch")
        on, back = (lambda a: torch.from_numpy(a).cuda()), (lambda t: t.cpu().numpy())
    rng = np.random.default_rng(33)
    zp = rng.integers(0, 16, size=(32, N), dtype=np.uint8)
    expected = ops.marlin_zero_points(zp, K, N, 4, backend="numpy")
    for _ in range(3):
        assert np.array_equal(back(ops.marlin_zero_points(on(zp), K, N, 4, backend="numba")), expected)
    assert _planned_entries("marlin_zero_points"), "the zero-point call was not planned"
    bad = zp.copy()
    bad[17, 300] = 16
    with pytest.raises(ValueError, match=r"zp\[17, 300\] = 16 is outside the 4-bit code range"):
        ops.marlin_zero_points(on(bad), K, N, 4, backend="numba")
    v1 = packing.pack_cols(rng.integers(0, 15, size=(32, N), dtype=np.uint8), 4)  # no all-ones field
    expected = ops.repack_gptq_qzeros_to_marlin(v1, K, N, K // 32, 4, backend="numpy")
    for _ in range(3):
        assert np.array_equal(back(ops.repack_gptq_qzeros_to_marlin(on(v1), K, N, K // 32, 4, backend="numba")),
                              expected)
    v1_bad = v1.copy()
    v1_bad[5, 7] |= np.int32(0xF << 8)  # an all-ones stored field: zero 16 does not fit 4 bits
    with pytest.raises(ValueError, match=r"qzeros group=5 packed_col=7 lane=2 has code 15"):
        ops.repack_gptq_qzeros_to_marlin(on(v1_bad), K, N, K // 32, 4, backend="numba")
