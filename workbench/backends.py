"""Backend dispatch for ``workbench.ops``: which implementation runs an already-validated op.

* ``"numpy"`` — the NumPy reference in ``workbench.formats`` (the spec).
* ``"numba"`` — the Numba-CUDA kernel in ``kernels_numba`` (a real GPU, or the CUDA simulator).
* ``"auto"``  — NumPy for NumPy input.
"""
from __future__ import annotations

from typing import Any, Callable

BACKENDS = ("auto", "numpy", "numba")


def is_device_array(x: Any) -> bool:
    return hasattr(x, "__cuda_array_interface__")


def dispatch(op_name: str, backend: str, stream: Any, reference: Callable[..., Any], *args: Any) -> Any:
    """Run ``op_name`` on ``args`` with the chosen backend. ``reference`` is the NumPy implementation."""
    if backend not in BACKENDS:
        raise ValueError(f"backend = {backend!r} is not one of {BACKENDS}")
    on_device = any(is_device_array(a) for a in args)
    if backend == "numpy" or (backend == "auto" and not on_device):
        if on_device:
            raise TypeError(f"{op_name}: backend='numpy' was given a CUDA device array; pass NumPy arrays")
        return reference(*args)
    raise NotImplementedError(f"{op_name}: the Numba backend is not built yet (issue 3)")
