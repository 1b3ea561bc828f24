"""The compiled dense kernels and what the device says about them: compile once per process (workbench.cuda's
one compile path, cached on disk), device properties, blocks and clusters the driver keeps resident, programmatic
launches and the shared memory that pins their occupancy.
"""
from __future__ import annotations

import functools
import pathlib

from workbench import cuda as rt
from workbench.cuda import arrays as rt_arrays
from workbench.gemm.geometry import (RESERVED_SMEM_PER_BLOCK, THREADS, KernelConfig, choose_config, default_policy,
                                     pairs_possible)
from workbench.policy import GemmPolicy
from workbench.scalar_types import ScalarType

_default = default_policy

KERNEL_DIR = pathlib.Path(__file__).resolve().parent.parent.parent / "kernels_cuda"
KERNEL_SOURCE = "marlin_gemm.cu"


@functools.lru_cache(maxsize=None)
def kernel_source() -> str:
    """marlin_gemm.cu with its local headers inlined (KERNEL_DIR is read here: A/B runs point it elsewhere)."""
    return rt.inline_includes(KERNEL_DIR, KERNEL_SOURCE)


# every instantiation's kernel, CUfunction handle and (on_load) blocks per SM the driver keeps resident
_module = rt.KernelModule(lambda: kernel_source(), on_load=lambda kernel, smem: _resident_blocks(kernel, smem))


def get_kernel(name_expression: str, device: int, smem_bytes: int = 0):
    """The compiled kernel for one template instantiation on one device (compiled once per process)."""
    return _module.kernel(name_expression, device, smem_bytes)


def function_ptr(name_expression: str, device: int, smem_bytes: int = 0) -> int:
    """The CUfunction handle of one instantiation on one device (compiling it first if needed)."""
    return _module.function_ptr(name_expression, device, smem_bytes)


def _driver_apis():
    """CuPy's driver and runtime bindings (a function, so that CPU tests can stand in for them)."""
    from cupy_backends.cuda.api import driver, runtime

    return driver, runtime


def _resident_blocks(kernel, smem_bytes: int) -> int:
    """Blocks of THREADS threads the driver can keep resident per SM with this shared memory (1 if unknown).

    The query is a driver-API call: it needs a current context in the calling thread. precompile() loads kernels in
    fresh worker threads, where CuPy's device switch alone may leave none current; the query then failed, the
    fallback said 1, and two-block kernels ran on half their grid (13% slower on the H200, 8192 x 28672 M = 1).
    cudaFree(0) binds the device's primary context to the thread first."""
    try:
        driver, runtime = _driver_apis()
        if not driver.ctxGetCurrent():
            runtime.free(0)
        return max(1, int(driver.occupancyMaxActiveBlocksPerMultiprocessor(kernel.kernel.ptr, THREADS, smem_bytes)))
    except Exception:  # pragma: no cover - older CuPy: be conservative (every block must be resident)
        return 1


def resident_blocks(name_expression: str, device: int) -> int:
    return _module.loaded.get((name_expression, device)) or 1


def programmatic_launches(device: int, programmatic: bool | None = None) -> bool:
    """Whether launches on ``device`` are programmatic dependent launches: ``programmatic`` (None: the default
    GemmPolicy's ``programmatic_launch``) on an sm_90+ device. The dense GEMM's and the MoE kernels' (workbench/moe/).

    A programmatic launch lets a kernel's blocks be scheduled while the kernel before it in the stream finishes; they
    fetch their first weight stage at once and wait (griddepcontrol.wait, kernels_cuda/mma.cuh) before they read the
    activations or write anything, and every kernel lets the next one start so (griddepcontrol.launch_dependents). It
    pays only where the kernel before triggers it; after any other kernel the launch behaves as a plain one. Needs
    cuda-python's driver bindings (cuLaunchKernelEx), else launches stay plain."""
    if programmatic is None:
        programmatic = _default().programmatic_launch
    return programmatic and device_properties(device)[0] >= 90


