"""``workbench doctor``: what this machine has (GPU, CUDA, CuPy, Numba, NumPy), which paths of the workbench are
on, and why the others are off.

The same probes answer the test runner's question "can this tier run here?" (``tier_problems``): a tier whose tools
are missing skips with the reason, or fails when ``WORKBENCH_REQUIRE_TIERS`` names it (``.ci/run`` sets it).
Every probe here is read-only, and none of them imports ``numba.cuda`` unless asked (``probe_numba``), because that
import decides between the CUDA simulator and the real target for the rest of the process.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys

# Where the browser test finds Chromium (Debian's ``apt-get install chromium``); WORKBENCH_CHROMIUM overrides it.
DEFAULT_CHROMIUM = "/usr/bin/chromium"
TIERS = ("compile", "gpu", "browser")
CUPY_DISTS = ("cupy-cuda13x", "cupy-cuda12x", "cupy")  # the wheels CuPy is published as
REQUIRE_ENV = "WORKBENCH_REQUIRE_TIERS"

INSTALL_CUDA = ("install the CUDA toolkit 13.0 and put its bin/ on PATH; NVIDIA's packages are at"
                " https://developer.nvidia.com/cuda-downloads (e.g. apt-get install cuda-toolkit-13-0)")
INSTALL_CHROMIUM = "apt-get install chromium, or point WORKBENCH_CHROMIUM at a Chromium executable"


@dataclasses.dataclass(frozen=True)
class RunPath:
    """One way the workbench can run something, and whether it can here."""

    name: str
    on: bool
    detail: str


def chromium_path() -> str:
    return os.environ.get("WORKBENCH_CHROMIUM", DEFAULT_CHROMIUM)


def required_tiers() -> set[str]:
    """The tiers ``WORKBENCH_REQUIRE_TIERS`` (comma-separated) asks for; an unknown name is a ValueError."""
    names = {t.strip() for t in os.environ.get(REQUIRE_ENV, "").split(",") if t.strip()}
    unknown = sorted(names - set(TIERS))
    if unknown:
        raise ValueError(f"{REQUIRE_ENV} names {', '.join(map(repr, unknown))}; the tiers with tools to require are"
                         f" {', '.join(TIERS)}")
    return names


def package_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


@functools.lru_cache(maxsize=None)
def probe_numba() -> tuple[bool, str]:
    """(True, how) when the real Numba CUDA compiler turns a tiny kernel into PTX here, else (False, why not).

    This is where a NumPy too new for the installed numba-cuda shows up (the compiler calls NumPy functions that
    NumPy removed). It imports numba.cuda for the real target, so it is refused under the simulator."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1":
        return False, "NUMBA_ENABLE_CUDASIM=1 is set, so this process has the simulator, not the compiler"
    try:
        from numba import cuda

        def probe(out):  # one store per thread: enough to go through typing, lowering and NVVM
            i = cuda.grid(1)
            if i < out.size:
                out[i] = i

        cuda.compile_ptx(probe, "void(int32[:])", cc=(9, 0))
    except Exception as exc:  # report the compiler's reason, whatever it is
        return False, f"a test kernel does not compile: {_first_line(exc)}"
    return True, f"compiles PTX for sm_90 (numba-cuda {package_version('numba-cuda')}, NumPy {_numpy_version()})"


def _numpy_version() -> str:
    import numpy

    return numpy.__version__


def _cupy_version() -> str | None:
    return next((v for v in map(package_version, CUPY_DISTS) if v), None)


def _tool(name: str) -> str | None:
    return shutil.which(name)


def _nvcc_version(nvcc: str) -> str:
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return f"did not run ({_first_line(exc)})"
    release = [line for line in out.splitlines() if "release" in line]
    return release[-1].split("release", 1)[1].split(",")[0].strip() if release else "unknown version"


def _cuda_headers() -> str | None:
    try:
        from cuda import pathfinder
    except ImportError:
        return None
    try:
        return pathfinder.find_nvidia_header_directory("cudart")
    except Exception:  # no headers found is an answer, not an error
        return None


def _cuda_cxx_problems() -> list[str]:
    """What the offline build of kernels_cuda lacks: nvcc and ptxas, and NVRTC's runtime headers."""
    problems = []
    missing = [name for name in ("nvcc", "ptxas") if _tool(name) is None]
    if missing:
        problems.append(f"{' and '.join(missing)} not on PATH: {INSTALL_CUDA}")
    if package_version("cuda-core") is None:
        problems.append("cuda-core is not installed (pip install -e \".[test]\")")
    elif _cuda_headers() is None:
        problems.append("no CUDA runtime headers for NVRTC (pip install 'cuda-toolkit[cudart]==13.0.*')")
    return problems


def tier_problems(tier: str) -> list[str]:
    """What tier ``tier`` of the test suite needs and this machine lacks, each with how to get it ([] = ready)."""
    problems = []
    if tier == "compile":
        problems += _cuda_cxx_problems()
        ok, why = probe_numba()
        if not ok:
            problems.append(f"the Numba CUDA compiler: {why} (pip install -e \".[test]\" brings numba-cuda[cu13] and"
                            " NVVM)")
    elif tier == "gpu":
        from workbench import hardware

        reason = hardware.gpu_skip_reason()
        if reason:
            problems.append(reason)
        elif not hardware.cupy_available():
            problems.append("CuPy cannot reach the GPU (pip install -e \".[cuda]\")")
    elif tier == "browser":
        if not os.path.exists(chromium_path()):
            problems.append(f"no Chromium at {chromium_path()} ({INSTALL_CHROMIUM})")
        for module, extra in (("playwright", "browser"), ("jupyterlab", "browser")):
            try:
                importlib.import_module(module)
            except ImportError:
                problems.append(f"{module} is not installed (pip install -e \".[{extra}]\")")
    else:
        raise ValueError(f"tier = {tier!r} is not one of {', '.join(TIERS)}")
    return problems


