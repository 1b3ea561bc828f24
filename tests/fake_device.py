"""A stand-in for CuPy and the CUDA driver, enough for the GEMM launch path to run to the final cuLaunchKernel on a
machine without a GPU (CPU tests of the plan caches).

``FakeArray`` carries shape/strides/dtype/flags, a fake device address and device id, and the
``__cuda_array_interface__`` the launch path reads; ``install(monkeypatch_or_None)`` swaps it in for
``cupy.ndarray`` and the fake module for CuPy inside ``workbench.gemm``; every cuLaunchKernel lands in
``FakeDriver.launches`` with its arguments decoded from the void* table (so a wrong table fails a test).
"""
from __future__ import annotations

import contextlib
import ctypes
import itertools
import math

import numpy as np

_addresses = itertools.count(1 << 32, 1 << 20)  # 1 MiB apart, 16-byte aligned


class _Memory:
    def __init__(self, ptr: int, device_id: int):
        self.ptr = ptr
        self.device_id = device_id


class _Device:
    def __init__(self, device_id: int):
        self.id = device_id


class FakeArray:
    """A device array that is only a description (no storage)."""

    def __init__(self, shape, dtype, *, device: int = 0, ptr: int | None = None, strides=None):
        self.shape = tuple(int(s) for s in shape)
        self.dtype = np.dtype(dtype)
        item = self.dtype.itemsize
        if strides is None:
            strides, step = [], item
            for s in reversed(self.shape):
                strides.append(step)
                step *= max(s, 1)
            strides = tuple(reversed(strides))
        self.strides = tuple(int(s) for s in strides)
        self.size = math.prod(self.shape)
        self.nbytes = self.size * item
        self.data = _Memory(next(_addresses) if ptr is None else ptr, device)
        self.device = _Device(device)
        self.flags = {"C_CONTIGUOUS": self.strides == _c_strides(self.shape, item) or self.size <= 1}

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.shape, "typestr": self.dtype.str, "data": (self.data.ptr, False), "version": 3,
                "strides": self.strides}

    def __getitem__(self, rows):
        """A row (int) or a row slice (what the launch paths take): a view at the row's address."""
        if isinstance(rows, int):
            return FakeArray(self.shape[1:], self.dtype, device=self.data.device_id,
                             ptr=self.data.ptr + rows * self.strides[0], strides=self.strides[1:])
        start, stop, step = rows.indices(self.shape[0])
        assert step == 1
        return FakeArray((stop - start,) + self.shape[1:], self.dtype, device=self.data.device_id,
                         ptr=self.data.ptr + start * self.strides[0], strides=self.strides)


def _c_strides(shape, item):
    out, step = [], item
    for s in reversed(shape):
        out.append(step)
        step *= max(s, 1)
    return tuple(reversed(out))


class FakeDriver:
    """cuLaunchKernel that decodes its void* table: ``launches`` gets (function, grid, smem, stream, args)."""

    def __init__(self):
        self.launches: list[tuple] = []
        self.cupy_calls: list[tuple] = []  # launches through CuPy kernel calls
        self.arg_kinds: dict[int, tuple[str, ...]] = {}  # function -> 'p' (u64) / 'i' (i32) per argument
        self.programmatic: list[int] = []  # indices into launches of the programmatic ones (cuLaunchKernelEx)

    def launchKernel(self, f, gx, gy, gz, bx, by, bz, smem, stream, params, extra):  # noqa: N802 - CUDA's name
        kinds = self.arg_kinds[int(f)]
        table = (ctypes.c_void_p * len(kinds)).from_address(int(params))
        args = tuple(ctypes.c_uint64.from_address(table[i]).value if kind == "p" else
                     ctypes.c_int32.from_address(table[i]).value for i, kind in enumerate(kinds))
        self.launches.append((int(f), (gx, gy, gz), (bx, by, bz), smem, stream, args))


class _Runtime:
    def __init__(self, state):
        self.state = state

    def getDevice(self):  # noqa: N802
        return self.state.current

    def memsetAsync(self, ptr, value, size, stream):  # noqa: N802
        self.state.memsets.append((ptr, value, size, stream))


