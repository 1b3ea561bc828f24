"""kernels_cuda/marlin_moe.cu builds for sm_80 and sm_90 with nvcc and NVRTC, with no warnings and no register
spills, for every weight type, both activation types, every moe_block_size (M_BLOCKS 1..4) and every tile shape the
host can choose; and the Numba moe_align kernel compiles for a real target (the simulator accepts code the real
compiler rejects); and the CUDA moe_align wrapper rejects bad input before any launch. Needs no GPU."""
import re
import types

import numpy as np
import pytest

from cuda_build import ARCHS, nvcc_cubin, nvrtc_cubin
from workbench import gemm, moe
from workbench.cuda import arrays as rt_arrays
from workbench.policy import DEFAULT_MOE_POLICY
from workbench.formats.moe_align import SUPPORTED_BLOCK_SIZES
from workbench.scalar_types import ScalarType as S

WEIGHTS = (S.U4B8, S.U4, S.U8B128, S.U8, S.FE4M3FN)
SMEM_SM90 = 227 * 1024
SM_SMEM_SM90 = 228 * 1024


def _configs():
    """Every (act, weight, block size) with the shape choice for a wide and a narrow problem, on one and (16-row
    items) two CTAs per SM; channelwise scales for the smallest and largest blocks; plus every shape.

    Block size 16 only with fp16 on two CTAs per SM (the 128-register cut, where spills would show): its kernels
    are block size 8's without the operand swap (MoeConfig.swap); the rest of the unswapped 16-row loop is the
    dense list's and the shapes loop below. Block size 48 only with fp16. (Both kept out to hold the CI compile
    time: 125 instantiations, as before the swap.)"""
    out = set()
    for act in (S.F16, S.BF16):
        for weight in WEIGHTS:
            for bs in SUPPORTED_BLOCK_SIZES:
                if bs in (16, 48) and act is S.BF16:  # 48: bf16's 64-row blocks hold more registers
                    continue
                for items in (1, 1000):
                    for blocks in ((2,) if bs == 16 else (1, 2)):
                        out.add(moe.choose_moe_config(act, weight, bs, 4096, 7168, 128, items, 132, SMEM_SM90,
                                                      SM_SMEM_SM90, blocks))
            for bs in (SUPPORTED_BLOCK_SIZES[0], SUPPORTED_BLOCK_SIZES[-1]):
                out.add(moe.choose_moe_config(act, weight, bs, 4096, 7168, -1, 1000, 132, SMEM_SM90))
    for n_tiles, k_warp in DEFAULT_MOE_POLICY.small_shapes:
        out.add(moe.MoeConfig(S.F16, S.U4, 2, n_tiles, k_warp, 8))
    for n_tiles, k_warp in DEFAULT_MOE_POLICY.large_shapes:
        out.add(moe.MoeConfig(S.BF16, S.U8, 4, n_tiles, k_warp, 4, gemm.GROUP_CHANNELWISE))
    return sorted(out, key=lambda c: c.name_expression)


CONFIGS = _configs()
ELEMENTWISE = ("mwb::silu_and_mul<__half>", "mwb::silu_and_mul<__nv_bfloat16>", "mwb::moe_sum<__half>",
               "mwb::moe_sum<__nv_bfloat16>", "mwb::gather_rows", "mwb::add_bias<__half>",
               "mwb::add_bias<__nv_bfloat16>", "mwb::moe_align")
NAMES = [c.name_expression for c in CONFIGS] + list(ELEMENTWISE)


def test_source_inlines_the_shared_headers():
    src = moe.moe_kernel_source()
    assert '#include "' not in src
    for header in ("dequant.cuh", "mma.cuh", "marlin_mainloop.cuh"):  # shared with the dense kernel, not copied
        assert (gemm.KERNEL_DIR / header).read_text().splitlines()[0] in src


@pytest.mark.parametrize("arch", ARCHS)
def test_nvcc_builds_without_warnings_or_spills(arch, tmp_path):
    log = nvcc_cubin(moe.MOE_KERNEL_SOURCE, NAMES, arch, tmp_path)
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill stores", log)]
    assert spills and max(spills) == 0, log[-4000:]


@pytest.mark.parametrize("arch", ARCHS)
def test_nvrtc_builds_without_warnings(arch):
    nvrtc_cubin(moe.moe_kernel_source(), NAMES[:4] + list(ELEMENTWISE), arch)