def found() -> list[tuple[str, str]]:
    """(component, what was found) for the GPU, CUDA, CuPy, Numba and NumPy."""
    from workbench import backends, hardware

    rows = []
    if hardware.simulator_enabled():
        gpu = "not looked for: NUMBA_ENABLE_CUDASIM=1 makes this process use the CUDA simulator"
    elif hardware.gpu_available():
        gpu = hardware.describe()
    elif backends._cuda_driver_has_device():
        gpu = "the CUDA driver reports a device, but Numba cannot use it"
    else:
        gpu = "none (no CUDA driver, or it reports no device)"
    rows.append(("GPU", gpu))
    nvcc = _tool("nvcc")
    cuda = [f"nvcc {_nvcc_version(nvcc)} at {nvcc}" if nvcc else "no nvcc on PATH"]
    if hardware.gpu_available():
        try:
            from numba.cuda.cudadrv import driver

            major, minor = driver.driver.get_version()
            cuda.insert(0, f"driver for CUDA {major}.{minor}")
        except Exception as exc:  # a report, not a check: say what happened and go on
            cuda.insert(0, f"driver version unknown ({_first_line(exc)})")
    toolkit = package_version("cuda-toolkit")
    if toolkit:
        cuda.append(f"pip cuda-toolkit {toolkit}")
    rows.append(("CUDA", "; ".join(cuda)))
    rows.append(("CuPy", _cupy_version() or "not installed"))
    numba = package_version("numba")
    rows.append(("Numba", f"{numba} (numba-cuda {package_version('numba-cuda') or 'not installed'})" if numba
                 else "not installed"))
    rows.append(("NumPy", _numpy_version()))
    return rows


def paths() -> list[RunPath]:
    """Every execution path, on or off, with the reason."""
    from workbench import hardware

    sim = hardware.simulator_enabled()
    gpu = hardware.gpu_available()
    out = [RunPath("NumPy reference", True, "the spec; every op, on the CPU")]
    has_numba = package_version("numba-cuda") is not None
    out.append(RunPath("Numba kernels, CUDA simulator", has_numba and not gpu,
                       ("--backend numba picks it when there is no GPU (or set NUMBA_ENABLE_CUDASIM=1)"
                        if not gpu else "a GPU is here, so --backend numba runs the kernels on it")
                       if has_numba else "numba-cuda is not installed"))
    out.append(RunPath("Numba kernels, GPU", gpu, hardware.describe() if gpu else (hardware.gpu_skip_reason() or "")))
    ok, why = probe_numba() if not sim else (False, "not probed: NUMBA_ENABLE_CUDASIM=1 is set")
    out.append(RunPath("Numba offline compile (compile tier)", ok, why))
    nvcc_problems = _cuda_cxx_problems()
    out.append(RunPath("CUDA C++ offline compile: nvcc, NVRTC (compile tier)", not nvcc_problems,
                       "; ".join(nvcc_problems) or "nvcc, ptxas and NVRTC headers found"))
    if sim:
        native = (False, "NUMBA_ENABLE_CUDASIM=1 is set")
    elif hardware.cupy_available():
        native = (True, "CuPy reaches the GPU")
    elif _cupy_version() is None:
        native = (False, "CuPy is not installed (pip install -e \".[cuda]\")")
    else:
        native = (False, "CuPy is installed but sees no GPU")
    out.append(RunPath("native CUDA GEMM and MoE through CuPy (gpu tier)", *native))
    browser = tier_problems("browser")
    out.append(RunPath("layout explorer in a real browser (browser tier)", not browser,
                       "; ".join(browser) or f"Chromium at {chromium_path()}, Playwright and JupyterLab found"))
    return out


def report() -> str:
    from workbench import __version__

    lines = [f"marlin-workbench {__version__}, Python {platform.python_version()} on {platform.system()}"
             f" {platform.machine()} ({sys.executable})", "", "found:"]
    rows = found()
    width = max(len(name) for name, _ in rows)
    lines += [f"  {name:<{width}}  {what}" for name, what in rows]
    lines += ["", "paths:"]
    items = paths()
    width = max(len(p.name) for p in items)
    lines += [f"  {'on ' if p.on else 'off'}  {p.name:<{width}}  {p.detail}" for p in items]
    return "\n".join(lines)


def _command(args) -> int:
    print(report())
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "doctor", help="which GPU, CUDA, CuPy, Numba and NumPy are here, and which paths are on",
        description="Report the GPU, CUDA toolkit, CuPy, Numba and NumPy found, then every execution path (NumPy"
                    " reference, Numba kernels in the simulator or on a GPU, offline compile checks, the native CUDA"
                    " GEMM, the browser test) as on or off with the reason. Always exits 0.")
    p.set_defaults(func=_command)
