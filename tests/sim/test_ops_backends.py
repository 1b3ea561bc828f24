"""The public ops route backend='numba' to the kernels and agree with backend='numpy' bit for bit (inverses and the
stacked-experts loader included)."""
import numpy as np

from workbench import ops
from workbench.formats import packing


def test_inverse_ops_through_the_kernels(rng):
    k, n = 32, 128
    codes = rng.integers(0, 16, size=(k, n), dtype=np.uint8)
    perm = rng.permutation(k).astype(np.int32)
    marlin = ops.gptq_marlin_repack(packing.pack_rows(codes, 4), perm, k, n, 4, backend="numba")
    for backend in ("numba", "numpy"):
        assert np.array_equal(ops.marlin_to_gptq_qweight(marlin, perm, k, n, 4, backend=backend),
                              packing.pack_rows(codes, 4))
    plain = ops.gptq_marlin_repack(packing.pack_rows(codes, 4), None, k, n, 4, backend="numpy")
    assert np.array_equal(ops.marlin_to_awq_qweight(plain, k, n, 4, backend="numba"), packing.awq_pack(codes, 4))
    zeros = rng.integers(1, 15, size=(2, n), dtype=np.uint8)
    zp = ops.marlin_zero_points(zeros, k, n, 4, backend="numba")
    assert np.array_equal(ops.marlin_zero_points_to_codes(zp, k, n, 4, backend="numba"), zeros)
    assert np.array_equal(ops.marlin_to_gptq_qzeros(zp, k, n, 16, 4, backend="numba"), packing.pack_cols(zeros - 1, 4))
    s = rng.standard_normal((2, n)).astype(np.float16)
    sp = ops.marlin_permute_scales(s, k, n, 16, backend="numba")
    assert np.array_equal(ops.marlin_unpermute_scales(sp, k, n, 16, backend="numba"), s)
    qz = packing.pack_cols(np.full((2, n), 7, np.uint8), 4)
    assert ops.gptq_qzeros_are_symmetric_code7(qz, backend="numba")


