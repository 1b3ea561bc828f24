"""One argument-block builder and one launch call for every native kernel.

``ArgBlock(kinds)``: a kernel's parameters, ``kinds`` one letter each ('p' = 64-bit address, 'i' = int32, 'q' =
int64), as reusable ctypes arrays (``ptrs``, ``ints``, ``wides``, in parameter order within their kind) and the
void* table cuLaunchKernel reads them through (``address``). A block of 'q' only (a Numba kernel's expanded
arguments: every field is 8 bytes) is filled by one slice store, ``wides[:] = values``. Filling it costs a few ctypes stores, not an argument conversion
per call; a launch copies the block before it returns, so one block serves every call of a plan (under a lock when
threads share the plan).

``Launch(function, grid, threads, smem, programmatic=..., cluster=...)``: one prepared launch of a loaded function
(a CUfunction handle); ``grid`` and ``threads`` are an int or an (x, y, z) tuple. Its form is attributes of one cuLaunchKernelEx configuration, made once:
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


_KINDS = {"p": 8, "i": 4, "q": 8}  # kind -> bytes of its slot


class ArgBlock:
    """A kernel's parameter block (see the module docstring); ``set(values)`` writes all of them in order."""

    def __init__(self, kinds: str):
        if set(kinds) - set(_KINDS):
            raise ValueError(f"argument kinds {kinds!r}: one 'p' (address), 'i' (int32) or 'q' (int64) per parameter")
        self.kinds = kinds
        self.ptrs = (ctypes.c_uint64 * max(1, kinds.count("p")))()
        self.ints = (ctypes.c_int32 * max(1, kinds.count("i")))()
        self.wides = (ctypes.c_int64 * max(1, kinds.count("q")))()
        arrays = {"p": self.ptrs, "i": self.ints, "q": self.wides}
        counts = dict.fromkeys(_KINDS, 0)
        slots, self._where = [], []  # the table's addresses; parameter index -> (array, index in it), for set()
        for k in kinds:
            slots.append(ctypes.addressof(arrays[k]) + _KINDS[k] * counts[k])
            self._where.append((arrays[k], counts[k]))
            counts[k] += 1
        self.table = (ctypes.c_void_p * max(1, len(kinds)))(*slots)
        self.address = ctypes.addressof(self.table)

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

    def __init__(self, function: int, grid, threads, smem: int, *, programmatic: bool = False,
                 cluster: int = 1):
        self.function, self.smem = int(function), int(smem)
        self.grid, self.threads = _dims(grid)[0] if isinstance(grid, int) else grid, threads
        self._grid3, self._block3 = _dims(grid), _dims(threads)
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
            config.gridDimX, config.gridDimY, config.gridDimZ = self._grid3
            config.blockDimX, config.blockDimY, config.blockDimZ = self._block3
            config.sharedMemBytes = self.smem
            config.attrs = attrs
            config.numAttrs = len(attrs)
            self._config, self._handle = config, cu.CUfunction(self.function)

    def set_grid(self, grid) -> None:
        if isinstance(grid, int):
            self.grid = int(grid)
            self._grid3 = (self.grid, 1, 1)
            if self._config is not None:
                self._config.gridDimX = self.grid
            return
        self.grid, self._grid3 = grid, _dims(grid)
        if self._config is not None:
            self._config.gridDimX, self._config.gridDimY, self._config.gridDimZ = self._grid3


def _dims(d) -> tuple[int, int, int]:
    """An int or a 1-3 tuple of ints -> (x, y, z)."""
    if isinstance(d, int):
        return int(d), 1, 1
    d = tuple(int(v) for v in d)
    if not 1 <= len(d) <= 3:
        raise ValueError(f"launch dimensions {d!r}: an int or 1 to 3 ints")
    return d + (1,) * (3 - len(d))


def launch_kernel(launch: Launch, stream: int, params: int) -> None:
    """Launch ``launch`` on the raw stream handle ``stream`` with the argument table at ``params``."""
    config = launch._config
    if config is None:  # no driver bindings: CuPy's cuLaunchKernel (plain launches only)
        global _cupy_driver
        if _cupy_driver is None:
            from cupy_backends.cuda.api import driver

            _cupy_driver = driver
        (gx, gy, gz), (bx, by, bz) = launch._grid3, launch._block3
        _cupy_driver.launchKernel(launch.function, gx, gy, gz, bx, by, bz, launch.smem, stream, params, 0)
        return
    cu = _cu
    config.hStream = cu.CUstream(stream)
    err, = cu.cuLaunchKernelEx(config, launch._handle, params, 0)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuLaunchKernelEx ({'programmatic ' if launch.programmatic else ''}launch of "
                           f"{launch.grid} blocks) failed: {err!r}")
