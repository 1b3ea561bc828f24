"""GPU tier: the teaching kernel (kernels_numba/teaching_gemm.py) compiled for the real GPU, where Numba's integer
rules differ from the simulator's (uintN op literal widens to 64 bits): identity activations give the dequantized
weight exactly, exact sums equal the reference exactly, at a few tiles and at a shape with many blocks. Skipped
with a reason without a GPU."""
import numpy as np
import pytest

from workbench import hardware

pytestmark = pytest.mark.gpu
if hardware.gpu_skip_reason():
    pytest.skip(hardware.gpu_skip_reason(), allow_module_level=True)

from kernels_numba import teaching_gemm as tg  # noqa: E402
from workbench.formats import marlin_tile as mt  # noqa: E402
from workbench.formats import scales as sc  # noqa: E402
from workbench.quantize import dequantize  # noqa: E402


@pytest.mark.parametrize("weight_type,bits", [("u4b8", 4), ("u8b128", 8)])
@pytest.mark.parametrize("size_m,size_k,size_n,group_size", [(16, 64, 64, 32), (37, 512, 1024, 128),
                                                             (16, 256, 256, -1)])
def test_teaching_kernel_on_the_gpu_equals_the_reference_exactly(weight_type, bits, size_m, size_k, size_n,
                                                                 group_size, rng):
    codes = rng.integers(0, 1 << bits, (size_k, size_n), dtype=np.uint8)
    ng = sc.num_groups(size_k, group_size)
    scales = (2.0 ** rng.integers(-4, 2, (ng, size_n))).astype(np.float16)  # dyadic: every sum below is exact
    qweight = mt.marlin_repack_codes(codes, bits)
    marlin_scales = sc.permute_scales(scales, size_k, size_n, group_size)
    w = dequantize(codes, scales, None, weight_type, group_size, rounded=False)
    eye = np.eye(size_k, dtype=np.float32)[:size_m]
    assert np.array_equal(tg.teaching_gemm(eye, qweight, marlin_scales, size_k, size_n, weight_type, group_size),
                          w[:size_m])
    a = rng.integers(-4, 5, (size_m, size_k)).astype(np.float32)
    got = tg.teaching_gemm(a, qweight, marlin_scales, size_k, size_n, weight_type, group_size)
    assert np.array_equal(got, a.astype(np.float64) @ w)
