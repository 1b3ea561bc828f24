"""The teaching kernel compiles for sm_80 and sm_90 with the real Numba CUDA compiler, and its dequantization
helpers give the NumPy mirror's values under compiled integer semantics (numba.njit: ``uintN op literal`` widens
instead of wrapping as in the simulator), for every code in every field. Needs no GPU."""
import os
import shutil
import subprocess
import types

import numpy as np
import pytest

if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1":
    pytest.skip("NUMBA_ENABLE_CUDASIM=1: the offline compile check needs the real Numba CUDA compiler; it runs in "
                "the tests/compile process", allow_module_level=True)

import numba  # noqa: E402
from numba import cuda  # noqa: E402

from kernels_numba import teaching_gemm as tg  # noqa: E402
from workbench.formats import register_dequant as rd  # noqa: E402

TARGETS = list(tg.compile_targets())


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas (CUDA toolkit) is not on PATH")
@pytest.mark.parametrize("cc", [(8, 0), (9, 0)], ids=lambda cc: f"sm_{cc[0]}{cc[1]}")
@pytest.mark.parametrize("name,pyfunc,argtypes", TARGETS, ids=[t[0] for t in TARGETS])
def test_teaching_kernel_compiles_and_assembles(name, pyfunc, argtypes, cc, tmp_path):
    ptx, _ = cuda.compile_ptx(pyfunc, argtypes, cc=cc)
    (tmp_path / "k.ptx").write_text(ptx)
    result = subprocess.run(["ptxas", f"-arch=sm_{cc[0]}{cc[1]}", "-v", str(tmp_path / "k.ptx"), "-o",
                             str(tmp_path / "k.cubin")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "0 bytes spill stores" in result.stderr, result.stderr


def _njit_with_helpers(device_function):
    """njit the device function's body with magic_value njit-compiled too (a CUDA dispatcher cannot be called from
    CPU code)."""
    f = device_function.py_func
    env = dict(f.__globals__, magic_value=numba.njit(tg.magic_value.py_func))
    return numba.njit(types.FunctionType(f.__code__, env, f.__name__, f.__defaults__, f.__closure__))


@pytest.mark.parametrize("bits", [4, 8])
def test_dequant_helpers_under_compiled_integer_semantics(bits):
    v = np.arange(1 << 16, dtype=np.uint32)
    spread = (v & np.uint32(0xFF)) | ((v >> np.uint32(8)) << np.uint32(16))  # every pair of codes of a register
    if bits == 4:
        words = (spread | (spread << np.uint32(8)))[:, None]
        helper = _njit_with_helpers(tg.dequant_subblock_4bit)
        weight_type = "u4b8"
    else:
        words = np.stack([spread, spread << np.uint32(8)], axis=-1)
        helper = _njit_with_helpers(tg.dequant_subblock_8bit)
        weight_type = "u8b128"

    @numba.njit
    def run(words):
        out = np.empty((words.shape[0], 8), np.float32)
        for i in range(words.shape[0]):
            for h in range(2):
                if bits == 4:
                    helper(words[i, 0], h, np.float32(1.0), out[i], 4 * h)
                else:
                    helper(words[i, h], np.float32(1.0), out[i], 4 * h)
        return out

    got = run(words)
    regs = rd.dequant_subblock(words, weight_type, np.float16, np.ones((words.shape[0], 2), np.float16), scaled=False)
    lo, hi = rd.halves(regs, np.float16)  # (n, h, r): element 2r + half of half h
    expect = np.stack([lo, hi], axis=-1).reshape(words.shape[0], 8).astype(np.float32)
    assert np.array_equal(got, expect)