def test_config_choice():
    # decode on a wide layer: 128-column items still give every SM one
    wide = moe.choose_moe_config(S.F16, S.U4B8, 8, 14336, 4096, 128, 2, 132, SMEM_SM90)
    assert (wide.block_n, wide.block_k, wide.m_blocks) == (128, 256, 1)
    # decode on a narrow one (DeepSeek-V2-Lite-like): 64-column items to fill the SMs
    narrow = moe.choose_moe_config(S.F16, S.U4B8, 8, 1408, 2048, 128, 6, 132, SMEM_SM90)
    assert narrow.block_n == 64 and 1408 % narrow.block_n == 0
    for bs in SUPPORTED_BLOCK_SIZES:
        cfg = moe.choose_moe_config(S.BF16, S.U8, bs, 1024, 1024, 32, 100, 132, 163 * 1024)
        assert cfg.m_blocks * 16 >= bs and cfg.smem_bytes <= 163 * 1024
    # a K no tile divides plans as K rounded up to 128 (its last step runs past K; the kernel predicates the edge)
    odd = moe.choose_moe_config(S.F16, S.U4B8, 16, 64, 96, -1, 1, 132, SMEM_SM90)
    assert odd.block_k == 128 and odd.block_n == 64
    # channelwise scales are a template argument of the kernel (no runtime branch in the loop)
    assert moe.choose_moe_config(S.F16, S.U4B8, 8, 4096, 4096, -1, 8, 132, SMEM_SM90).group_mode == \
        gemm.GROUP_CHANNELWISE


def test_two_ctas_per_sm_choice():
    """16-row items with 4-bit weights run two CTAs per SM (128-register kernel, ring within half an SM) when the
    one-CTA grid would leave some CTA several items; never for 8-bit weights, 32+-row items or unknown SM memory."""
    half = SM_SMEM_SM90 // 2 - gemm.SMEM_RESERVED_PER_BLOCK
    # Mixtral-like decode: 2 blocks x 112 column tiles > 132 SMs
    two = moe.choose_moe_config(S.F16, S.U4B8, 8, 14336, 4096, 128, 2, 132, SMEM_SM90, SM_SMEM_SM90)
    assert two.blocks_per_sm == 2 and two.smem_bytes <= half and two.name_expression.endswith(", 2, true>")
    # DeepSeek-V2-Lite-like decode: 6 x 22 = 132 items, one per SM already
    assert moe.choose_moe_config(S.F16, S.U4B8, 8, 1408, 2048, 128, 6, 132, SMEM_SM90, SM_SMEM_SM90).blocks_per_sm == 1
    assert moe.choose_moe_config(S.F16, S.U8B128, 8, 14336, 4096, 128, 2, 132, SMEM_SM90,
                                 SM_SMEM_SM90).blocks_per_sm == 1
    assert moe.choose_moe_config(S.F16, S.U4B8, 32, 14336, 4096, 128, 64, 132, SMEM_SM90, SM_SMEM_SM90,
                                 2).blocks_per_sm == 1  # no two-CTA kernel for 32-row items
    assert moe.choose_moe_config(S.F16, S.U4B8, 8, 14336, 4096, 128, 2, 132, SMEM_SM90).blocks_per_sm == 1
    # forced either way (the A/B)
    assert moe.choose_moe_config(S.F16, S.U4B8, 8, 14336, 4096, 128, 2, 132, SMEM_SM90, SM_SMEM_SM90,
                                 1).blocks_per_sm == 1
    assert moe.choose_moe_config(S.BF16, S.U8, 16, 1408, 2048, 64, 1, 132, SMEM_SM90, SM_SMEM_SM90,
                                 2).blocks_per_sm == 2
    with pytest.raises(ValueError, match="blocks_per_sm = 3 must be 0"):
        moe.choose_moe_config(S.F16, S.U4B8, 8, 14336, 4096, 128, 2, 132, SMEM_SM90, SM_SMEM_SM90, 3)


def test_moe_and_dense_configs_share_the_geometry():
    """One place for block shapes and shared memory: MoeConfig's equal KernelConfig's for the same template
    arguments (the kernels share marlin_mainloop.cuh's Geometry)."""
    for weight in WEIGHTS:
        for m_blocks, n_tiles, k_warp, stages in ((1, 2, 4, 8), (2, 1, 2, 4), (4, 2, 1, 3)):
            for mode in (gemm.GROUP_GROUPED, gemm.GROUP_CHANNELWISE):
                d = gemm.KernelConfig(S.F16, weight, m_blocks, n_tiles, k_warp, stages, mode)
                m = moe.MoeConfig(S.F16, weight, m_blocks, n_tiles, k_warp, stages, mode)
                assert (m.block_m, m.block_n, m.block_k, m.smem_bytes) == (d.block_m, d.block_n, d.block_k,
                                                                           d.smem_bytes)