def test_stacked_experts_loader_through_the_kernels(rng):
    E, k, n, g = 3, 32, 64, 16
    qweights = [packing.pack_rows(rng.integers(0, 16, size=(k, n), dtype=np.uint8), 4) for _ in range(E)]
    scales = [rng.uniform(0.01, 0.1, size=(k // g, n)).astype(np.float16) for _ in range(E)]
    qzeros = [packing.pack_cols(rng.integers(0, 15, size=(k // g, n), dtype=np.uint8), 4) for _ in range(E)]
    ref = ops.stack_gptq_experts_to_marlin(qweights, scales, qzeros, 4, g, k, n, backend="numpy")
    got = ops.stack_gptq_experts_to_marlin(qweights, scales, qzeros, 4, g, k, n, backend="numba")
    assert got.weight_type == ref.weight_type and got.num_experts == E
    for name in ("qweight", "scales", "zeros"):
        assert np.array_equal(np.asarray(getattr(got, name)).view(np.uint8), getattr(ref, name).view(np.uint8)), name


# ---------------------------------------------------------------------------------------------------------------
# regressions of issue 26 on the Numba backend (each failed before the shared checks)
# ---------------------------------------------------------------------------------------------------------------
import pytest  # noqa: E402
from numba import cuda  # noqa: E402

from kernels_numba import marlin_repack as kr  # noqa: E402
from kernels_numba import scales as ks  # noqa: E402
from kernels_numba._launch import poison_outputs  # noqa: E402
from workbench.formats import fp8  # noqa: E402

K, N = 32, 64


def _gptq(rng, bits=4):
    codes = rng.integers(0, 1 << bits, size=(K, N), dtype=np.uint8)
    return packing.pack_rows(codes, bits)


def test_big_endian_perm_repacks_like_the_native_perm(rng):
    """Defect 3: a >i4 perm was uploaded as raw bytes and the kernel indexed with byte-swapped rows."""
    q, perm = _gptq(rng), rng.permutation(K).astype(np.int32)
    expected = ops.gptq_marlin_repack(q, perm, K, N, 4, backend="numpy")
    with poison_outputs():
        got = ops.gptq_marlin_repack(q, perm.astype(">i4"), K, N, 4, backend="numba")
        back = ops.marlin_to_gptq_qweight(expected, perm.astype(">i4"), K, N, 4, backend="numba")
    assert np.array_equal(got, expected)
    assert np.array_equal(back, q)


@pytest.mark.parametrize("backend", ["numpy", "numba"])
@pytest.mark.parametrize("op", ["repack", "inverse"])
def test_perm_offset_by_2_to_the_32_is_refused(rng, backend, op):
    """Defect 3: int64 perm + 2^32 was cast to int32 (wrapping into range) before the check, and accepted."""
    q, perm = _gptq(rng), rng.permutation(K).astype(np.int64)
    i = int(np.flatnonzero(perm == 5)[0])
    perm[i] += 2 ** 32
    call = ops.gptq_marlin_repack if op == "repack" else ops.marlin_to_gptq_qweight
    with pytest.raises(ValueError, match=rf"perm\[{i}\] = 4294967301 is outside \[0, 32\)"):
        call(q if op == "repack" else ops.gptq_marlin_repack(q, None, K, N, 4), perm, K, N, 4, backend=backend)


@pytest.mark.parametrize("bad,message", [(100, r"perm\[{i}\] = 100 is outside \[0, 32\)"),
                                         (-7, r"perm\[{i}\] = -7 is outside \[0, 32\)"),
                                         ("repeat", r"not a permutation of range\(32\): {v} appears 2 times")])
@pytest.mark.parametrize("op", ["repack", "inverse"])
def test_device_perm_is_checked_on_the_device_with_the_host_message(rng, bad, message, op):
    """A device perm is checked by a kernel (no K-sized copy back); the message is the host check's."""
    q = _gptq(rng)
    marlin = ops.gptq_marlin_repack(q, None, K, N, 4)
    perm = rng.permutation(K).astype(np.int32)
    i = 9
    v = int(perm[i + 1])
    perm[i] = v if bad == "repeat" else bad
    pattern = message.format(i=i, v=v)
    with pytest.raises(ValueError, match=pattern):
        ops.gptq_marlin_repack(q, perm, K, N, 4, backend="numpy") if op == "repack" else \
            ops.marlin_to_gptq_qweight(marlin, perm, K, N, 4, backend="numpy")
    with pytest.raises(ValueError, match=pattern):
        if op == "repack":
            ops.gptq_marlin_repack(cuda.to_device(q), cuda.to_device(perm), K, N, 4, backend="numba")
        else:
            ops.marlin_to_gptq_qweight(cuda.to_device(marlin), cuda.to_device(perm), K, N, 4, backend="numba")


@pytest.mark.parametrize("bits", [4, 8])
def test_no_perm_kernel_reads_out_of_bounds_whatever_the_perm_holds(rng, bits):
    """The simulator raises IndexError on an out-of-bounds access: launch every kernel that reads rows through a
    perm directly (no wrapper check in between) with rows outside [0, K) and a perm full of repeats."""
    pf = 32 // bits
    src = cuda.to_device(_gptq(rng, bits).view(np.uint32).reshape((1, K // pf, N)))
    out = cuda.device_array((1, K // 16, N * 16 // pf), np.uint32)
    for values in (np.full(K, K + 5), np.full(K, -3), np.full(K, 2 ** 31 - 1), np.zeros(K)):
        perm = cuda.to_device(values.astype(np.int32).reshape((1, K)))
        kr.weight_repack_launch(src, perm, out, bits, "gptq_perm", K, N, 0,
                                cuda.device_array((1, K, N // pf), np.uint32))()  # the two-pass route
        kr._perm_repack_kernel(bits)[kr.perm_grid(K, N, bits, 1), kr.DIRECT_THREADS](src, perm, out, N)
        inverse = cuda.device_array((1, K), np.int32)
        kr._invert_perm_kernel()[1, 64](perm, inverse)
        kr._gather_rows_kernel(bits)[1, 64](src, perm, cuda.device_array((1, K // pf, N), np.uint32))


@pytest.mark.parametrize("where", ["host uint8", "host uint16", "device uint8"])
def test_zero_point_codes_out_of_range_raise_like_numpy(rng, where):
    """Defect 6: code 16 for 4-bit came back as zeros from the Numba backend (masked), 256 as uint16 wrapped."""
    zp = rng.integers(0, 16, size=(2, N), dtype=np.uint16 if where == "host uint16" else np.uint8)
    zp[1, 5] = 16 if where != "host uint16" else 256
    message = rf"zp\[1, 5\] = {int(zp[1, 5])} is outside the 4-bit code range \[0, 15\] \(1 such value"
    with pytest.raises(ValueError, match=message):
        ops.marlin_zero_points(zp, K, N, 4, backend="numpy")
    with pytest.raises(ValueError, match=message):
        ops.marlin_zero_points(cuda.to_device(zp) if where == "device uint8" else zp, K, N, 4, backend="numba")
    with pytest.raises(ValueError, match=message):  # the kernel wrapper itself, stacked experts included
        ks.marlin_zero_points(zp if where != "device uint8" else cuda.to_device(zp), K, N, 4)
    if where != "host uint16":
        with pytest.raises(ValueError, match=r"zp\[1, 1, 5\] = 16 is outside"):
            ks.marlin_zero_points(np.stack([zp * 0, zp]), K, N, 4)


def test_a_float_num_bits_is_refused_and_numpy_integers_work_afterwards(rng):
    """Defect 6: num_bits=4.0 reached the kernel caches (4.0 == 4, same hash) and later np.int64(4) calls failed;
    np.int64 failed in the zero-point kernels on its own (no .bit_length)."""
    q = _gptq(rng)
    zp = rng.integers(1, 15, size=(2, N), dtype=np.uint8)
    calls = {
        "gptq_marlin_repack": lambda b: ops.gptq_marlin_repack(q, rng.permutation(K).astype(np.int32), K, N, b,
                                                               backend="numba"),
        "marlin_zero_points": lambda b: ops.marlin_zero_points(zp, K, N, b, backend="numba"),
        "awq_to_marlin_zero_points": lambda b: ops.awq_to_marlin_zero_points(packing.awq_pack(zp, 4), K, N, b,
                                                                             backend="numba"),
        "marlin_zero_points_to_codes": lambda b: ops.marlin_zero_points_to_codes(
            ops.marlin_zero_points(zp, K, N, 4), K, N, b, backend="numba"),
    }
    for name, call in calls.items():
        with pytest.raises(TypeError, match="num_bits must be an int, got float 4.0"):
            call(4.0)
        for kernel_call in (lambda: ks.marlin_zero_points(zp, K, N, 4.0), lambda: kr.awq_marlin_repack(
                packing.awq_pack(zp, 4), 16, N, 4.0)):
            with pytest.raises(TypeError, match="num_bits must be an int"):
                kernel_call()
        call(np.int64(4))
        call(np.int32(4))


def test_float8_e4m3fn_input_repacks_on_the_numba_backend(rng):
    """Low: the docstring accepts float8_e4m3fn; the Numba wrapper reinterpreted it as uint16 and refused it."""
    raw = rng.integers(0, 256, size=(N, 128), dtype=np.uint8)
    expected = ops.block_fp8_group128_repack(raw, 128, N, backend="numpy")
    assert np.array_equal(ops.block_fp8_group128_repack(raw.view(fp8.E4M3), 128, N, backend="numba"), expected)


@pytest.mark.parametrize("layout", ["fortran", "strided", "big-endian"])
def test_odd_layouts_give_the_native_result_on_both_backends(rng, layout):
    """Low: F-order, strided and >i4 words were refused while >f2 scales were accepted; now all are converted once."""
    q = _gptq(rng)
    s = rng.standard_normal((2, N)).astype(np.float16)
    zp = rng.integers(0, 16, size=(2, N), dtype=np.uint8)

    def odd(a):
        if layout == "fortran":
            return np.asfortranarray(a)
        if layout == "strided":
            wide = np.zeros(a.shape[:-1] + (2 * a.shape[-1],), a.dtype)
            wide[..., ::2] = a
            return wide[..., ::2]
        return a.astype(a.dtype.newbyteorder(">")) if a.dtype.itemsize > 1 else a

    for backend in ("numpy", "numba"):
        assert np.array_equal(ops.gptq_marlin_repack(odd(q), None, K, N, 4, backend=backend),
                              ops.gptq_marlin_repack(q, None, K, N, 4))
        assert np.array_equal(ops.marlin_permute_scales(odd(s), K, N, 16, backend=backend),
                              ops.marlin_permute_scales(s, K, N, 16))
        assert np.array_equal(ops.marlin_zero_points(odd(zp.astype(np.int16)), K, N, 4, backend=backend),
                              ops.marlin_zero_points(zp, K, N, 4))


def test_scale_dtypes_and_v1_messages_are_the_same_on_both_backends(rng):
    """Found by tests/cpu/test_fuzz_ops.py: NumPy permuted int8 scales the kernel refused; the two backends named
    an unstorable zero point of 0 differently."""
    for backend in ("numpy", "numba"):
        with pytest.raises(TypeError, match="s must have dtype float16 or bfloat16 or float32, got int8"):
            ops.marlin_permute_scales(np.zeros((1, N), np.int8), K, N, -1, backend=backend)
        zeros = rng.integers(1, 16, size=(2, N), dtype=np.uint8)
        zeros[1, 7] = 0
        with pytest.raises(ValueError, match="zero point at group=1 column=7 is 0, which GPTQ v1 cannot store"):
            ops.marlin_to_gptq_qzeros(ops.marlin_zero_points(zeros, K, N, 4), K, N, 16, 4, backend=backend)
