"""Every CUDA C++ source in kernels_cuda/ builds for sm_80 and sm_90, with nvcc and with NVRTC (the compiler CuPy
uses, driven here through cuda.core), with no warnings. Needs no GPU: both compilers only generate code.

The instantiations cover every weight type, both activation types, every N_TILES / K_WARP shape, M_BLOCKS 1..4,
several stage depths and every group mode (channelwise, grouped, per-row act-order shard); the template is the same for the rest.
"""
import io
import pathlib
import shutil
import subprocess

import pytest

from workbench import gemm
from workbench.scalar_types import ScalarType as S

ARCHS = (80, 90)
CONFIGS = (
    gemm.KernelConfig(S.F16, S.U4B8, 1, 2, 4, 8, gemm.GROUP_GROUPED),
    gemm.KernelConfig(S.BF16, S.U4, 1, 2, 4, 4, gemm.GROUP_GROUPED, blocks_per_sm=2),
    gemm.KernelConfig(S.BF16, S.U4, 4, 4, 2, 4, gemm.GROUP_GROUPED),
    gemm.KernelConfig(S.F16, S.U8B128, 3, 1, 1, 4, gemm.GROUP_PER_ROW),
    gemm.KernelConfig(S.BF16, S.U8, 2, 2, 1, 8, gemm.GROUP_PER_ROW),
    gemm.KernelConfig(S.F16, S.U4, 1, 1, 1, 4, gemm.GROUP_CHANNELWISE),
    gemm.KernelConfig(S.F16, S.FE4M3FN, 1, 2, 2, 6, gemm.GROUP_CHANNELWISE),
    gemm.KernelConfig(S.BF16, S.FE4M3FN, 4, 2, 2, 4, gemm.GROUP_GROUPED),
)
EXTRA_KERNELS = ("mwb::permute_cols<__half>", "mwb::permute_cols<__nv_bfloat16>")
NAMES = [c.name_expression for c in CONFIGS] + list(EXTRA_KERNELS)


def test_every_cu_file_is_the_one_we_build():
    sources = sorted(p.name for p in gemm.KERNEL_DIR.glob("*.cu"))
    # marlin_moe.cu (issue 7) has its own compile checks in tests/compile/test_moe_compile.py
    assert sources == sorted([gemm.KERNEL_SOURCE, "marlin_moe.cu"]), f"a new .cu file needs a compile check: {sources}"


def test_kernel_source_inlines_its_headers():
    src = gemm.kernel_source()
    assert '#include "' not in src
    for header in gemm.KERNEL_DIR.glob("*.cuh"):
        assert header.read_text().splitlines()[0] in src, header.name


@pytest.mark.parametrize("arch", ARCHS)
def test_nvcc_builds_cubin_without_warnings(arch, tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not installed on this machine")
    wrapper = tmp_path / "instantiate.cu"
    # Taking each kernel's address in host code makes nvcc instantiate and compile it.
    addresses = ",\n".join(f"  reinterpret_cast<const void*>(&{name})" for name in NAMES)
    wrapper.write_text(f'#include "{gemm.KERNEL_SOURCE}"\nconst void* kInstances[] = {{\n{addresses}\n}};\n')
    cmd = [nvcc, "-std=c++17", "-cubin", f"-arch=sm_{arch}", "-I", str(gemm.KERNEL_DIR), "-Werror", "all-warnings",
           "-Xptxas", "-v", "-o", str(tmp_path / "out.cubin"), str(wrapper)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "warning" not in proc.stderr.lower(), proc.stderr[-4000:]
    assert (tmp_path / "out.cubin").stat().st_size > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_nvrtc_builds_cubin_without_warnings(arch):
    core = pytest.importorskip("cuda.core", reason="cuda-core is not installed (pip install cuda-core)")
    pathfinder = pytest.importorskip("cuda.pathfinder")
    include = pathfinder.find_nvidia_header_directory("cudart")
    if include is None:
        pytest.skip("no CUDA headers found (pip install 'cuda-toolkit[cudart]==13.0.*')")
    options = core.ProgramOptions(std="c++17", arch=f"sm_{arch}", include_path=[include])
    program = core.Program(gemm.kernel_source(), "c++", options=options)
    log = io.StringIO()
    module = program.compile("cubin", name_expressions=NAMES, logs=log)
    assert "warning" not in log.getvalue().lower(), log.getvalue()
    assert len(bytes(module.code)) > 0  # (looking kernels up by name needs a driver, so it is left to tests/gpu)


def test_shared_memory_of_every_config_fits_sm80():
    """sm_80 allows 163 KiB of opt-in shared memory per block; choose_config must never pick more."""
    for act in (S.F16, S.BF16):
        for weight in gemm.GEMM_WEIGHT_TYPES:
            for m in (1, 17, 33, 64, 300):
                for per_row in (False, True):
                    cfg = gemm.choose_config(act, weight, m, 1024, 1024, 128, per_row, 163 * 1024)
                    assert cfg.smem_bytes <= 163 * 1024