def test_numba_moe_align_compiles_for_sm90():
    import subprocess as sp
    import sys

    # a fresh process: this one may have imported numba.cuda under the simulator
    code = ("from numba import cuda, types\n"
            "from kernels_numba import moe_align as m\n"
            "v = types.int32[::1]\n"
            "sig = (v, types.int32, types.int32, types.int32, v, types.boolean, v, v, v)\n"
            "ptx, _ = cuda.compile_ptx(m._moe_align_kernel.py_func, sig, cc=(9, 0))\n"
            "assert 'atom.shared' in ptx, 'shared-memory atomics expected'\n")
    env = {k: v for k, v in __import__("os").environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    proc = sp.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if "CudaSupportError" in proc.stderr or "libNVVM" in proc.stderr:
        pytest.skip("Numba cannot reach NVVM on this machine")
    assert proc.returncode == 0, proc.stderr[-3000:]


class _DeviceArrayStandIn:
    """Just enough of a CuPy array for moe_align_block_size's checks (shape, dtype, flags, device, the CUDA array
    interface) with a data pointer nothing may read: every case below must be rejected before any allocation or
    launch, which is what lets this run without a GPU."""

    def __init__(self, shape, dtype=np.int32, contiguous=True, device=0):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.size = int(np.prod(self.shape))
        self.flags = {"C_CONTIGUOUS": contiguous}
        self.device = types.SimpleNamespace(id=device)
        self.__cuda_array_interface__ = {"shape": self.shape, "typestr": self.dtype.str, "data": (0xDEAD0000, False),
                                         "version": 3}


def test_moe_align_wrapper_rejects_bad_input_before_launch(monkeypatch):
    """workbench.moe.moe_align_block_size names the offending value and raises before it touches CuPy."""
    def no_gpu(*_args, **_kwargs):
        raise AssertionError("validation reached CuPy: the check must come before any allocation or launch")

    class NoCuPy:  # CuPy as the runtime sees it: any use fails the test
        def __getattr__(self, name):
            no_gpu()

    monkeypatch.setattr(rt_arrays, "_cupy_module", NoCuPy())
    monkeypatch.setattr(moe.kernels, "get_moe_kernel", no_gpu)
    ids = _DeviceArrayStandIn((4, 2))
    cases = [
        ((np.zeros((4, 2), np.int32), 8, 4), {}, TypeError, r"topk_ids is not on GPU \(got numpy.ndarray"),
        ((_DeviceArrayStandIn((8,)), 8, 4), {}, ValueError, r"2-D \(M, top_k\) array, got shape \(8,\)"),
        ((_DeviceArrayStandIn((4, 2), contiguous=False), 8, 4), {}, ValueError, "contiguous"),
        ((_DeviceArrayStandIn((4, 2), np.int64), 8, 4), {}, TypeError, "topk_ids dtype = int64 must be int32"),
        ((ids, 0, 4), {}, ValueError, "block_size = 0 must be > 0"),
        ((ids, 8.0, 4), {}, TypeError, "block_size must be an int"),
        ((ids, 8, 0), {}, ValueError, r"num_experts = 0 must be in \[1, 1024\]"),
        ((ids, 8, 1025), {}, ValueError, r"num_experts = 1025 must be in \[1, 1024\]"),
        ((ids, 2 ** 30, 4), {}, ValueError, "does not fit the kernel's 32-bit indices"),
        ((ids, 8, 4, np.zeros(4, np.int32)), {}, TypeError, r"expert_map is not on GPU \(got numpy.ndarray"),
        ((ids, 8, 4, _DeviceArrayStandIn((3,))), {}, ValueError, r"expert_map must be a contiguous \(4,\) array, "
                                                                   r"got shape \(3,\)"),
        ((ids, 8, 4, _DeviceArrayStandIn((4,), np.int64)), {}, TypeError, "expert_map dtype = int64 must be int32"),
        ((ids, 8, 4, _DeviceArrayStandIn((4,), device=1)), {}, ValueError,
         "expert_map is on device 1, topk_ids on device 0"),
    ]
    for args, kwargs, error, message in cases:
        with pytest.raises(error, match=message):
            moe.moe_align_block_size(*args, **kwargs)
    # a valid call gets past every check and reaches CuPy (here: the stand-in's AssertionError), so the cases above
    # fail on their own checks, not on something earlier
    with pytest.raises(AssertionError, match="validation reached CuPy"):
        moe.moe_align_block_size(ids, 8, 4, _DeviceArrayStandIn((4,)))
