"""The teaching kernel (kernels_numba/teaching_gemm.py) in the CUDA simulator, at one or two 16×64 tiles: identity
activations give back the dequantized weight bit for bit, exact sums equal the reference exactly, random data to
fp32 accumulation accuracy; a swapped lane in a fragment map or a swapped field in the words makes it wrong."""
import numpy as np
import pytest

from kernels_numba import teaching_gemm as tg
from workbench.formats import marlin_tile as mt
from workbench.formats import scales as sc
from workbench.quantize import dequantize, quantize_weights

CASES = [("u4b8", 32, -1), ("u4b8", 64, 32), ("u8b128", 32, 16 * 2), ("u8b128", 32, -1)]


def _weights(weight_type, size_k, size_n, group_size, rng, power_of_two_scales=False):
    """Codes, logical scales, Marlin qweight and Marlin scales of a random weight."""
    q = quantize_weights(rng.standard_normal((size_k, size_n)).astype(np.float32), weight_type, group_size,
                         seed=int(rng.integers(1 << 30)))
    scales = q.scales
    if power_of_two_scales:  # every product and sum below is then a small dyadic number: exact in fp32
        scales = (2.0 ** rng.integers(-4, 2, scales.shape)).astype(np.float16)
    qweight = mt.marlin_repack_codes(q.codes, q.weight_type.bits)
    return q.codes, scales, qweight, sc.permute_scales(scales, size_k, size_n, group_size)


def _reference(a, codes, scales, weight_type, group_size):
    """A @ W in float64 with W = dequantize(rounded=False): the kernel keeps its scaled weights in fp32."""
    return a.astype(np.float64) @ dequantize(codes, scales, None, weight_type, group_size, rounded=False)


@pytest.mark.parametrize("weight_type,size_k,group_size", CASES)
def test_identity_activations_give_the_dequantized_weight(weight_type, size_k, group_size, rng):
    codes, scales, qweight, marlin_scales = _weights(weight_type, size_k, 64, group_size, rng)
    got = tg.teaching_gemm(np.eye(size_k, dtype=np.float32), qweight, marlin_scales, size_k, 64, weight_type,
                           group_size)
    assert np.array_equal(got, dequantize(codes, scales, None, weight_type, group_size, rounded=False))


@pytest.mark.parametrize("weight_type,group_size", [("u4b8", 32), ("u8b128", -1)])
def test_exact_sums_equal_the_reference_exactly(weight_type, group_size, rng):
    size_m, size_k, size_n = 5, 64, 128  # 5 rows: a partial m16 block; two n tiles
    codes, scales, qweight, marlin_scales = _weights(weight_type, size_k, size_n, group_size, rng, True)
    a = rng.integers(-4, 5, (size_m, size_k)).astype(np.float32)
    got = tg.teaching_gemm(a, qweight, marlin_scales, size_k, size_n, weight_type, group_size)
    assert np.array_equal(got, _reference(a, codes, scales, weight_type, group_size))


def test_random_data_to_fp32_accumulation_accuracy(rng):
    size_m, size_k, size_n = 16, 64, 64
    codes, scales, qweight, marlin_scales = _weights("u4b8", size_k, size_n, 32, rng)
    a = rng.standard_normal((size_m, size_k)).astype(np.float32)
    got = tg.teaching_gemm(a, qweight, marlin_scales, size_k, size_n, "u4b8", 32)
    ref = _reference(a, codes, scales, "u4b8", 32)
    # tolerance: in fp32 each product a*w and each of the K partial sums is rounded once (relative 2^-24), so
    # |got - ref| <= (K + 1) 2^-24 sum |a w| (the order of the sum does not matter for this bound)
    bound = (size_k + 1) * 2.0 ** -24 * (np.abs(a.astype(np.float64)) @ np.abs(
        dequantize(codes, scales, None, "u4b8", 32, rounded=False)))
    assert np.all(np.abs(got - ref) <= bound) and not np.array_equal(got, np.zeros_like(got))


def _swap(table, first, second, axis):
    broken = table.copy()
    index = [slice(None)] * table.ndim
    index[axis] = [first, second]
    broken[tuple(index)] = table[tuple(index[:axis] + [[second, first]])]
    return broken


