"""The GPU tier's dequantization probe (tests/dequant_probe.py: dequant_subblock of kernels_cuda/dequant.cuh on
arrays of cases) builds offline with NVRTC for every weight type and activation type, so the GPU test fails only on
a difference in behaviour."""
import pytest

import dequant_probe
from cuda_build import ARCHS, nvrtc_cubin
from workbench.scalar_types import ScalarType as S

TYPES = [S.U4, S.U4B8, S.U8, S.U8B128, S.FE4M3FN]


@pytest.mark.parametrize("arch", ARCHS)
def test_dequant_probe_builds_for_every_type(arch):
    names = [dequant_probe.name_expression(act, wt.abi_code, scaled)
             for act in dequant_probe.ACT_TYPES for wt in TYPES for scaled in (True, False)]
    assert len(names) == 20
    nvrtc_cubin(dequant_probe.source(), names, arch)
