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


# ---- the dense GEMM's microscaled instantiations (kernels_cuda/dequant.cuh kFE2M1, kFE2M1E8M0, kFE4M3E8M0) --------
def _fp4_configs():
    import dataclasses

    from workbench import gemm
    from workbench.scalar_types import ScalarType as S

    nv, mx = dict(), dict(e8m0_scales=True)
    base = (  # (act, weight, m_blocks, n_tiles, k_warp, stages, blocks_per_sm, swap, scales): one of each path
        (S.F16, S.FE2M1F, 1, 2, 4, 6, 1, True, nv),   # M <= 8, one block per SM (kWarpFetch: per-warp scale rows)
        (S.BF16, S.FE2M1F, 1, 2, 4, 3, 2, False, nv),  # M = 9..16, two blocks per SM (fp16 -> bf16 scale widening)
        (S.F16, S.FE2M1F, 4, 4, 2, 4, 1, False, nv),  # 64 rows, group reloads between k16 tiles
        (S.F16, S.FE2M1F, 1, 1, 1, 4, 1, False, nv),   # K_WARP = 1: one group per stage row
        (S.BF16, S.FE2M1F, 1, 2, 4, 6, 1, True, mx),  # MXFP4
        (S.BF16, S.FE4M3FN, 4, 2, 2, 4, 1, False, mx),  # MXFP8
    )
    cfgs = [dataclasses.replace(gemm.KernelConfig(a, w, mb, nt, kw, st, gemm.GROUP_GROUPED, blocks_per_sm=b, swap=sw),
                                **extra) for a, w, mb, nt, kw, st, b, sw, extra in base]
    clusters = [dataclasses.replace(cfgs[0], cluster=4)]
    return cfgs, clusters


@pytest.mark.parametrize("arch", (80, 90))
def test_fp4_gemm_kernels_build_without_warnings_or_spills(arch, tmp_path):
    import importlib.util
    import pathlib

    from cuda_build import nvcc_cubin
    from workbench import gemm

    # the GEMM compile tier's -Xptxas -v parser (tests/compile is not a package)
    spec = importlib.util.spec_from_file_location("test_cuda_compile",
                                                  pathlib.Path(__file__).with_name("test_cuda_compile.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    spills_per_function = module.spills_per_function

    cfgs, clusters = _fp4_configs()
    names = [c.name_expression for c in cfgs] + ([c.name_expression for c in clusters] if arch >= 90 else [])
    spills = spills_per_function(nvcc_cubin(gemm.KERNEL_SOURCE, names, arch, tmp_path))
    assert len(spills) >= len(names), spills
    assert not any(spills.values()), {k: v for k, v in spills.items() if v}


def test_fp4_gemm_kernels_build_with_nvrtc_and_mirror_the_host():
    """NVRTC (CuPy's compiler) builds them; the host's mirrors hold for the microscaled codes: no late scaling
    (KernelConfig.late_scale), the same shared memory (TileGeometry.smem_bytes), the per-warp scale regions."""
    from cuda_build import nvrtc_cubin
    from workbench import gemm

    cfgs, clusters = _fp4_configs()
    checks = []
    for c in cfgs:
        t = "__half" if c.act.label == "f16" else "__nv_bfloat16"
        code = c.weight.abi_code + 16 * c.e8m0_scales
        sw = str(bool(c.swap)).lower()
        loop = (f"mwb::WarpLoop<{t}, {code}, {c.m_blocks}, {c.n_tiles}, {c.k_warp}, {c.stages}, {c.group_mode}, {sw}, "
                f"mwb::late_scale_pays<{c.blocks_per_sm}, {sw}, {c.k_warp}>()>")
        geo = f"mwb::Geometry<{t}, {code}, {c.m_blocks}, {c.n_tiles}, {c.k_warp}, {c.stages}, {c.group_mode}>"
        checks.append(f'static_assert(!{loop}::kLateScale && !{str(c.late_scale).lower()}, "{c}");')
        checks.append(f'static_assert({geo}::kSmemBytes == {c.smem_bytes}, "{c}");')
    nvrtc_cubin(gemm.kernel_source() + "\n" + "\n".join(checks) + "\n",
                [c.name_expression for c in cfgs + clusters], 90)