@pytest.mark.parametrize("axis,first,second", [(0, 1, 6), (1, 0, 2)], ids=["lanes 1, 6", "elements 0, 2"])
def test_a_swapped_lane_or_element_in_the_b_map_is_caught(axis, first, second, rng):
    """The B map is a contract with the repacked words: break it and the product is wrong."""
    codes, scales, qweight, marlin_scales = _weights("u4b8", 16, 64, -1, rng)
    a = rng.integers(-4, 5, (16, 16)).astype(np.float32)
    maps = tg.fragment_maps()
    maps["b"] = _swap(maps["b"], first, second, axis)
    got = tg.teaching_gemm(a, qweight, marlin_scales, 16, 64, "u4b8", -1, maps=maps)
    assert not np.array_equal(got, _reference(a, codes, scales, "u4b8", -1))


def test_swapped_lanes_in_the_a_and_c_maps_cancel(rng):
    """In this kernel A is read from shared memory and C written to global memory through the same map that places
    them in the exchange, so a consistent relabelling of lanes changes nothing (on the GPU the A and C maps are a
    contract with the tensor core instead, checked by tests/cpu/test_warp_stage.py against the PTX layout)."""
    codes, scales, qweight, marlin_scales = _weights("u4b8", 16, 64, -1, rng)
    a = rng.integers(-4, 5, (16, 16)).astype(np.float32)
    maps = tg.fragment_maps()
    maps["a"], maps["c"] = _swap(maps["a"], 1, 6, 0), _swap(maps["c"], 3, 30, 0)
    got = tg.teaching_gemm(a, qweight, marlin_scales, 16, 64, "u4b8", -1, maps=maps)
    assert np.array_equal(got, _reference(a, codes, scales, "u4b8", -1))


def test_swapped_fields_in_the_words_are_caught(rng):
    codes, scales, qweight, marlin_scales = _weights("u4b8", 16, 64, -1, rng)
    while np.array_equal(codes[0], codes[1]):  # fields 0 and 4 hold rows k0 and k0 + 1: make them differ
        codes, scales, qweight, marlin_scales = _weights("u4b8", 16, 64, -1, rng)
    w = qweight.view(np.uint32)
    f0, f4 = w & np.uint32(0xF), (w >> np.uint32(16)) & np.uint32(0xF)
    swapped = (w & ~np.uint32(0x000F000F)) | f4 | (f0 << np.uint32(16))
    a = np.eye(16, dtype=np.float32)
    good = tg.teaching_gemm(a, qweight, marlin_scales, 16, 64, "u4b8", -1)
    bad = tg.teaching_gemm(a, swapped.view(np.int32), marlin_scales, 16, 64, "u4b8", -1)
    ref = _reference(a, codes, scales, "u4b8", -1)
    assert np.array_equal(good, ref) and not np.array_equal(bad, ref)


def test_errors_name_the_values(rng):
    with pytest.raises(ValueError, match="supports u4b8 and u8b128 weights, got u4"):
        tg.teaching_gemm(np.zeros((1, 16)), np.zeros((1, 128), np.int32), np.zeros((1, 64)), 16, 64, "u4", -1)
    with pytest.raises(ValueError, match=r"qweight has shape \(1, 64\), expected \(1, 128\)"):
        tg.teaching_gemm(np.zeros((1, 16)), np.zeros((1, 64), np.int32), np.zeros((1, 64)), 16, 64, "u4b8", -1)
    with pytest.raises(ValueError, match="N of 64"):
        tg.teaching_gemm(np.zeros((1, 16)), np.zeros((1, 96), np.int32), np.zeros((1, 48)), 16, 48, "u4b8", -1)


def test_the_stage_reference_adds_up_to_the_kernel_output(rng):
    """teaching_gemm.stage_reference (what the notebook shows lane by lane), summed over the k tiles and placed by
    the C map, is the kernel's output exactly (exact sums)."""
    size_m, size_k, size_n = 16, 64, 64
    codes, scales, qweight, marlin_scales = _weights("u4b8", size_k, size_n, 32, rng, True)
    a = rng.integers(-4, 5, (size_m, size_k)).astype(np.float32)
    total = sum(tg.stage_reference(a, qweight, marlin_scales, size_k, size_n, "u4b8", 32, kt)["c"]
                for kt in range(size_k // 16))
    c_map = tg.fragment_maps()["c"]
    out = np.zeros((16, 64))
    for f in range(8):
        out[c_map[:, :, 0], 8 * f + c_map[:, :, 1]] = total[:, f]
    assert np.array_equal(out, tg.teaching_gemm(a, qweight, marlin_scales, size_k, size_n, "u4b8", 32))
    assert np.array_equal(out, _reference(a, codes, scales, "u4b8", 32))