_stream_handles = itertools.count(0x5000, 0x10)


class _Stream:
    """A stream handle; ``log`` (shared) gets ("record", event, stream) and ("wait", stream, event) in order."""

    log: list = []

    def __init__(self, ptr=None, non_blocking=False):
        self.ptr = next(_stream_handles) if ptr is None else ptr

    def wait_event(self, event):
        _Stream.log.append(("wait", self.ptr, event.serial))

    def record(self, event=None):
        event = _Event() if event is None else event
        event.record(self)
        return event

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


_events = itertools.count(1)


class _Event:
    def __init__(self, **kw):
        self.serial = next(_events)

    def record(self, stream=None):
        _Stream.log.append(("record", self.serial, 0 if stream is None else stream.ptr))


class _State:
    def __init__(self):
        self.current = 0
        self.switches = 0
        self.memsets: list[tuple] = []
        self.allocations = 0


class FakeCuPy:
    """The few names of ``cupy`` the GEMM launch path uses."""

    ndarray = FakeArray

    def __init__(self):
        self.state = _State()
        state = self.state

        class Device:
            def __init__(self, device_id):
                self.id = device_id

            def __enter__(self):
                self.saved = state.current
                if self.saved != self.id:
                    state.switches += 1
                state.current = self.id
                return self

            def __exit__(self, *exc):
                state.current = self.saved

        class cuda:  # noqa: N801 - mirrors cupy.cuda
            runtime = _Runtime(state)
            Stream = _Stream
            ExternalStream = _Stream
            Event = _Event

            @staticmethod
            def get_current_stream():
                return _Stream(0)

        cuda.Device = Device
        self.cuda = cuda

    def empty(self, shape, dtype):
        self.state.allocations += 1
        shape = (shape,) if isinstance(shape, int) else shape
        return FakeArray(shape, dtype, device=self.state.current)

    zeros = empty

    @staticmethod
    def ascontiguousarray(x):
        assert x.flags["C_CONTIGUOUS"]
        return x


_Stream.null = _Stream(0)
SMS = 132


def _plain_policies():
    import dataclasses

    from workbench.policy import DEFAULT_GEMM_POLICY, DEFAULT_MOE_POLICY

    g = dataclasses.replace(DEFAULT_GEMM_POLICY, programmatic_launch=False)
    return g, dataclasses.replace(DEFAULT_MOE_POLICY, programmatic_launch=False, gemm=g)


# what calls without a policy launch with on the stand-in device: plain launches
PLAIN_GEMM_POLICY, PLAIN_MOE_POLICY = _plain_policies()
PROPS = (90, SMS, 227 * 1024, 228 * 1024)


@contextlib.contextmanager
def default_policies(gemm_policy=None, moe_policy=None):
    """What calls that pass no policy use inside the block (the stand-in device's defaults; restored on exit). Tests
    that check one policy choice pass it to the call instead."""
    from workbench import gemm, moe

    saved = gemm.__dict__["_default_policy"], moe.__dict__["_default_policy"]
    if gemm_policy is not None:
        gemm.__dict__["_default_policy"] = gemm_policy
    if moe_policy is not None:
        moe.__dict__["_default_policy"] = moe_policy
    try:
        yield
    finally:
        gemm.__dict__["_default_policy"], moe.__dict__["_default_policy"] = saved


