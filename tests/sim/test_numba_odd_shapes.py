"""The Numba ports on shapes that are not tile multiples (docs/formats.md, "Shapes that are not tile multiples"),
bit for bit against the NumPy reference, every output poisoned first (0xA5A5A5A5) so a word no kernel writes shows.

Shapes are drawn by hypothesis (derandomized, the profiles of tests/conftest.py) but kept to at most 2 x 3 tiles:
the simulator runs one Python thread per CUDA thread. Each shape mixes the whole-tile kernels and the edge kernel.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kernels_numba import marlin_repack as kr  # noqa: E402
from kernels_numba import moe as km  # noqa: E402
from kernels_numba import scales as ks  # noqa: E402
from kernels_numba._launch import poison_outputs  # noqa: E402
from workbench import ops  # noqa: E402
from workbench.formats import fp8, packing, scales  # noqa: E402
from workbench.formats._checks import padded_k, padded_n  # noqa: E402

NP = dict(backend="numpy")
FEW = settings(max_examples=6)  # each example is a few simulator launches: fewer than the profile's default


def host(x) -> np.ndarray:
    return np.asarray(x)


@st.composite
def shape(draw, rows_multiple: int, cols_multiple: int):
    """(K, N) within 2 x 3 tiles, multiples of the checkpoint form's pack factors; most are not tile multiples."""
    k = draw(st.integers(1, 32 // rows_multiple)) * rows_multiple
    n = draw(st.integers(1, 192 // cols_multiple)) * cols_multiple
    return k, n


@FEW
@given(st.sampled_from((4, 8)), st.data(), st.booleans(), st.integers(0, 2**31 - 1))
def test_gptq_repack_and_inverse_on_odd_shapes(bits, data, act_order, seed):
    pf = 32 // bits
    k, n = data.draw(shape(pf, 1))
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 1 << bits, size=(k, n), dtype=np.uint8)
    q = packing.pack_rows(codes, bits)
    perm = rng.permutation(k).astype(np.int32) if act_order else None
    with poison_outputs():
        marlin = host(kr.gptq_marlin_repack(q, perm, k, n, bits))
        back = host(kr.marlin_to_gptq_qweight(marlin, perm, k, n, bits))
    np.testing.assert_array_equal(marlin.view(np.int32), ops.gptq_marlin_repack(q, perm, k, n, bits, **NP))
    np.testing.assert_array_equal(back.view(np.int32), q)


@FEW
@given(st.sampled_from((4, 8)), st.data(), st.integers(0, 2**31 - 1))
def test_awq_repack_and_inverse_on_odd_shapes(bits, data, seed):
    pf = 32 // bits
    k, n = data.draw(shape(1, pf))
    codes = np.random.default_rng(seed).integers(0, 1 << bits, size=(k, n), dtype=np.uint8)
    q = packing.awq_pack(codes, bits)
    with poison_outputs():
        marlin = host(kr.awq_marlin_repack(q, k, n, bits))
        back = host(kr.marlin_to_awq_qweight(marlin, k, n, bits))
    np.testing.assert_array_equal(marlin.view(np.int32), ops.awq_marlin_repack(q, k, n, bits, **NP))
    np.testing.assert_array_equal(back.view(np.int32), q)


@FEW
@given(st.data(), st.integers(0, 2**31 - 1))
def test_fp8_repacks_and_inverses_on_odd_shapes(data, seed):
    k, n = data.draw(shape(4, 1))
    row_major = np.random.default_rng(seed).integers(0, 256, size=(n, k), dtype=np.uint8)
    raw = fp8.pack_fp8_to_int32(row_major)
    with poison_outputs():
        from_rows = host(kr.block_fp8_group128_repack(row_major, k, n))
        from_raw = host(kr.fp8_marlin_repack_raw_bits(raw, k, n))
        back_rows = host(kr.marlin_to_block_fp8_row_major(from_rows, k, n))
        back_raw = host(kr.marlin_to_fp8_raw_bits(from_rows, k, n))
    expected = ops.block_fp8_group128_repack(row_major, k, n, **NP)
    np.testing.assert_array_equal(from_rows.view(np.int32), expected)
    np.testing.assert_array_equal(from_raw.view(np.int32), expected)
    np.testing.assert_array_equal(back_rows, row_major)
    np.testing.assert_array_equal(back_raw.view(np.int32), raw)


@pytest.mark.parametrize("bits,k,n", [(4, 24, 100), (8, 20, 64), (4, 32, 70)])
def test_stacked_experts_with_odd_shapes(bits, k, n, rng):
    """A stack with a partial k-tile row goes expert by expert for the whole tiles; the edges are one launch."""
    experts = 2
    codes = rng.integers(0, 1 << bits, size=(experts, k, n), dtype=np.uint8)
    q = np.stack([packing.pack_rows(c, bits) for c in codes])
    perm = np.stack([rng.permutation(k) for _ in range(experts)]).astype(np.int32)
    with poison_outputs():
        marlin = host(kr.gptq_marlin_repack(q, perm, k, n, bits))
        back = host(kr.marlin_to_gptq_qweight(marlin, perm, k, n, bits))
    for e in range(experts):
        np.testing.assert_array_equal(marlin[e].view(np.int32), ops.gptq_marlin_repack(q[e], perm[e], k, n, bits, **NP))
    np.testing.assert_array_equal(back.view(np.int32), q)


@FEW
@given(st.integers(1, 80), st.integers(1, 150), st.sampled_from((-1, 16, 32)), st.integers(0, 2**31 - 1))
def test_scales_and_zero_points_on_odd_shapes(k, n, group, seed):
    rng = np.random.default_rng(seed)
    ng = scales.num_groups(k, group)
    s = rng.standard_normal((ng, n)).astype(np.float32)
    with poison_outputs():
        marlin = host(ks.marlin_permute_scales(s, k, n, group, out_dtype=ml_dtypes.bfloat16))
        back = host(ks.marlin_unpermute_scales(marlin, k, n, group))
    expected = ops.marlin_permute_scales(s.astype(ml_dtypes.bfloat16), k, n, group, **NP)
    np.testing.assert_array_equal(marlin.view(np.uint16), expected.view(np.uint16))
    np.testing.assert_array_equal(back.view(np.uint16), s.astype(ml_dtypes.bfloat16).view(np.uint16))
    bits = 4 if seed % 2 else 8
    pf = 32 // bits
    n = -(-n // pf) * pf  # zero points in AWQ / GPTQ words: whole words along N
    zp = rng.integers(1, 1 << bits, size=(ng, n), dtype=np.uint8)
    v1 = packing.pack_cols(zp - np.uint8(1), bits)
    with poison_outputs():
        from_codes = host(ks.marlin_zero_points(zp, k, n, bits))
        from_awq = host(ks.awq_to_marlin_zero_points(packing.awq_pack(zp, bits), k, n, bits))
        from_v1 = host(ks.repack_gptq_qzeros_to_marlin(v1, k, n, group, bits))
        codes = host(ks.marlin_zero_points_to_codes(from_codes, k, n, bits))
        awq = host(ks.marlin_to_awq_zero_points(from_codes, k, n, bits))
        back_v1 = host(ks.marlin_to_gptq_qzeros(from_codes, k, n, group, bits))
    expected = ops.marlin_zero_points(zp, k, n, bits, **NP)
    for got in (from_codes, from_awq, from_v1):
        np.testing.assert_array_equal(got.view(np.int32), expected)
    np.testing.assert_array_equal(codes, zp)
    np.testing.assert_array_equal(awq.view(np.int32), packing.awq_pack(zp, bits))
    np.testing.assert_array_equal(back_v1.view(np.int32), v1)


@pytest.mark.parametrize("k,n", [(132, 100), (260, 64), (128, 200)])
def test_block_fp8_scales_with_partial_blocks(k, n, rng):
    inv = np.exp2(rng.integers(-12, -4, size=fp8.block_scale_shape(k, n))).astype(ml_dtypes.bfloat16)
    for act in (np.float16, ml_dtypes.bfloat16):
        with poison_outputs():
            marlin = host(ks.block_fp8_group128_scales(inv, k, n, act))
        np.testing.assert_array_equal(marlin.view(np.uint16),
                                      ops.block_fp8_group128_scales(inv, k, n, act, **NP).view(np.uint16))


def test_expert_stack_with_odd_shapes(rng):
    """The MoE stack builder: padded qweight, scales and zero points per expert, as the one-matrix ops give."""
    experts, k, n, group, bits = 2, 40, 72, 16, 4
    ng = scales.num_groups(k, group)
    codes = rng.integers(0, 16, size=(experts, k, n), dtype=np.uint8)
    qw = [packing.pack_rows(c, bits) for c in codes]
    sc = [rng.standard_normal((ng, n)).astype(np.float32) for _ in range(experts)]
    qz = [packing.pack_cols(rng.integers(0, 15, size=(ng, n), dtype=np.uint8), bits) for _ in range(experts)]
    with poison_outputs():
        qweight, scale_bits, zeros, asymmetric = km.stack_gptq_experts_to_marlin(qw, sc, qz, bits, group, k, n)
    assert asymmetric and host(qweight).shape == (experts, padded_k(k) // 16, padded_n(n) * 2)
    for e in range(experts):
        np.testing.assert_array_equal(host(qweight)[e], ops.gptq_marlin_repack(qw[e], None, k, n, bits, **NP))
        np.testing.assert_array_equal(host(scale_bits)[e].view(np.uint16),
                                      ops.marlin_permute_scales(sc[e].astype(np.float16), k, n, group,
                                                                **NP).view(np.uint16))
        np.testing.assert_array_equal(host(zeros)[e], ops.repack_gptq_qzeros_to_marlin(qz[e], k, n, group, bits,
                                                                                       **NP))


def test_bad_shapes_are_refused_before_any_launch():
    with pytest.raises(ValueError, match="size_k = 12 is not a multiple of the pack factor 8"):
        kr.gptq_marlin_repack(np.zeros((1, 5), np.int32), None, 12, 5, 4)
    with pytest.raises(ValueError, match="size_n = 20 is not a multiple of the pack factor 8"):
        kr.awq_marlin_repack(np.zeros((16, 2), np.int32), 16, 20, 4)
    with pytest.raises(ValueError, match="size_k = 6 is not a multiple of the pack factor 4"):
        kr.block_fp8_group128_repack(np.zeros((8, 6), np.uint8), 6, 8)
    with pytest.raises(ValueError, match=r"qweight has shape \(1, 128\), expected \(2, 128\)"):
        kr.marlin_to_gptq_qweight(np.zeros((1, 128), np.int32), None, 24, 64, 4)


def test_ops_dispatch_odd_shapes_to_the_ports(rng):
    """The public ops with backend="numba" reach the same kernels (plans, checks) on an odd shape."""
    k, n, bits, group = 40, 72, 4, 32
    codes = rng.integers(0, 16, size=(k, n), dtype=np.uint8)
    q = packing.pack_rows(codes, bits)
    perm = rng.permutation(k).astype(np.int32)
    s = rng.standard_normal((scales.num_groups(k, group), n)).astype(np.float16)
    zp = rng.integers(0, 16, size=s.shape, dtype=np.uint8)
    with poison_outputs():
        got = [host(ops.gptq_marlin_repack(q, perm, k, n, bits, backend="numba")),
               host(ops.marlin_permute_scales(s, k, n, group, backend="numba")),
               host(ops.marlin_zero_points(zp, k, n, bits, backend="numba"))]
    want = [ops.gptq_marlin_repack(q, perm, k, n, bits, **NP), ops.marlin_permute_scales(s, k, n, group, **NP),
            ops.marlin_zero_points(zp, k, n, bits, **NP)]
    for a, b in zip(got, want):
        assert a.shape == b.shape
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
