"""Offline compile check of the microscaled formats' Numba kernels (kernels_numba/fp4_repack.py), and their scale
byte helpers under compiled integer semantics, exhaustively against the NumPy references.

Runs in the process *without* NUMBA_ENABLE_CUDASIM (as tests/compile/test_numba_compile.py).
"""
import os
import shutil
import subprocess

import numpy as np
import pytest

if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1":
    pytest.skip("NUMBA_ENABLE_CUDASIM=1: the offline compile check needs the real Numba CUDA compiler; it runs in "
                "the tests/compile process", allow_module_level=True)

import numba  # noqa: E402
from numba import cuda  # noqa: E402

from kernels_numba import fp4_repack  # noqa: E402
from workbench.formats import fp4_marlin as fm  # noqa: E402

TARGETS = list(fp4_repack.compile_targets())


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas (CUDA toolkit) is not on PATH")
@pytest.mark.parametrize("name,pyfunc,argtypes", TARGETS, ids=[t[0] for t in TARGETS])
def test_kernel_compiles_and_assembles(name, pyfunc, argtypes, tmp_path):
    ptx, _ = cuda.compile_ptx(pyfunc, argtypes, cc=(8, 0))
    ptx_file = tmp_path / "kernel.ptx"
    ptx_file.write_text(ptx)
    result = subprocess.run(["ptxas", "-arch=sm_80", str(ptx_file), "-o", str(tmp_path / "kernel.cubin")],
                            capture_output=True, text=True)
    assert result.returncode == 0, f"{name}: ptxas failed\n{result.stderr}"


def test_scale_byte_helpers_under_compiled_integer_semantics():
    forward = numba.njit(fp4_repack.s0e5m3_of_e4m3.py_func)
    backward = numba.njit(fp4_repack.e4m3_of_s0e5m3.py_func)
    magnitudes = np.arange(0x7F, dtype=np.uint8)
    for s in range(0, 8):
        got = np.array([forward(int(m), s) for m in magnitudes])
        fits = got <= 0xFF
        want, _ = fm.nvfp4_marlin_process_scales(np.resize(magnitudes[fits], (1, 128)) if fits.sum() >= 64 else
                                                 np.resize(magnitudes[fits], (1, 64)), 2.0 ** s, np.float16)
        back = fm.shuffle_scales(want)  # undo the shuffle: byte i of the row is magnitude i (resized)
        row = np.resize(magnitudes[fits], back.shape[1])
        assert np.array_equal(back[0], np.array([forward(int(m), s) for m in row], np.uint8)), s
        raw = np.resize(np.arange(256, dtype=np.uint8), (1, 256))
        assert np.array_equal(fm.shuffle_scales(fm.nvfp4_marlin_unprocess_scales(raw, 2.0 ** s))[0],
                              np.array([backward(int(b), s) for b in raw[0]], np.uint8)), s
