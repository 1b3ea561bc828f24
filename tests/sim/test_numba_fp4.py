"""The microscaled formats' Numba kernels == their NumPy references, bit for bit, with poisoned outputs and fresh
random data: FP4 weights both ways, NVFP4 scales for every E4M3 byte and several scale factors, every S0E5M3 byte
back, MX scales both ways, and the same errors and warnings as the references."""
import warnings

import ml_dtypes
import numpy as np
import pytest

from kernels_numba import fp4_repack as kf
from kernels_numba import marlin_repack as kr
from kernels_numba._launch import poison_outputs
from workbench import ops
from workbench.formats import fp4_marlin as fm
from workbench.formats import microscale as ms
from workbench.formats.scales import permute_scales

BF16 = np.dtype(ml_dtypes.bfloat16)
ALL = np.arange(256, dtype=np.uint8)


def _host(a):
    return a.get() if hasattr(a, "get") else (a if isinstance(a, np.ndarray) else a.copy_to_host())


@pytest.mark.parametrize("size_k,size_n", [(16, 64), (32, 128)])
def test_fp4_weights_both_ways(size_k, size_n, rng):
    packed = rng.integers(0, 256, size=(size_n, size_k // 2), dtype=np.uint8)
    with poison_outputs():
        got = ops.fp4_marlin_repack(packed, size_k, size_n, backend="numba")
        back = ops.marlin_to_fp4(got, size_k, size_n, backend="numba")
    assert got.dtype == np.int32 and np.array_equal(got, fm.fp4_marlin_repack(packed, size_k, size_n))
    assert np.array_equal(back, packed)


# every launch shape of the sector kernels, on shapes whose k-tiles leave the last warp and block partial (17 =
# 4 * 4 + 1 k-tiles; the smallest tile: one k-tile of the four a warp covers)
@pytest.mark.parametrize("launch", [(1, False, 4), (2, False, 4), (1, True, 4), (2, True, 4), (1, False, 8),
                                    (1, False, 4, True)])
@pytest.mark.parametrize("size_k,size_n", [(16, 64), (272, 128)])
def test_sector_kernels_every_launch_shape(launch, size_k, size_n, rng):
    packed = rng.integers(0, 256, size=(size_n, size_k // 2), dtype=np.uint8)
    fp8 = rng.integers(0, 256, size=(size_n, size_k), dtype=np.uint8)
    with poison_outputs():
        got = kf.fp4_marlin_repack(packed, size_k, size_n, launch=launch)
        back = kf.marlin_to_fp4(got, size_k, size_n, launch=launch)
        got8 = kf.mxfp8_marlin_repack(fp8, size_k, size_n, launch=launch)
    assert got.dtype == np.int32 and np.array_equal(got, fm.fp4_marlin_repack(packed, size_k, size_n))
    assert back.dtype == np.uint8 and np.array_equal(back, packed)
    assert got8.dtype == np.int32 and np.array_equal(got8, fm.mxfp8_marlin_repack(fp8, size_k, size_n))


@pytest.mark.parametrize("size_k,size_n", [(48, 192), (32 * 33, 128), (32, 64)])
def test_scale_tiles_at_odd_group_counts(size_k, size_n, rng):
    """3 groups (one partial 32-group tile), 66 / 33 groups (a second, partial tile) and one group (P32)."""
    nv = rng.integers(0, 0x7F, size=(size_n, size_k // 16), dtype=np.uint8)
    with poison_outputs():
        got, sf = kf.nvfp4_marlin_scales(nv, size_k, size_n, np.float16)
        back = kf.marlin_to_nvfp4_scales(got, size_k, size_n, sf)
    assert np.array_equal(got, fm.nvfp4_marlin_scales(nv, size_k, size_n, np.float16)[0])
    assert np.array_equal(back, nv)
    if size_k % 32 == 0:
        codes = rng.integers(0, 255, size=(size_n, size_k // 32), dtype=np.uint8)
        with poison_outputs():
            got = kf.mx_marlin_scales(codes, size_k, size_n, "mxfp4")
            back = kf.marlin_to_mx_scales(got, size_k, size_n, "mxfp4")
        assert np.array_equal(got, fm.mx_marlin_scales(codes, size_k, size_n, "mxfp4")) and np.array_equal(back,
                                                                                                           codes)
        codes[size_n - 1, 0] = codes[3, size_k // 32 - 1] = 0xFF  # the lowest index is named, both counted
        with pytest.raises(ValueError) as ref:
            fm.mx_marlin_scales(codes, size_k, size_n, "mxfp4")
        with pytest.raises(ValueError) as kern:
            kf.mx_marlin_scales(codes, size_k, size_n, "mxfp4")
        assert str(kern.value) == str(ref.value) and "(2 such" in str(ref.value)


def test_fp4_weights_stacked_experts(rng):
    packed = rng.integers(0, 256, size=(2, 64, 8), dtype=np.uint8)
    with poison_outputs():
        got = kf.fp4_marlin_repack(packed, 16, 64)
        back = kf.marlin_to_fp4(got, 16, 64)
    assert np.array_equal(got[1], fm.fp4_marlin_repack(packed[1], 16, 64)) and np.array_equal(back, packed)


# (activation, scale factor, largest magnitude byte): every byte whose s · 2^7 · factor fits fp16; the computed
# factor is 8 for the set reaching the smallest subnormal (0x01), 1 where the smallest is 0x30 (s · 2^7 >= 2)
@pytest.mark.parametrize("a_dtype,scale_factor,low,high", [(np.float16, None, 0x00, 0x7E), (BF16, None, 0x30, 0x7E),
                                                           (BF16, 1.0, 0x00, 0x7E), (BF16, 2.0, 0x00, 0x77),
                                                           (BF16, None, 0x00, 0x67), (BF16, 16.0, 0x00, 0x5F)])
def test_nvfp4_scales_for_every_e4m3_byte(a_dtype, scale_factor, low, high):
    keep = [b for b in ALL if low <= (b & 0x7F) <= high or (b & 0x7F) == 0]
    scales = np.resize(np.array(keep, np.uint8), (64, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # negative scales: both warn (tested below)
        want, want_sf = fm.nvfp4_marlin_scales(scales, 64, 64, a_dtype, scale_factor)
        with poison_outputs():
            got, sf = ops.nvfp4_marlin_scales(scales, 64, 64, a_dtype, scale_factor, backend="numba")
            back = ops.marlin_to_nvfp4_scales(got, 64, 64, sf, backend="numba")
    assert sf == want_sf and np.array_equal(got, want)
    magnitude = np.where(scales == 0x80, 0, scales & 0x7F)
    assert np.array_equal(back, fm.marlin_to_nvfp4_scales(want, 64, 64, sf)) and np.array_equal(back, magnitude)


@pytest.mark.parametrize("scale_factor", [1.0, 4.0, 2.0 ** 6])
def test_every_s0e5m3_byte_back_to_e4m3(scale_factor):
    raw = np.resize(ALL, (4, 64))  # any byte, also ones no forward step writes (infinity, NaN, fp16 subnormals)
    with poison_outputs():
        got = ops.marlin_to_nvfp4_scales(raw, 64, 64, scale_factor, backend="numba")
    assert np.array_equal(got, fm.marlin_to_nvfp4_scales(raw, 64, 64, scale_factor))


def test_nvfp4_process_step_alone(rng):
    codes = rng.integers(1, 0x50, size=(2, 64), dtype=np.uint8)  # bf16 rescales by 8: up to 8 · 2^7 · 8 fits fp16
    half = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float16)
    for a_dtype in (np.float16, BF16):
        with poison_outputs():
            got, sf = ops.nvfp4_marlin_process_scales(half, a_dtype=a_dtype, backend="numba")
        want, want_sf = fm.nvfp4_marlin_process_scales(half, a_dtype=a_dtype)
        assert sf == want_sf and np.array_equal(got, want)


def test_nvfp4_errors_and_warnings_match_the_reference(rng):
    scales = rng.integers(0x30, 0x60, size=(64, 8), dtype=np.uint8)
    nan = scales.copy()
    nan[9, 3] = 0xFF
    nan[20, 1] = 0x7F
    for bad, sf in ((nan, 1.0),):
        with pytest.raises(ValueError) as ref:
            fm.nvfp4_marlin_scales(bad, 128, 64, np.float16, sf)
        with pytest.raises(ValueError) as kern:
            ops.nvfp4_marlin_scales(bad, 128, 64, np.float16, sf, backend="numba")
        assert str(kern.value) == str(ref.value) and "weight_scale[9, 3] = 0xff" in str(ref.value)
    big = scales.copy()
    big[5, 2] = 0x7E  # 448 · 2^7 · 4 overflows fp16
    with pytest.raises(ValueError) as ref:
        fm.nvfp4_marlin_scales(big, 128, 64, BF16, 4.0)
    with pytest.raises(ValueError) as kern:
        ops.nvfp4_marlin_scales(big, 128, 64, BF16, 4.0, backend="numba")
    assert str(kern.value) == str(ref.value) and "exceeds fp16's 65504" in str(ref.value)
    neg = scales.copy()
    neg[11, 6] |= 0x80
    with pytest.warns(RuntimeWarning) as ref_w:
        want, _ = fm.nvfp4_marlin_scales(neg, 128, 64, np.float16)
    with pytest.warns(RuntimeWarning) as kern_w:
        got, _ = ops.nvfp4_marlin_scales(neg, 128, 64, np.float16, backend="numba")
    assert str(kern_w[0].message) == str(ref_w[0].message) and np.array_equal(got, want)


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
def test_mx_scales_both_ways(fmt, rng):
    codes = rng.integers(0, 255, size=(128, 8), dtype=np.uint8)
    with poison_outputs():
        got = ops.mx_marlin_scales(codes, 256, 128, fmt, backend="numba")
        back = ops.marlin_to_mx_scales(got, 256, 128, fmt, backend="numba")
        step = ops.mxfp4_marlin_process_scales(permute_scales(np.ascontiguousarray(codes.T), 256, 128, 32),
                                               backend="numba")
    assert np.array_equal(got, fm.mx_marlin_scales(codes, 256, 128, fmt)) and np.array_equal(back, codes)
    assert np.array_equal(step, got)
    codes[70, 5] = 0xFF
    with pytest.raises(ValueError) as ref:
        fm.mx_marlin_scales(codes, 256, 128, fmt)
    with pytest.raises(ValueError) as kern:
        ops.mx_marlin_scales(codes, 256, 128, fmt, backend="numba")
    assert str(kern.value) == str(ref.value) and "weight_scale[70, 5] = 0xFF" in str(ref.value)


def test_mxfp8_weights_match_the_block_fp8_kernel(rng):
    w = rng.integers(0, 256, size=(64, 32), dtype=np.uint8)
    with poison_outputs():
        got = ops.mxfp8_marlin_repack(w, 32, 64, backend="numba")
        back = ops.marlin_to_mxfp8(got, 32, 64, backend="numba")
        block = kr.block_fp8_group128_repack(w, 32, 64)
    assert np.array_equal(got, fm.mxfp8_marlin_repack(w, 32, 64)) and np.array_equal(_host(back), w)
    assert np.array_equal(got, block)


def test_stacked_scales_name_the_expert(rng):
    codes = rng.integers(0, 0x60, size=(2, 64, 4), dtype=np.uint8)
    with poison_outputs():
        got, sf = kf.nvfp4_marlin_scales(codes, 64, 64, BF16)
    assert sf == ops.nvfp4_scale_factor(codes, BF16)
    for e in range(2):
        assert np.array_equal(got[e], fm.nvfp4_marlin_scales(codes[e], 64, 64, BF16, sf)[0])
    codes[1, 3, 2] = 0x7F
    with pytest.raises(ValueError, match=r"weight_scale\[1, 3, 2\] = 0x7f is E4M3's NaN \(1 such\)"):
        kf.nvfp4_marlin_scales(codes, 64, 64, BF16, sf)
    assert ms.E8M0_NAN == 0xFF


def test_repack_of_a_compressed_tensors_checkpoint_on_the_numba_backend(tmp_path):
    """The whole checkpoint route on the kernels: the same bytes as the NumPy route, and verify passes."""
    import os

    import workbench
    from workbench.checkpoint import repack, verify

    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "ct_nvfp4")
    quiet = {"progress": False, "log": lambda msg: None}
    repack(src, str(tmp_path / "numba"), backend="numba", **quiet)
    repack(src, str(tmp_path / "numpy"), backend="numpy", **quiet)
    a, b = workbench.load(str(tmp_path / "numba")), workbench.load(str(tmp_path / "numpy"))
    for name in a:
        assert np.array_equal(a[name].qweight, b[name].qweight) and np.array_equal(a[name].scales, b[name].scales)
        assert np.array_equal(a[name].global_scale, b[name].global_scale)
    assert verify(str(tmp_path / "numba"), src, progress=False).ok


def test_device_arrays_stay_on_the_device(rng):
    from numba import cuda

    packed = rng.integers(0, 256, size=(64, 8), dtype=np.uint8)
    scales = rng.integers(0x08, 0x60, size=(64, 1), dtype=np.uint8)
    q = ops.fp4_marlin_repack(cuda.to_device(packed), 16, 64)  # backend "auto": the device array picks the kernels
    s, sf = ops.nvfp4_marlin_scales(cuda.to_device(scales), 16, 64, BF16)
    assert not isinstance(q, np.ndarray) and not isinstance(s, np.ndarray)
    assert np.array_equal(_host(q).view(np.int32), fm.fp4_marlin_repack(packed, 16, 64))
    assert (np.array_equal(_host(s), fm.nvfp4_marlin_scales(scales, 16, 64, BF16)[0]) and
            sf == fm.nvfp4_marlin_scales(scales, 16, 64, BF16)[1])
    with pytest.raises(TypeError, match="nvfp4_marlin_process_scales on the device needs a_dtype"):
        ops.nvfp4_marlin_process_scales(cuda.to_device(scales.T.copy()))


# Shapes that are not tile multiples: N ends in a partial 64-column tile (K is always whole k-tiles here: a multiple
# of the format's group). The sector kernels run on the whole n-tiles, the edge kernels on the last column; small
# shapes for the simulator: N below one tile, one tile and a remainder, and a stack of experts.
ODD = [(16, 1), (32, 100), (64, 130)]


@pytest.mark.parametrize("size_k,size_n", ODD)
def test_fp4_and_mxfp8_weights_on_odd_n(size_k, size_n, rng):
    packed = rng.integers(0, 256, size=(size_n, size_k // 2), dtype=np.uint8)
    fp8 = rng.integers(0, 256, size=(size_n, size_k), dtype=np.uint8)
    with poison_outputs():
        got = kf.fp4_marlin_repack(packed, size_k, size_n)
        back = kf.marlin_to_fp4(got, size_k, size_n)
        got8 = kf.mxfp8_marlin_repack(fp8, size_k, size_n)
        back8 = ops.marlin_to_mxfp8(got8, size_k, size_n, backend="numba")
    assert got.dtype == np.int32 and np.array_equal(got, fm.fp4_marlin_repack(packed, size_k, size_n))
    assert back.dtype == np.uint8 and np.array_equal(back, packed)
    assert got8.dtype == np.int32 and np.array_equal(got8, fm.mxfp8_marlin_repack(fp8, size_k, size_n))
    assert np.array_equal(back8, fp8)


def test_odd_n_stacked_experts_and_other_launch_shapes(rng):
    packed = rng.integers(0, 256, size=(2, 70, 16), dtype=np.uint8)
    fp8 = rng.integers(0, 256, size=(2, 70, 32), dtype=np.uint8)
    with poison_outputs():
        got = kf.fp4_marlin_repack(packed, 32, 70, launch=(2, True, 4))
        back = kf.marlin_to_fp4(got, 32, 70, launch=(1, False, 4, True))
        got8 = kf.mxfp8_marlin_repack(fp8, 32, 70, launch=(1, False, 8))
    for e in range(2):
        assert np.array_equal(got[e], fm.fp4_marlin_repack(packed[e], 32, 70))
        assert np.array_equal(got8[e], fm.mxfp8_marlin_repack(fp8[e], 32, 70))
    assert np.array_equal(back, packed)


@pytest.mark.parametrize("size_k,size_n", ODD + [(32 * 33, 70)])
def test_scales_on_odd_n(size_k, size_n, rng):
    """Padded columns are byte 0 both ways; 33 groups put a partial 32-group tile beside the partial n-tile."""
    nv = rng.integers(0, 0x7F, size=(2, size_n, size_k // 16), dtype=np.uint8)
    with poison_outputs():
        got, sf = kf.nvfp4_marlin_scales(nv, size_k, size_n, np.float16)
        back = kf.marlin_to_nvfp4_scales(got, size_k, size_n, sf)
    for e in range(2):
        assert np.array_equal(got[e], fm.nvfp4_marlin_scales(nv[e], size_k, size_n, np.float16)[0])
    assert np.array_equal(back, nv)
    if size_k % 32 == 0:
        codes = rng.integers(0, 255, size=(size_n, size_k // 32), dtype=np.uint8)
        with poison_outputs():
            got = kf.mx_marlin_scales(codes, size_k, size_n, "mxfp8")
            back = kf.marlin_to_mx_scales(got, size_k, size_n, "mxfp8")
        assert np.array_equal(got, fm.mx_marlin_scales(codes, size_k, size_n, "mxfp8"))
        assert np.array_equal(back, codes)


def test_odd_n_errors_name_the_source_position(rng):
    """The NaN code and the negative-scale warning name the same positions as the reference on a padded layout."""
    size_k, size_n = 32, 100
    nv = rng.integers(0x20, 0x40, size=(size_n, 2), dtype=np.uint8)
    nv[99, 1] = 0xB8  # negative, in the last (partial) tile
    with pytest.warns(RuntimeWarning) as ref:
        fm.nvfp4_marlin_scales(nv, size_k, size_n, np.float16)
    with pytest.warns(RuntimeWarning) as kern:
        kf.nvfp4_marlin_scales(nv, size_k, size_n, np.float16)
    assert str(kern[0].message) == str(ref[0].message)
    nv[98, 0] = 0x7F
    with pytest.raises(ValueError) as ref_err:
        fm.nvfp4_marlin_scales(nv, size_k, size_n, np.float16)
    with pytest.raises(ValueError) as kern_err:
        kf.nvfp4_marlin_scales(nv, size_k, size_n, np.float16)
    assert str(kern_err.value) == str(ref_err.value)
    codes = rng.integers(0, 255, size=(size_n, 1), dtype=np.uint8)
    codes[97, 0] = 0xFF
    with pytest.raises(ValueError) as ref_err:
        fm.mx_marlin_scales(codes, size_k, size_n, "mxfp4")
    with pytest.raises(ValueError) as kern_err:
        kf.mx_marlin_scales(codes, size_k, size_n, "mxfp4")
    assert str(kern_err.value) == str(ref_err.value) and "[97, 0]" in str(ref_err.value)
