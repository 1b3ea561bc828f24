"""Offline builds of kernels_cuda/ sources for the compile tier: nvcc and NVRTC (through cuda.core, the compiler CuPy
uses). Both only generate code, so no GPU is needed. Each returns the compiler's log; the tests assert on it."""
import io
import pathlib
import shutil
import subprocess

import pytest

from workbench import gemm

ARCHS = (80, 90)


def nvcc_cubin(source_name: str, names, arch: int, tmp_path: pathlib.Path) -> str:
    """Build ``kernels_cuda/<source_name>`` with the given template instantiations into a cubin; returns stderr
    (``-Xptxas -v``: registers, spills). Fails the test on a compiler error or warning; skips without nvcc."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not installed on this machine")
    wrapper = tmp_path / "instantiate.cu"
    # Taking each kernel's address in host code makes nvcc instantiate and compile it.
    addresses = ",\n".join(f"  reinterpret_cast<const void*>(&{name})" for name in names)
    wrapper.write_text(f'#include "{source_name}"\nconst void* kInstances[] = {{\n{addresses}\n}};\n')
    cmd = [nvcc, "-std=c++17", "-cubin", f"-arch=sm_{arch}", "-I", str(gemm.KERNEL_DIR), "-Werror", "all-warnings",
           "-Xptxas", "-v", "-o", str(tmp_path / "out.cubin"), str(wrapper)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "warning" not in proc.stderr.lower(), proc.stderr[-4000:]
    assert (tmp_path / "out.cubin").stat().st_size > 0
    return proc.stderr


def nvrtc_cubin(source: str, names, arch: int) -> str:
    """Build inlined CUDA source with NVRTC for the given name expressions; returns the log. Fails on a warning."""
    core = pytest.importorskip("cuda.core", reason="cuda-core is not installed (pip install cuda-core)")
    pathfinder = pytest.importorskip("cuda.pathfinder")
    include = pathfinder.find_nvidia_header_directory("cudart")
    if include is None:
        pytest.skip("no CUDA headers found (pip install 'cuda-toolkit[cudart]==13.0.*')")
    options = core.ProgramOptions(std="c++17", arch=f"sm_{arch}", include_path=[include])
    log = io.StringIO()
    module = core.Program(source, "c++", options=options).compile("cubin", name_expressions=list(names), logs=log)
    assert "warning" not in log.getvalue().lower(), log.getvalue()
    assert len(bytes(module.code)) > 0  # (looking kernels up by name needs a driver, so it is left to tests/gpu)
    return log.getvalue()
