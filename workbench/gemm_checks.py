"""Deprecated alias of ``workbench.gemm.checks`` (the dense GEMM's validation layer), kept for one release."""
from workbench.gemm.checks import *  # noqa: F401,F403
from workbench.gemm.checks import ALIGNED_POINTERS, GROUP_SIZES, REQUIRED_POINTERS, TILE_K, TILE_N  # noqa: F401
