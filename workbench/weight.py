"""``MarlinWeight``: everything a Marlin GEMM needs for one layer (or one stack of MoE experts).

``size_k`` / ``size_n`` are the true sizes; the arrays are the Marlin arrays of the weight zero-padded to
K_pad = ceil(K/16)*16 rows and N_pad = ceil(N/64)*64 columns (docs/formats.md, "Shapes that are not tile
multiples"): a kernel reads A up to size_k and writes C up to size_n."""
from __future__ import annotations

import dataclasses

import numpy as np

from workbench.formats._checks import (check_permutation_values, padded_k, padded_n, require,
                                       require_integer_dtype)
from workbench.formats.fp8 import marlin_fp8_scales
from workbench.formats.gptq import sort_g_idx
from workbench.formats.marlin_tile import TILE_N, marlin_qweight_shape, marlin_repack_codes
from workbench.formats.scales import num_groups, permute_scales, zero_points_to_marlin
from workbench.quantize import QuantizedWeight, quantize_weights
from workbench.scalar_types import ScalarType

# Lock counters per 64-column output stripe and parallel sub-problem (ferrum-kernels' ceil(N/64) × max_par, max_par =
# 16; docs/formats.md, "Workspace and reductions").
MAX_PAR = 16


def workspace_size(size_n: int, num_experts: int = 1) -> int:
    """int32 lock counters a (stack of) layer(s) needs: ferrum-kernels' ``max(N/64, 1) * 16`` per expert, one per
    64-column stripe of N_pad (a partial last stripe has its own counters)."""
    return num_experts * max(-(-size_n // TILE_N), 1) * MAX_PAR


@dataclasses.dataclass
class MarlinWeight:
    """A layer in Marlin layout. With ``num_experts`` set, every array has a leading expert axis."""

    qweight: np.ndarray  # ([E,] K_pad/16, N_pad*16/pf) int32 Marlin tiles
    scales: np.ndarray  # ([E,] ng, N_pad) act_dtype, permuted (FP8: exponent bias folded in); ng = ceil(K/G)
    zeros: np.ndarray | None  # ([E,] ng, N_pad/pf) int32 Marlin zero points (u4/u8 only)
    g_idx: np.ndarray | None  # ([E,] K) int32 sorted group index (act-order only)
    perm: np.ndarray | None  # ([E,] K) int32: Marlin row k is checkpoint row perm[k] (act-order only)
    size_k: int
    size_n: int  # per expert
    group_size: int  # the checkpoint's group size (-1 = channelwise)
    weight_type: ScalarType
    act_dtype: np.dtype
    is_k_full: bool = True
    num_experts: int | None = None

    def __post_init__(self):
        """The act-order permutation is checked once, here, where a layer is built (a kernel reads rows through it):
        its shape and dtype always, its values when it is on the host (checkpoint loads, the reference path).
        A device perm handed to the repack ops is checked by them on the device (kernels_numba.marlin_repack)."""
        if self.perm is None:
            return
        lead = () if self.num_experts is None else (self.num_experts,)
        require(tuple(self.perm.shape) == lead + (self.size_k,),
                f"perm has shape {tuple(self.perm.shape)}, expected {lead + (self.size_k,)} ([E,] size_k)")
        require_integer_dtype(self.perm, "perm", "integer row indices")
        if isinstance(self.perm, np.ndarray):
            rows = self.perm.reshape((-1, self.size_k))
            for e, row in enumerate(rows):
                check_permutation_values(row, self.size_k, "perm" if self.num_experts is None else f"perm[{e}]")

    def require_padded_arrays(self) -> None:
        """The arrays have the padded Marlin shapes of the true sizes (qweight [E,] K_pad/16 x N_pad*16/pf, scales
        and zero points N_pad columns, ceil(K/G) groups), from metadata alone: what a loader checks before a kernel
        trusts size_k / size_n. (Not in __post_init__: hand-made weights for tests and benchmarks may be anything.)"""
        bits = self.weight_type.bits
        expected = {"qweight": marlin_qweight_shape(int(self.size_k), int(self.size_n), bits),
                    "scales": (self.num_groups, self.padded_n)}
        if self.zeros is not None:
            expected["zeros"] = (self.num_groups, self.padded_n * bits // 32)
        for name, shape in expected.items():
            got = tuple(getattr(self, name).shape)
            require(got[-2:] == shape, f"{name} has shape {got}, expected [E,] {shape} for size_k = {self.size_k}, "
                    f"size_n = {self.size_n}, group_size = {self.group_size}, {bits}-bit (docs/formats.md, \"Shapes "
                    f"that are not tile multiples\")")

    @property
    def num_groups(self) -> int:
        return num_groups(self.size_k, self.group_size)

    @property
    def padded_k(self) -> int:
        """Rows of the Marlin arrays: ceil(size_k / 16) * 16."""
        return padded_k(self.size_k)

    @property
    def padded_n(self) -> int:
        """Columns of the Marlin arrays (qweight tiles, scales, zero points): ceil(size_n / 64) * 64."""
        return padded_n(self.size_n)

    @property
    def has_act_order(self) -> bool:
        return self.perm is not None

    @property
    def workspace_size(self) -> int:
        return workspace_size(self.size_n, self.num_experts or 1)

    def expert(self, e: int) -> "MarlinWeight":
        """A view of expert ``e`` of a stack (no copy)."""
        if self.num_experts is None:
            raise ValueError("this MarlinWeight is a single layer, not an expert stack")
        if not 0 <= e < self.num_experts:
            raise ValueError(f"expert index {e} is outside [0, {self.num_experts})")
        pick = (lambda a: None if a is None else a[e])
        return dataclasses.replace(self, qweight=self.qweight[e], scales=self.scales[e], zeros=pick(self.zeros),
                                   g_idx=pick(self.g_idx), perm=pick(self.perm), num_experts=None)


def make_marlin_weight(q: QuantizedWeight, act_dtype=None, is_k_full: bool = True) -> MarlinWeight:
    """Repack a reference-quantized weight into Marlin layout (NumPy reference path)."""
    act = np.dtype(act_dtype or q.act_dtype)
    wt = q.weight_type
    size_k, size_n = q.codes.shape
    g_idx = perm = None
    if q.g_idx is not None:
        g_idx, perm = sort_g_idx(q.g_idx)
    qweight = marlin_repack_codes(q.codes, wt.bits, perm)
    if wt is ScalarType.FE4M3FN:
        scales = marlin_fp8_scales(q.scales, size_k, size_n, q.group_size, act)
    else:
        scales = permute_scales(np.asarray(q.scales).astype(act), size_k, size_n, q.group_size)
    zeros = zero_points_to_marlin(q.zeros, size_k, size_n, wt.bits) if q.zeros is not None else None
    return MarlinWeight(qweight, scales, zeros, g_idx, perm, size_k, size_n, q.group_size, wt, act, is_k_full)


def random_marlin_weight(size_k: int, size_n: int, weight_type, group_size: int, act_order: bool = False,
                         act_dtype=np.float16, seed: int = 0) -> tuple[MarlinWeight, QuantizedWeight]:
    """Fresh randn weights, quantized with the reference RTN quantizer and repacked. Returns (marlin, reference)."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((size_k, size_n), dtype=np.float32) * 0.1).astype(np.float32)
    q = quantize_weights(w, weight_type, group_size, act_order=act_order, act_dtype=act_dtype, seed=seed + 1)
    return make_marlin_weight(q), q
