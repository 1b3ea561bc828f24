"""Scales, zero points, block-FP8 scales and the stacked-experts loader: Numba kernels == NumPy references, bit
for bit, with poisoned outputs and fresh random data."""
import ml_dtypes
import numpy as np
import pytest
from numba import cuda

from kernels_numba import moe as kmoe
from kernels_numba import scales as ks
from kernels_numba._launch import poison_outputs
from workbench import ops
from workbench.formats import fp8 as fp8_fmt
from workbench.formats import gptq, packing
from workbench.formats import scales as sc

BF16 = np.dtype(ml_dtypes.bfloat16)
# (K, N, group_size): grouped (P64), channelwise (P32), one group G == K (P32), two chunks of 64 in a row
SCALE_CASES = [(128, 64, 32), (128, 128, -1), (128, 64, 128), (256, 192, 64)]


def _host(a):
    """A device result (CuPy, Numba or simulator array) -> NumPy; None stays None."""
    if a is None:
        return None
    return a.get() if hasattr(a, "get") else a.copy_to_host()


def _bits16(a):
    return np.ascontiguousarray(a).view(np.uint16 if np.dtype(a.dtype).itemsize == 2 else np.uint32)


@pytest.mark.parametrize("k,n,group_size", SCALE_CASES)
@pytest.mark.parametrize("dtype", [np.float16, BF16, np.float32])
def test_permute_and_unpermute_scales(k, n, group_size, dtype, rng):
    s = rng.standard_normal((sc.num_groups(k, group_size), n)).astype(dtype)
    with poison_outputs():
        got = ops.marlin_permute_scales(s, k, n, group_size, backend="numba")
        back = ks.marlin_unpermute_scales(got, k, n, group_size)
    assert got.dtype == np.dtype(dtype)
    assert np.array_equal(_bits16(got), _bits16(sc.permute_scales(s, k, n, group_size)))
    assert np.array_equal(_bits16(back), _bits16(s))