@contextlib.contextmanager
def installed(monkeypatch=None):
    """workbench.gemm and workbench.moe's launches on the fakes: yields (fake cupy, fake driver). Restores everything
    on exit."""
    from workbench import gemm, moe
    from workbench.cuda import arrays as rt_arrays
    from workbench.cuda import launch as rt_launch
    from workbench.cuda import streams as rt_streams
    from workbench.gemm import api as gemm_api
    from workbench.gemm import kernels as gemm_kernels
    from workbench.gemm import launch as gemm_launch
    from workbench.moe import config as moe_config
    from workbench.moe import fused as moe_fused
    from workbench.moe import kernels as moe_kernels

    fake, driver = FakeCuPy(), FakeDriver()
    functions = itertools.count(0x1000)
    kernels: dict[tuple[str, int], int] = {}

    def function_ptr(name, device, smem_bytes=0):
        key = (name, device)
        if key not in kernels:
            kernels[key] = next(functions)
            driver.arg_kinds[kernels[key]] = tuple(gemm.KERNEL_ARG_KINDS["permute_cols" if "permute" in name
                                                                          else "marlin_gemm"])
        return kernels[key]

    def get_kernel(name, device, smem_bytes=0):
        """A CuPy-style kernel whose calls land in ``driver.cupy_calls`` as (function, grid, smem, stream, args)."""
        function = function_ptr(name, device, smem_bytes)

        def kernel(grid, block, args, shared_mem=0, stream=None):
            driver.cupy_calls.append((function, grid, shared_mem, stream.ptr, tuple(int(x) for x in args)))

        return kernel

    def launch_kernel(launch, stream, params):
        """workbench.cuda's one launch call: recorded as a launch (its index noted if programmatic)."""
        driver.launchKernel(launch.function, launch.grid, 1, 1, launch.threads, 1, 1, launch.smem, stream, params, 0)
        if launch.programmatic:
            driver.programmatic.append(len(driver.launches) - 1)

    patches = dict(device_properties=lambda device: PROPS, function_ptr=function_ptr, get_kernel=get_kernel,
                   resident_blocks=lambda name, device: 2, resident_clusters=lambda cfg, device, grid: 1 << 30,
                   pin_occupancy_of=lambda kernel, device, smem, blocks_per_sm: smem)
    runtime_patches = [(rt_arrays, "_cupy_module", fake), (rt_arrays, "_cupy_array", FakeArray),
                       (rt_launch, "launch_kernel", launch_kernel), (rt_streams, "_streams", {})]
    saved_runtime = [(mod, name, getattr(mod, name)) for mod, name, _ in runtime_patches]
    for mod, name, value in runtime_patches:
        setattr(mod, name, value)
    saved = {name: getattr(gemm_kernels, name) for name in patches}
    caches = (gemm_launch._prepared, gemm_api._array_plans, gemm_api._scratch, moe_config._config_cache,
              moe_fused._pinned_smem, moe_fused._phase_launches)
    saved_caches = [dict(c) for c in caches]
    for c in caches:
        c.clear()
    for name, value in patches.items():
        setattr(gemm_kernels, name, value)

    # marlin_moe.cu's kernels: the layer plans' driver launches and the CuPy calls of the checked path
    def moe_function_ptr(name, device, smem_bytes=0):
        key = ("moe", name, device)
        if key not in kernels:
            kernels[key] = next(functions)
            kind = next((k for k in moe.PLAN_ARG_KINDS if f"mwb::{k}" in name), None)
            if kind is not None:
                driver.arg_kinds[kernels[key]] = tuple(moe.PLAN_ARG_KINDS[kind])
            moe_names[kernels[key]] = name
        return kernels[key]

    def get_moe_kernel(name, device, smem_bytes=0):
        function = moe_function_ptr(name, device, smem_bytes)

        def kernel(grid, block, args, shared_mem=0, stream=None):
            values = tuple(x.data.ptr if isinstance(x, FakeArray) else int(x) for x in args)
            driver.cupy_calls.append((function, tuple(grid), shared_mem, stream.ptr, values))

        return kernel

    moe_names: dict[int, str] = {}
    driver.moe_names = moe_names  # function handle -> marlin_moe.cu name expression
    moe_patches = dict(get_moe_kernel=get_moe_kernel, function_ptr=moe_function_ptr)
    saved_moe = {name: getattr(moe_kernels, name) for name in moe_patches}
    for name, value in moe_patches.items():
        setattr(moe_kernels, name, value)
    try:
        # the stand-in launches plainly unless a call's policy asks for programmatic launches
        with default_policies(PLAIN_GEMM_POLICY, PLAIN_MOE_POLICY):
            yield fake, driver
    finally:
        for name, value in saved_moe.items():
            setattr(moe_kernels, name, value)
        for name, value in saved.items():
            setattr(gemm_kernels, name, value)
        for mod, name, value in saved_runtime:
            setattr(mod, name, value)
        for c, content in zip(caches, saved_caches):
            c.clear()
            c.update(content)
