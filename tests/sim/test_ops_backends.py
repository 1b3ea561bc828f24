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
