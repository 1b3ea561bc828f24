"""The one place that answers "what hardware is here?" for tests, ops and the command line."""
from __future__ import annotations

import functools
import os


def simulator_enabled() -> bool:
    """True when Numba's CUDA simulator was requested (it must be chosen before numba.cuda is imported)."""
    return os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1"


@functools.lru_cache(maxsize=None)
def gpu_available() -> bool:
    """True when a real CUDA GPU is usable from Numba (never true under the simulator)."""
    if simulator_enabled():
        return False
    try:
        from numba import cuda

        return bool(cuda.is_available()) and len(cuda.gpus) > 0
    except Exception:  # no driver, no toolkit: not a GPU machine
        return False


@functools.lru_cache(maxsize=None)
def cupy_available() -> bool:
    """True when CuPy imports *and* can talk to a GPU."""
    if simulator_enabled():
        return False
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def gpu_skip_reason() -> str | None:
    """None on a GPU machine, else a sentence for pytest.skip."""
    if simulator_enabled():
        return "NUMBA_ENABLE_CUDASIM=1: the CUDA simulator is active, real-GPU tests are off"
    if not gpu_available():
        return "no CUDA GPU visible to Numba on this machine"
    return None


def describe() -> str:
    """One line naming the device the workbench will use."""
    if simulator_enabled():
        return "CPU (Numba CUDA simulator)"
    if gpu_available():
        from numba import cuda

        dev = cuda.get_current_device()
        cc = dev.compute_capability
        name = dev.name.decode() if isinstance(dev.name, bytes) else dev.name
        return f"{name} (sm_{cc[0]}{cc[1]})"
    return "CPU (NumPy)"