def pinned_smem(smem_bytes: int, blocks_per_sm: int, sm_smem: int, reserved_per_block: int) -> int:
    """The least dynamic shared memory >= smem_bytes (a multiple of 128 bytes) with which no more than
    ``blocks_per_sm`` blocks fit in an SM's ``sm_smem`` bytes, each block also taking ``reserved_per_block``."""
    least = sm_smem // (blocks_per_sm + 1) - reserved_per_block + 1  # blocks_per_sm + 1 of these overflow the SM
    return max(smem_bytes, -(-least // 128) * 128)


def pin_occupancy_of(kernel, device: int, smem_bytes: int, blocks_per_sm: int) -> int:
    """Dynamic shared memory for a launch of a compiled kernel (a CuPy function) that keeps at most
    ``blocks_per_sm`` of its blocks on an SM (the policy's ``programmatic_pin_occupancy``: a programmatic launch places
    a grid's blocks in whatever SM space the grid before leaves free, so a kernel planned at b blocks per SM that fits
    more would run some SMs stacked): ``smem_bytes`` where no more fit already,
    else pinned_smem's amount, the kernel's shared memory limit raised to it and the driver's occupancy query checking
    it. ``smem_bytes`` where the pinned amount is over the per-block limit or the query disagrees (the launch is then
    as unpinned)."""
    with rt_arrays.cupy().cuda.Device(device):
        if _resident_blocks(kernel, smem_bytes) <= blocks_per_sm:
            return smem_bytes
    _, _, smem_limit, sm_smem = device_properties(device)
    pinned = pinned_smem(smem_bytes, blocks_per_sm, sm_smem, RESERVED_SMEM_PER_BLOCK)
    if pinned > smem_limit:
        return smem_bytes
    with rt_arrays.cupy().cuda.Device(device):
        if pinned > max(48 * 1024, kernel.max_dynamic_shared_size_bytes):
            kernel.max_dynamic_shared_size_bytes = pinned
        return pinned if _resident_blocks(kernel, pinned) == blocks_per_sm else smem_bytes


_cluster_occupancy: dict[tuple[str, int, int], int] = {}


def resident_clusters(cfg: KernelConfig, device: int, grid: int) -> int:
    """Clusters of a cluster kernel the device keeps resident at once (cuOccupancyMaxActiveClusters through
    cuda-python), cached; a large number where the query is unavailable (then the plan keeps its clusters: they are
    never needed for correctness, only for speed). A GPC holds whole clusters only, so this can be below SMs /
    cluster size."""
    key = (cfg.name_expression, device, grid)
    if key not in _cluster_occupancy:
        try:
            from cuda.bindings import driver as drv

            kernel = get_kernel(cfg.name_expression, device, cfg.smem_bytes)
            config = drv.CUlaunchConfig()
            config.gridDimX, config.gridDimY, config.gridDimZ = grid, 1, 1
            config.blockDimX, config.blockDimY, config.blockDimZ = THREADS, 1, 1
            config.sharedMemBytes = cfg.smem_bytes
            err, active = drv.cuOccupancyMaxActiveClusters(drv.CUfunction(int(kernel.kernel.ptr)), config)
            _cluster_occupancy[key] = int(active) if err == drv.CUresult.CUDA_SUCCESS and active > 0 else 1 << 30
        except Exception:  # pragma: no cover - no cuda-python, or a driver without the query
            _cluster_occupancy[key] = 1 << 30
    return _cluster_occupancy[key]


def precompile(configs, device: int = 0, workers: int = 8) -> None:
    """Compile many instantiations in parallel threads (NVRTC runs outside the GIL); used by tests and bench."""
    from concurrent.futures import ThreadPoolExecutor

    todo = {(c.name_expression, c.smem_bytes) for c in configs}
    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(lambda nc: get_kernel(nc[0], device, nc[1]), sorted(todo)))


@functools.lru_cache(maxsize=None)
def device_properties(device: int) -> tuple[int, int, int, int]:
    """(compute capability as 10*major+minor, SM count, opt-in shared memory per block, shared memory per SM)."""
    cupy = rt_arrays.cupy()
    props = cupy.cuda.runtime.getDeviceProperties(device)
    return (10 * props["major"] + props["minor"], props["multiProcessorCount"],
            props["sharedMemPerBlockOptin"], props["sharedMemPerMultiprocessor"])


def config_for(act, weight, size_m: int, size_n: int, size_k: int, group_size: int, per_row_groups: bool,
               device: int = 0, policy: GemmPolicy | None = None) -> KernelConfig:
    """choose_config with the device's limits, for the default (fp32) reduction: the tile a launch on that device
    will use under ``policy`` (its cluster size follows the grid: cluster_blocks)."""
    cc, sms, smem_limit, sm_smem = device_properties(device)
    return choose_config(ScalarType.parse(act) if not isinstance(act, ScalarType) else act, weight, size_m, size_n,
                         size_k, group_size, per_row_groups, smem_limit, sm_smem=sm_smem, sms=sms,
                         pairs=pairs_possible(cc, True, policy), policy=policy)
