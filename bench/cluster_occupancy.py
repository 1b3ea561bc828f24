"""How many thread-block clusters of the dense GEMM's cluster kernels the GPU keeps resident at once (sm_90; a
diagnostic for bench/NOTES_gemm.md "Round 9": clusters of 4 and 8 measured slower than clusters of 2).

    python bench/cluster_occupancy.py

For each (configuration, cluster size) prints cuOccupancyMaxActiveClusters beside the clusters the bench grids need
(a grid needing more runs part of its clusters in a second wave), and cuOccupancyMaxActiveBlocksPerMultiprocessor.
Needs CuPy and cuda-python (``cuda.bindings``) on a GPU of compute capability >= 9.0.
"""
from __future__ import annotations

import dataclasses
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from workbench import gemm  # noqa: E402
from workbench.scalar_types import ScalarType as S  # noqa: E402

# (label, configuration, blocks of the bench grid that would run it)
_ONE_BLOCK = gemm.KernelConfig(S.F16, S.U4B8, 1, 2, 4, 6, gemm.GROUP_GROUPED, swap=True)
_TWO_BLOCKS = gemm.KernelConfig(S.F16, S.U4B8, 1, 2, 4, 3, gemm.GROUP_GROUPED, blocks_per_sm=2)
_FP8_WIDE = gemm.KernelConfig(S.F16, S.FE4M3FN, 1, 4, 2, 4, gemm.GROUP_CHANNELWISE, swap=True)
CASES = [
    ("u4b8 one block/SM, swapped (8192^2 M=1: 64 x 2)", _ONE_BLOCK, 128),
    ("u4b8 two blocks/SM, row layout (8192^2 M=16: 64 x 4)", _TWO_BLOCKS, 256),
    ("fp8 (4, 2) one block/SM (4096^2, 14336x4096 M=1: 16 x 8)", _FP8_WIDE, 128),
]


def main() -> int:
    from cuda.bindings import driver as drv

    device = 0
    cc = gemm.device_properties(device)[0]
    if cc < 90:
        print(f"sm_{cc}: no thread-block clusters")
        return 0
    for label, cfg, grid in CASES:
        for cluster in gemm.KERNEL_CLUSTER_SIZES:
            c = dataclasses.replace(cfg, cluster=cluster)
            kernel = gemm.get_kernel(c.name_expression, device, c.smem_bytes)
            func = drv.CUfunction(int(kernel.kernel.ptr))
            config = drv.CUlaunchConfig()
            config.gridDimX, config.gridDimY, config.gridDimZ = grid, 1, 1
            config.blockDimX, config.blockDimY, config.blockDimZ = gemm.THREADS, 1, 1
            config.sharedMemBytes = c.smem_bytes
            ok = drv.CUresult.CUDA_SUCCESS
            err, active = drv.cuOccupancyMaxActiveClusters(func, config)
            err2, per_sm = drv.cuOccupancyMaxActiveBlocksPerMultiprocessor(func, gemm.THREADS, c.smem_bytes)
            print(f"{label:58s} cluster {cluster}: {active if err == ok else err} clusters resident at once, grid "
                  f"needs {grid // cluster}; blocks per SM {per_sm if err2 == ok else err2}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
