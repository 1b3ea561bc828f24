"""Simulator tier: Numba-CUDA kernels against their NumPy references at tiny shapes (a few 16×64 tiles).

The simulator must be chosen before ``numba.cuda`` is first imported. CI exports NUMBA_ENABLE_CUDASIM=1 for the
process that runs tests/cpu, tests/sim and the notebooks; run alone, this conftest sets it if nothing has imported
``numba.cuda`` yet. If that is too late (numba.cuda already imported for a real GPU), the tests still run, on the
GPU; with neither a GPU nor the simulator they skip with the reason.
"""
import os
import sys

if "numba.cuda" not in sys.modules:
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import pytest  # noqa: E402

from kernels_numba._launch import poison_outputs  # noqa: E402,F401  (re-exported for the tests)


def pytest_collection_modifyitems(config, items):
    from workbench import hardware

    if hardware.simulator_enabled() or hardware.gpu_available():
        return
    skip = pytest.mark.skip(reason="numba.cuda was imported without the CUDA simulator and there is no GPU: run "
                                   "tests/sim with NUMBA_ENABLE_CUDASIM=1")
    for item in items:
        if "tests/sim/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(skip)
