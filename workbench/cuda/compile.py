"""One compile path for the CUDA C++ kernels (kernels_cuda/): a source with its local headers inlined, compiled by
NVRTC through CuPy's RawModule for the device's architecture, once per process and (instantiation, device). Every
C++ kernel of the project is built here (the GEMM and the MoE kernels); nothing else calls RawModule.

On disk, the cubins live in CuPy's kernel cache (``CUPY_CACHE_DIR``, default ``~/.cupy/kernel_cache``), which is the
cache this project relies on rather than a second one of its own. What it guarantees, read in CuPy 14.2's
``cupy/cuda/compiler.py`` (``_compile_with_cache_cuda``) and ``cupy/cuda/_compiler_cache.py``:
- the file name is a hash of the target architecture, the options, the NVRTC version, the compiler's output for an
  empty file (its internal version), the source and the name expressions: a change of any of them is a new entry;
- a write goes to a temporary file in the cache folder and is renamed over the entry (``os.replace``), so a reader in
  another process sees a whole file or none; every file starts with a hash of its cubin, checked on load, so a
  damaged entry is recompiled instead of loaded.
The ``[cuda]`` extra therefore asks for CuPy 14.2 or later.
"""
from __future__ import annotations

import pathlib
import re
import threading
from typing import Any, Callable

from workbench.cuda.arrays import cupy

_INCLUDE = re.compile(r'^\s*#include\s+"([^"]+)"\s*$', re.M)
OPTIONS = ("-std=c++17",)


def inline_includes(directory: pathlib.Path, name: str) -> str:
    """``directory/name`` with its local ``#include "..."`` headers inlined (each once), so that the compile cache
    sees every byte it builds; ``#pragma once`` dropped."""
    seen: set[str] = set()

    def expand(file: str) -> str:
        if file in seen:
            return ""
        seen.add(file)
        return _INCLUDE.sub(lambda m: expand(m.group(1)), (pathlib.Path(directory) / file).read_text())

    return expand(name).replace("#pragma once", "")


class KernelModule:
    """The compiled instantiations of one kernel source: ``kernel(name_expression, device, smem_bytes)`` is the
    loaded function (a CuPy RawKernel; ``function_ptr`` its CUfunction handle), compiled on first use. ``source`` is
    called then (so a caller may point it at another directory between uses: A/B runs). ``on_load(kernel,
    smem_bytes)`` runs once per load, in the loading thread with the device current (residency queries)."""

    def __init__(self, source: Callable[[], str], on_load: Callable[[Any, int], Any] | None = None,
                 options: tuple[str, ...] = OPTIONS):
        self.source, self.on_load, self.options = source, on_load, options
        self._lock = threading.Lock()
        self.kernels: dict[tuple[str, int], Any] = {}
        self.function_ptrs: dict[tuple[str, int], int] = {}
        self.loaded: dict[tuple[str, int], Any] = {}  # what on_load returned

    def kernel(self, name_expression: str, device: int, smem_bytes: int = 0):
        key = (name_expression, device)
        kernel = self.kernels.get(key)
        if kernel is None:
            cp = cupy()
            with cp.cuda.Device(device):
                module = cp.RawModule(code=self.source(), options=self.options, name_expressions=[name_expression])
                kernel = module.get_function(name_expression)
                if smem_bytes > 48 * 1024:
                    kernel.max_dynamic_shared_size_bytes = smem_bytes
                extra = self.on_load(kernel, smem_bytes) if self.on_load is not None else None
                function_ptr = int(kernel.kernel.ptr)  # loaded into this device's context
            with self._lock:
                if key not in self.kernels:
                    self.kernels[key] = kernel
                    self.function_ptrs[key] = function_ptr
                    self.loaded[key] = extra
                kernel = self.kernels[key]
        return kernel

    def function_ptr(self, name_expression: str, device: int, smem_bytes: int = 0) -> int:
        key = (name_expression, device)
        if key not in self.function_ptrs:
            self.kernel(name_expression, device, smem_bytes)
        return self.function_ptrs[key]