@pytest.mark.parametrize("act", [np.float16, BF16])
def test_permute_scales_with_float32_rounding(act, rng):
    k, n, g = 256, 128, 64
    s = (rng.standard_normal((k // g, n)) * 10.0 ** rng.integers(-9, 6, (k // g, n))).astype(np.float32)
    with poison_outputs():
        got = ks.marlin_permute_scales(s, k, n, g, out_dtype=act)
    with np.errstate(over="ignore"):  # values up to 1e5 overflow fp16 to inf on purpose: the kernel must agree
        expected = sc.permute_scales(s.astype(act), k, n, g)
    assert np.array_equal(_bits16(got), _bits16(expected))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("k,n,group_size", SCALE_CASES)
def test_zero_points_all_sources_and_inverses(bits, k, n, group_size, rng):
    ng = sc.num_groups(k, group_size)
    zp = rng.integers(0, 1 << bits, (ng, n), dtype=np.uint8)
    expected = sc.zero_points_to_marlin(zp, k, n, bits)
    with poison_outputs():
        assert np.array_equal(ops.marlin_zero_points(zp, k, n, bits, backend="numba"), expected)
        assert np.array_equal(ops.awq_to_marlin_zero_points(packing.awq_pack(zp, bits), k, n, bits,
                                                            backend="numba"), expected)
        assert np.array_equal(ks.marlin_zero_points_to_codes(expected, k, n, bits), zp)
        assert np.array_equal(ks.marlin_to_awq_zero_points(expected, k, n, bits), packing.awq_pack(zp, bits))
    zeros = rng.integers(1, 1 << bits, (ng, n), dtype=np.uint8)  # v1 can store zeros 1 .. 2^b - 1
    v1 = packing.pack_cols(zeros - np.uint8(1), bits)
    expected_v1 = gptq.repack_gptq_qzeros_to_marlin(v1, k, n, group_size, bits)
    with poison_outputs():
        got = ops.repack_gptq_qzeros_to_marlin(v1, k, n, group_size, bits, backend="numba")
        back = ks.marlin_to_gptq_qzeros(got, k, n, group_size, bits)
    assert np.array_equal(got, expected_v1)
    assert np.array_equal(back, v1)


@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_v1_all_ones_field_is_a_clear_error(bits, rng):
    k, n, g = 256, 128, 64
    pf = 32 // bits
    v1 = packing.pack_cols(rng.integers(0, (1 << bits) - 1, (k // g, n), dtype=np.uint8), bits)
    group, col = int(rng.integers(0, k // g)), int(rng.integers(0, n))
    bad = v1.copy()
    bad.view(np.uint32)[group, col // pf] |= np.uint32(((1 << bits) - 1) << (bits * (col % pf)))
    with pytest.raises(ValueError) as ref_err:
        gptq.repack_gptq_qzeros_to_marlin(bad, k, n, g, bits)
    with pytest.raises(ValueError) as kernel_err:
        ops.repack_gptq_qzeros_to_marlin(bad, k, n, g, bits, backend="numba")
    assert str(kernel_err.value) == str(ref_err.value)
    assert f"group={group} packed_col={col // pf} lane={col % pf}" in str(kernel_err.value)


def test_marlin_to_gptq_qzeros_rejects_zero_point_0(rng):
    k, n, bits = 128, 64, 4
    zp = rng.integers(1, 16, (1, n), dtype=np.uint8)
    zp[0, 5] = 0
    with pytest.raises(ValueError, match="column=5 is 0"):
        ks.marlin_to_gptq_qzeros(sc.zero_points_to_marlin(zp, k, n, bits), k, n, -1, bits)


@pytest.mark.parametrize("bits", [4, 8])
def test_symmetric_detection(bits, rng):
    pf = 32 // bits
    sym = np.full((4, 16), gptq.symmetric_stored_word(bits), np.uint32).view(np.int32)
    asym = sym.copy()
    asym.view(np.uint32)[int(rng.integers(0, 4)), int(rng.integers(0, 16))] ^= np.uint32(1 << int(rng.integers(0, 32)))
    assert ks.gptq_qzeros_are_symmetric_code7(sym, bits) is True
    assert ks.gptq_qzeros_are_symmetric_code7(asym, bits) is False
    assert ks.gptq_qzeros_are_symmetric_code7(np.zeros((0, pf), np.int32), bits) is False
    assert ks.gptq_qzeros_are_symmetric_code7(asym, bits) == gptq.gptq_qzeros_are_symmetric_code7(asym, bits)


@pytest.mark.parametrize("k,n", [(128, 192), (384, 320)])  # P32 with N % 128 != 0; P64
@pytest.mark.parametrize("src_dtype", [BF16, np.float32])
@pytest.mark.parametrize("act", [np.float16, BF16])
def test_block_fp8_scales(k, n, src_dtype, act, rng):
    """Values spread over 2^-30 .. 2^10 so fp16 subnormals, ties and overflow to inf are all exercised."""
    shape = (-(-n // 128), k // 128)
    inv = (rng.random(shape) * 2.0 ** rng.integers(-30, 10, shape)).astype(src_dtype)
    expected = fp8_fmt.block_fp8_group128_scales(inv, k, n, act)
    with poison_outputs():
        got = ops.block_fp8_group128_scales(inv, k, n, act, backend="numba")
    assert got.dtype == expected.dtype
    assert np.array_equal(_bits16(got), _bits16(expected))


@pytest.mark.parametrize("bits,asymmetric,act", [(4, True, np.float16), (8, False, BF16), (8, True, BF16)])
def test_stacked_experts_loader(bits, asymmetric, act, rng):
    experts, k, n, g = 3, 32, 64, 16
    pf = 32 // bits
    qws = [packing.pack_rows(rng.integers(0, 1 << bits, (k, n), dtype=np.uint8), bits) for _ in range(experts)]
    scs = [rng.standard_normal((k // g, n)).astype(np.float32) for _ in range(experts)]
    sym_word = gptq.symmetric_stored_word(bits)
    qzs = [np.full((k // g, n // pf), sym_word, np.uint32).view(np.int32) for _ in range(experts)]
    if asymmetric:
        qzs[1] = packing.pack_cols(rng.integers(0, (1 << bits) - 1, (k // g, n), dtype=np.uint8), bits)
    ref = ops.stack_gptq_experts_to_marlin(qws, scs, qzs, bits, g, k, n, act, backend="numpy")
    with poison_outputs():
        host = kmoe.stack_gptq_experts_to_marlin(qws, scs, qzs, bits, g, k, n, act)
        dev = kmoe.stack_gptq_experts_to_marlin(cuda.to_device(np.stack(qws)), cuda.to_device(np.stack(scs)),
                                                cuda.to_device(np.stack(qzs)), bits, g, k, n, act)
    dev_on_host = tuple(_host(a) for a in dev[:3]) + (dev[3],)
    for qw, s, z, asym in (host, dev_on_host):
        assert np.array_equal(qw, ref.qweight)
        assert np.array_equal(_bits16(s), _bits16(ref.scales))
        assert asym == asymmetric
        assert (z is None) == (ref.zeros is None)
        if z is not None:
            assert np.array_equal(z, ref.zeros)


def test_stacked_experts_code15_names_the_expert(rng):
    experts, k, n, g, bits = 3, 32, 64, 16, 4
    qws = [packing.pack_rows(rng.integers(0, 16, (k, n), dtype=np.uint8), bits) for _ in range(experts)]
    scs = [rng.standard_normal((k // g, n)).astype(np.float32) for _ in range(experts)]
    qzs = [packing.pack_cols(rng.integers(0, 15, (k // g, n), dtype=np.uint8), bits) for _ in range(experts)]
    qzs[2].view(np.uint32)[1, 3] |= np.uint32(0xF0)
    with pytest.raises(ValueError, match=r"qzeros\[2\].*group=1 packed_col=3 lane=1 has code 15"):
        kmoe.stack_gptq_experts_to_marlin(qws, scs, qzs, bits, g, k, n)
    with pytest.raises(ValueError, match=r"expert=2 group=1 packed_col=3 lane=1 has code 15"):
        kmoe.stack_gptq_experts_to_marlin(cuda.to_device(np.stack(qws)), cuda.to_device(np.stack(scs)),
                                          cuda.to_device(np.stack(qzs)), bits, g, k, n)
