"""One argument-block builder and one launch call for every native kernel.

``ArgBlock(kinds)``: a kernel's parameters, ``kinds`` one letter each ('p' = 64-bit address, 'i' = int32), as two
reusable ctypes arrays (``ptrs``, ``ints``, in parameter order within their kind) and the void* table
cuLaunchKernel reads them through (``address``). Filling it costs a few ctypes stores, not an argument conversion
per call; a launch copies the block before it returns, so one block serves every call of a plan (under a lock when
threads share the plan).

``Launch(function, grid, threads, smem, programmatic=..., cluster=...)``: one prepared launch of a loaded function
(a CUfunction handle). Its form is attributes of one cuLaunchKernelEx configuration, made once:
* programmatic: programmatic stream serialization (sm_90+): the kernel's blocks may be scheduled while the kernel
  before it in the stream finishes (the kernels wait with griddepcontrol.wait before they read its output);
* cluster: thread-block cluster dimension (for kernels without compile-time ``__cluster_dims__``; the dense GEMM's
  cluster kernels carry theirs, so they launch with cluster = 1 here).
``launch_kernel(launch, stream, params)`` is the one call that launches (RuntimeError naming the driver's error).
Without cuda-python's driver bindings a plain launch falls back to CuPy's binding of cuLaunchKernel; programmatic
and cluster launches need the bindings (``Launch.supported`` is False there, and callers launch plainly).
"""
from __future__ import annotations

import ctypes

_cu = None  # cuda.bindings.driver, once imported (False: not installed)
_cupy_driver = None


def _bindings():
    global _cu
    if _cu is None:
        try:
            from cuda.bindings import driver
        except ImportError:  # pragma: no cover - environment
            driver = False
        _cu = driver
    return _cu


class ArgBlock:
    """A kernel's parameter block (see the module docstring); ``set(values)`` writes all of them in order."""

    def __init__(self, kinds: str):
        if set(kinds) - {"p", "i"}:
            raise ValueError(f"argument kinds {kinds!r}: one 'p' (address) or 'i' (int32) per parameter")
        self.kinds = kinds
        self.ptrs = (ctypes.c_uint64 * max(1, kinds.count("p")))()
        self.ints = (ctypes.c_int32 * max(1, kinds.count("i")))()
        p0, i0 = ctypes.addressof(self.ptrs), ctypes.addressof(self.ints)
        slots, np_, ni = [], 0, 0
        for k in kinds:
            if k == "p":
                slots.append(p0 + 8 * np_)
                np_ += 1
            else:
                slots.append(i0 + 4 * ni)
                ni += 1
        self.table = (ctypes.c_void_p * len(kinds))(*slots)
        self.address = ctypes.addressof(self.table)
        # parameter index -> (array, index in it), for set()
        self._where = []
        np_ = ni = 0
        for k in kinds:
            self._where.append((self.ptrs, np_) if k == "p" else (self.ints, ni))
            np_, ni = (np_ + 1, ni) if k == "p" else (np_, ni + 1)

    def set(self, values) -> None:
        if len(values) != len(self.kinds):
            raise ValueError(f"{len(values)} values for {len(self.kinds)} parameters ({self.kinds})")
        for (array, i), v in zip(self._where, values):
            array[i] = int(v)

    def slot(self, index: int) -> tuple:
        """(array, position) of parameter ``index``: ``array[position] = value`` writes it."""
        return self._where[index]


class Launch:
    """One prepared launch (see the module docstring). ``grid`` may change (``set_grid``)."""

    def __init__(self, function: int, grid: int, threads: int, smem: int, *, programmatic: bool = False,
                 cluster: int = 1):
        self.function, self.grid, self.threads, self.smem = int(function), int(grid), int(threads), int(smem)
        self.programmatic, self.cluster = bool(programmatic), int(cluster)
        cu = _bindings()
        self.supported = bool(cu)  # (attributes need the bindings)
        self._config = self._handle = None
        if cu:
            attrs = []
            if self.programmatic:
                attr = cu.CUlaunchAttribute()
                attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
                attr.value.programmaticStreamSerializationAllowed = 1
                attrs.append(attr)
            if self.cluster > 1:
                attr = cu.CUlaunchAttribute()
                attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
                attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = self.cluster, 1, 1
                attrs.append(attr)
            config = cu.CUlaunchConfig()
            config.gridDimX, config.gridDimY, config.gridDimZ = self.grid, 1, 1
            config.blockDimX, config.blockDimY, config.blockDimZ = self.threads, 1, 1
            config.sharedMemBytes = self.smem
            config.attrs = attrs
            config.numAttrs = len(attrs)
            self._config, self._handle = config, cu.CUfunction(self.function)

    def set_grid(self, grid: int) -> None:
        self.grid = int(grid)
        if self._config is not None:
            self._config.gridDimX = self.grid


def launch_kernel(launch: Launch, stream: int, params: int) -> None:
    """Launch ``launch`` on the raw stream handle ``stream`` with the argument table at ``params``."""
    config = launch._config
    if config is None:  # no driver bindings: CuPy's cuLaunchKernel (plain launches only)
        global _cupy_driver
        if _cupy_driver is None:
            from cupy_backends.cuda.api import driver

            _cupy_driver = driver
        _cupy_driver.launchKernel(launch.function, launch.grid, 1, 1, launch.threads, 1, 1, launch.smem, stream,
                                  params, 0)
        return
    cu = _cu
    config.hStream = cu.CUstream(stream)
    err, = cu.cuLaunchKernelEx(config, launch._handle, params, 0)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuLaunchKernelEx ({'programmatic ' if launch.programmatic else ''}launch of "
                           f"{launch.grid} blocks) failed: {err!r}")
