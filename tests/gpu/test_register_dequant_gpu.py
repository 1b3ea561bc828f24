"""GPU tier: the kernels' dequant_subblock (kernels_cuda/dequant.cuh, through the probe in tests/dequant_probe.py)
writes exactly the registers the NumPy mirror workbench.formats.register_dequant computes, bit for bit: every
(code, zero) in every field position, every pair of codes that share a register, every E4M3 byte (NaN codes
included: the bit move does not special-case them), and random words, scaled and unscaled, fp16 and bf16.
Outputs are poisoned before each launch. Skipped with a reason without a GPU."""
import numpy as np
import pytest

from workbench import hardware

pytestmark = pytest.mark.gpu
if hardware.gpu_skip_reason():
    pytest.skip(hardware.gpu_skip_reason(), allow_module_level=True)

cupy = pytest.importorskip("cupy", reason="CuPy compiles and launches the dequantization probe")

import dequant_probe  # noqa: E402
from workbench.formats import register_dequant as rd  # noqa: E402
from workbench.scalar_types import ScalarType as S  # noqa: E402

TYPES = [S.U4, S.U4B8, S.U8, S.U8B128, S.FE4M3FN]
POISON = 0xDEADBEEF


def _cases(wt: S, rng):
    """(n, words_per_subblock) words and (n, 2) zeros: structured sets that hold every code under every zero in every
    field and every pair of codes that share a register, then random words."""
    v = np.arange(1 << 16, dtype=np.uint32)
    spread = (v & np.uint32(0xFF)) | ((v >> np.uint32(8)) << np.uint32(16))
    rand = rng.integers(0, 1 << 32, (1 << 14, 2), dtype=np.uint64).astype(np.uint32)
    if wt.bits == 4:
        words = np.concatenate([spread | (spread << np.uint32(8)), rand[:, 0]])[:, None]
        zmax = 16
    else:
        words = np.concatenate([np.stack([spread, spread << np.uint32(8)], -1), rand])
        zmax = 256
    zeros = rng.integers(0, zmax, (words.shape[0], 2))
    zeros[:v.size, 0] = v % zmax
    return np.ascontiguousarray(words), zeros


@pytest.fixture(scope="module")
def module():
    names = [dequant_probe.name_expression(act, wt.abi_code, scaled)
             for act in dequant_probe.ACT_TYPES for wt in TYPES for scaled in (True, False)]
    return cupy.RawModule(code=dequant_probe.source(), options=("-std=c++17",), name_expressions=names)


@pytest.mark.parametrize("scaled", [True, False], ids=["scaled", "unscaled"])
@pytest.mark.parametrize("act", [rd.F16, rd.BF16], ids=str)
@pytest.mark.parametrize("wt", TYPES, ids=str)
def test_kernel_registers_equal_the_numpy_mirror(module, wt, act, scaled, rng):
    words, zeros = _cases(wt, rng)
    n = words.shape[0]
    scales = rng.uniform(0.01, 4.0, (n, 2)).astype(act)
    kernel_zeros = np.broadcast_to(rd.zero_of(wt, zeros), (n, 2)).astype(np.int32) if wt is not S.FE4M3FN \
        else np.zeros((n, 2), np.int32)
    expect = rd.dequant_subblock(words, wt, act, scales, zeros if wt.has_zero_points else None, scaled=scaled)
    out = cupy.full((n, 2, 2), POISON, dtype=cupy.uint32)
    kernel = module.get_function(dequant_probe.name_expression(str(act), wt.abi_code, scaled))
    kernel(((n + 255) // 256,), (256,), (cupy.asarray(words), cupy.asarray(np.ascontiguousarray(kernel_zeros)),
                                         cupy.asarray(scales.view(np.uint16)), out, np.int32(n)))
    got = out.get()
    bad = np.argwhere(got != expect)
    assert bad.size == 0, (f"{bad.shape[0]} registers differ; first: case {bad[0][0]} b[{bad[0][1]}][{bad[0][2]}] "
                           f"words {words[bad[0][0]]} zeros {zeros[bad[0][0]]}: kernel {got[tuple(bad[0])]:#010x}, "
                           f"numpy {expect[tuple(bad[0])]:#010x}")
