"""The dense GEMM's host side for the microscaled formats, on the stand-in CuPy and driver (tests/fake_device.py):
which kernel a format gets, where the global scale reaches it, and the rules that refuse a bad combination before
anything is launched. The kernels' results are tests/gpu/test_fp4_gemm.py's.
"""
import dataclasses

import ml_dtypes
import numpy as np
import pytest

from fake_device import SMS, FakeArray, installed
from workbench import gemm
from workbench.scalar_types import ScalarType as S

F16, BF16 = np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)
E4M3, E8M0 = np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e8m0fnu)


@pytest.fixture
def fake():
    with installed() as (cupy, driver):
        yield cupy, driver


def layer(fmt="nvfp4", act=F16, m=4, k=512, n=256, scale_dtype=np.uint8, group=None, global_scale=True):
    bits = 8 if fmt == "mxfp8" else 4
    group = group or (16 if fmt == "nvfp4" else 32)
    return dict(a=FakeArray((m, k), act), b_q_weight=FakeArray((k // 16, n * bits // 2), np.int32),
                b_scales=FakeArray((k // group, n), scale_dtype), b_zeros=None, g_idx=None, perm=None,
                workspace=FakeArray((gemm.workspace_numel(SMS),), np.int32),
                b_q_type="fe4m3fn" if fmt == "mxfp8" else "fe2m1f", size_m=m, size_n=n, size_k=k,
                c=FakeArray((m, n), act), c_tmp=FakeArray((gemm.c_tmp_numel(SMS),), np.float32),
                global_scale=FakeArray((1,), np.float32) if global_scale else None)


def kernel_name(args) -> str:
    kw = dict(args)
    plan = gemm.api._gptq_marlin_gemm_checked(None, *(kw.pop(x) for x in (
        "a", "b_q_weight", "b_scales", "b_zeros", "g_idx", "perm", "workspace", "b_q_type", "size_m", "size_n",
        "size_k")), True, False, True, kw["c"], kw["c_tmp"], None, False, None, -1, gemm.DEFAULT_GEMM_POLICY,
        launch=False, global_scale=kw["global_scale"])
    return plan.prepared.cfg.name_expression


@pytest.mark.parametrize("fmt,act,scale_dtype,code", [
    ("nvfp4", F16, np.uint8, 9), ("nvfp4", BF16, E4M3, 9), ("mxfp4", BF16, np.uint8, 25), ("mxfp4", BF16, E8M0, 25),
    ("mxfp8", BF16, np.uint8, 24)])
def test_each_format_gets_its_kernel_and_nvfp4_its_global_scale(fake, fmt, act, scale_dtype, code):
    """The kernel's weight code is the type's ABI code, + 16 with E8M0 scales (kernels_cuda/dequant.cuh); NVFP4's
    global scale reaches the kernel in the zero-point slot (its 6th pointer), the MX formats pass null there."""
    _, driver = fake
    args = layer(fmt, act, scale_dtype=scale_dtype, global_scale=fmt == "nvfp4")
    assert f", {code}, " in kernel_name(args)
    gemm.gptq_marlin_gemm(**args)
    pointers = driver.launches[-1][5][:8]
    assert pointers[4] == args["b_scales"].data.ptr
    assert pointers[5] == (args["global_scale"].data.ptr if fmt == "nvfp4" else 0)
    gemm.gptq_marlin_gemm(**args)  # the cached plan: the same pointers
    assert driver.launches[-1][5][:8] == pointers


@pytest.mark.parametrize("change,message", [
    (dict(global_scale=None), "NVFP4 needs global_scale"),
    (dict(group=32), "MXFP4 has groups of 32|NVFP4 has groups of 16"),
    (dict(scale_dtype=E4M3, group=32), "NVFP4 has groups of 16"),
    (dict(fmt="mxfp4", act=F16, global_scale=False), "MXFP4 runs with bf16 activations"),
    (dict(fmt="mxfp4", act=BF16, scale_dtype=E8M0), "MXFP4 has no global scale"),
    (dict(fmt="mxfp4", act=BF16), "read as NVFP4's where a global_scale is given"),  # uint8: ambiguous, named
    (dict(fmt="mxfp8", act=BF16), "MXFP8 has no global scale"),
    (dict(scale_dtype=np.float16, global_scale=False), "fe2m1f takes scale bytes"),
])
def test_bad_combinations_are_refused_before_launch(fake, change, message):
    _, driver = fake
    before = len(driver.launches)
    with pytest.raises(ValueError, match=message):
        gemm.gptq_marlin_gemm(**layer(**change))
    assert len(driver.launches) == before


@pytest.mark.parametrize("fmt,act", [("nvfp4", F16), ("mxfp4", BF16), ("mxfp8", BF16)])
def test_odd_n_is_refused_by_name_before_launch(fake, fmt, act):
    """N = 7392 (115.5 tiles): the ops and checkpoint tools take it for these formats (padded arrays), but the GEMM
    refuses it by name until tests/gpu/test_fp4_gemm.py's odd-N test has run on a GPU; K = 2880 with whole-tile N
    (not a multiple of 128) is accepted, as before."""
    _, driver = fake
    before = len(driver.launches)
    args = layer(fmt, act, k=512, n=7392, global_scale=fmt == "nvfp4")
    bits = 8 if fmt == "mxfp8" else 4
    args["b_q_weight"] = FakeArray((512 // 16, 7424 * bits // 2), np.int32)  # N_pad = 7424
    args["b_scales"] = FakeArray((512 // (16 if fmt == "nvfp4" else 32), 7424), np.uint8)
    with pytest.raises(ValueError, match=f"{fmt.upper()} with size_n = 7392: the GEMM runs microscaled weights only "
                       "with N a multiple of 64"):
        gemm.gptq_marlin_gemm(**args)
    assert len(driver.launches) == before
    gemm.gptq_marlin_gemm(**layer(fmt, act, k=2880, n=256, global_scale=fmt == "nvfp4"))
    assert len(driver.launches) == before + 1


def test_global_scale_must_be_one_float32(fake):
    args = layer()
    with pytest.raises(ValueError, match="global_scale must be one float32"):
        gemm.gptq_marlin_gemm(**{**args, "global_scale": FakeArray((2,), np.float32)})
    with pytest.raises(ValueError, match="global_scale must be one float32"):
        gemm.gptq_marlin_gemm(**{**args, "global_scale": FakeArray((1,), np.float16)})


def test_integer_weights_refuse_a_global_scale(fake):
    args = dict(layer(), b_q_type="u4b8", b_q_weight=FakeArray((32, 256 * 2), np.int32),
                b_scales=FakeArray((4, 256), F16))
    with pytest.raises(ValueError, match="global_scale is NVFP4's"):
        gemm.gptq_marlin_gemm(**args)


def test_microscaled_kernels_never_scale_late():
    """KernelConfig.late_scale (whose bits differ from scaling every weight) is False for every microscaled config:
    the kernel's rule (WarpLoop::kLateScale), checked against NVRTC in tests/compile/test_fp4_compile.py."""
    for wt, e8m0 in ((S.FE2M1F, False), (S.FE2M1F, True), (S.FE4M3FN, True)):
        for m in (1, 8, 16, 64):
            cfg = gemm.choose_config(S.BF16, wt, m, 4096, 4096, 16 if not e8m0 else 32, False, 227 * 1024,
                                     sm_smem=228 * 1024, sms=132, pairs=True)
            assert not dataclasses.replace(cfg, e8m0_scales=e8m0).late_scale


def test_a_loaded_nvfp4_layer_brings_its_global_scale(fake):
    """marlin_gemm on a microscaled layer as workbench.load returns it uses the layer's own global scale."""
    from workbench.checkpoint.microscale import MicroscaleMarlinWeight

    _, driver = fake
    args = layer()
    w = MicroscaleMarlinWeight(args["b_q_weight"], args["b_scales"], None, None, None, args["size_k"],
                               args["size_n"], 16, S.FE2M1F, F16, True, None, microscale="nvfp4",
                               global_scale=args["global_scale"])
    gemm.marlin_gemm(args["a"], w, c=args["c"], workspace=args["workspace"], c_tmp=args["c_tmp"])
    assert driver.launches[-1][5][5] == args["global_scale"].data.ptr
