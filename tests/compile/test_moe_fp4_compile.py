"""kernels_cuda/marlin_moe.cu's microscaled instantiations (NVFP4 fp16 / bf16, MXFP4 and MXFP8 bf16) and the clamped
SwiGLU build with nvcc (sm_80, sm_90) without warnings or spills, for the tiles the host chooses at the small and
gpt-oss-like shapes of the GPU tests and benchmarks (every block size), one and two CTAs per SM. Needs no GPU."""
import re

import pytest

from cuda_build import ARCHS, nvcc_cubin, nvrtc_cubin
from workbench import moe
from workbench.formats.moe_align import SUPPORTED_BLOCK_SIZES
from workbench.scalar_types import ScalarType as S

SMEM_SM90, SM_SMEM_SM90 = 227 * 1024, 228 * 1024
FORMATS = ((S.F16, S.FE2M1F, 16, False), (S.BF16, S.FE2M1F, 16, False), (S.BF16, S.FE2M1F, 32, True),
           (S.BF16, S.FE4M3FN, 32, True))  # (act, weight, group, E8M0 scales): NVFP4 x2, MXFP4, MXFP8
SHAPES = ((256, 128), (2880, 5760), (2880, 2880), (7168, 2048))  # (K, N): tests, gpt-oss-like, DeepSeek-like


def _configs():
    out = set()
    for act, wt, group, e8m0 in FORMATS:
        for k, n in SHAPES:
            for bs in SUPPORTED_BLOCK_SIZES:
                for items in (1, 1000):
                    for blocks in (1, 2):
                        out.add(moe.choose_moe_config(act, wt, bs, n, k, group, items, 132, SMEM_SM90, SM_SMEM_SM90,
                                                      blocks, e8m0_scales=e8m0))
    return sorted(out, key=lambda c: c.name_expression)


CONFIGS = _configs()
ACTIVATIONS = ("mwb::swiglu_oai_and_mul<__half>", "mwb::swiglu_oai_and_mul<__nv_bfloat16>")


def test_microscaled_names_carry_the_e8m0_code():
    codes = {re.match(r"mwb::marlin_moe<[^,]+, (\d+),", c.name_expression).group(1) for c in CONFIGS}
    assert codes == {"9", "25", "24"}  # kFE2M1, kFE2M1E8M0, kFE4M3E8M0 (dequant.cuh)


@pytest.mark.parametrize("arch", ARCHS)
def test_nvcc_builds_the_microscaled_moe_kernels_without_spills(arch, tmp_path):
    log = nvcc_cubin(moe.MOE_KERNEL_SOURCE, [c.name_expression for c in CONFIGS] + list(ACTIVATIONS), arch,
                     tmp_path)
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill stores", log)]
    assert spills and max(spills) == 0, log[-4000:]


def test_nvrtc_builds_them():
    nvrtc_cubin(moe.moe_kernel_source(), [c.name_expression for c in CONFIGS[:6]] + list(ACTIVATIONS), 90)
