"""Which fused MoE kernel runs a phase: ``MoeConfig`` (one instantiation of ``mwb::marlin_moe``, its geometry from
workbench.gemm's ``TileGeometry``), ``choose_moe_config`` under a ``MoePolicy``, its cache, and the layer's
``moe_block_size`` (``choose_block_size``). Pure: no GPU."""
from __future__ import annotations

import dataclasses
import sys
from typing import Any

from workbench.formats.moe_align import SUPPORTED_BLOCK_SIZES
from workbench.gemm import GROUP_CHANNELWISE, GROUP_GROUPED, TileGeometry, tile_k, tiled_n, two_block_smem
from workbench.policy import MoePolicy

# The package's namespace, which holds the default policy (workbench.moe._default_policy), read as a dict (see
# workbench.gemm.geometry).
_package = sys.modules[__package__].__dict__


def default_policy() -> MoePolicy:
    """The policy of calls that pass none: DEFAULT_MOE_POLICY unless a deprecated module global was set."""
    return _package["_default_policy"]


_default = default_policy


def choose_block_size(m: int, top_k: int, num_experts: int) -> int:
    """Smallest moe_block_size whose expected rows per expert fill at least ~90% of one block (docs/formats.md, "Fused
    MoE layer")."""
    for b in SUPPORTED_BLOCK_SIZES:
        if m * top_k / num_experts / b < 0.9:
            return b
    return SUPPORTED_BLOCK_SIZES[-1]


@dataclasses.dataclass(frozen=True)
class MoeConfig(TileGeometry):
    """One instantiation of ``mwb::marlin_moe``; block shape and shared memory from ``TileGeometry`` (the stage
    layout of kernels_cuda/marlin_mainloop.cuh, shared with the dense kernel)."""

    act: Any  # ScalarType F16 / BF16
    weight: Any  # ScalarType of the weights
    m_blocks: int  # 16-row blocks of one item (moe_block_size <= 16 m_blocks)
    n_tiles: int  # 64-column tiles of one item
    k_warp: int  # k16 tiles per warp per stage
    stages: int
    group_mode: int = GROUP_GROUPED  # GROUP_GROUPED or GROUP_CHANNELWISE (no act-order in the fused kernel)
    blocks_per_sm: int = 1  # CTAs per SM the registers are cut for (2: 128 registers, 16-row items only)
    swap: bool = False  # moe_block_size 8: one mma per 16x16 sub-block on the transposed problem
    # the weight's scales are E8M0 codes (MXFP4, MXFP8): the kernel's weight code is the type's + 16 (dequant.cuh),
    # as the dense KernelConfig's
    e8m0_scales: bool = False

    @property
    def name_expression(self) -> str:
        from workbench.scalar_types import ScalarType

        t = "__half" if self.act is ScalarType.F16 else "__nv_bfloat16"
        code = self.weight.abi_code + 16 * self.e8m0_scales
        return f"mwb::marlin_moe<{t}, {code}, {self.m_blocks}, {self.n_tiles}, {self.k_warp}, " \
               f"{self.stages}, {self.group_mode}, {self.blocks_per_sm}, {str(self.swap).lower()}>"


def choose_moe_config(act, weight, moe_block_size: int, size_n: int, size_k: int, group_size: int,
                      items_hint: int, sms: int, smem_limit: int, sm_smem: int = 0,
                      blocks_per_sm: int = -1, policy: MoePolicy | None = None,
                      e8m0_scales: bool = False) -> MoeConfig:
    """The first (BN, BK) that divides (N, K); 128 columns only when that still gives every SM an item.

    ``sm_smem``: shared memory per SM (0 = unknown: one CTA per SM). ``blocks_per_sm``: 1 or 2 to force the one- or
    two-CTA kernel (2 only where it exists: 16-row items with a ring that fits half an SM), -1 = the policy's
    ``blocks_per_sm``. ``policy``: workbench.policy.MoePolicy (None: the default). ``e8m0_scales``: the MX formats'
    kernels (MXFP4, MXFP8: E8M0 scale codes); the tile choice is the same (scale bytes take the bytes of 16-bit scale
    rows of twice the group, so a stage's shared memory does not change).
    """
    p = policy or _default()
    # the dense planner's rule for shapes that are not tile multiples: tiles of the padded width, K rounded up
    size_n, k_fit = tiled_n(size_n), tile_k(size_k, group_size)
    m_blocks = -(-moe_block_size // 16)
    group_mode = GROUP_CHANNELWISE if group_size < 0 else GROUP_GROUPED
    shapes = p.small_shapes if m_blocks <= 2 else p.large_shapes
    fits = []
    # (last resort: K rounded up to 128, whose last step runs past K, where no tile divides K itself)
    for k_try in dict.fromkeys((k_fit, -(-size_k // 128) * 128)):
        for n_tiles, k_warp in shapes:
            cfg = MoeConfig(act, weight, m_blocks, n_tiles, k_warp, 4, group_mode,
                            swap=moe_block_size <= min(p.swap_max_block, 8), e8m0_scales=bool(e8m0_scales))
            if k_try % cfg.block_k or size_n % cfg.block_n:
                continue
            if group_size > 0 and group_size % cfg.block_k and cfg.block_k % group_size:
                continue
            fits.append(cfg)
        if fits:
            break
    if not fits:
        raise ValueError(f"no fused MoE tile shape divides (size_k, size_n) = ({size_k}, {size_n}) (planned as "
                         f"({k_fit}, {size_n}))")
    wide = [c for c in fits if c.n_tiles >= 2 and items_hint * (size_n // c.block_n) >= sms]
    narrow = [c for c in fits if c.n_tiles == 1]
    preferred = (wide or narrow or fits) if p.prefer_wide_items else fits[:1]
    order = preferred + [c for c in fits if c not in preferred]
    if blocks_per_sm < 0:
        blocks_per_sm = p.blocks_per_sm
    if blocks_per_sm not in (0, 1, 2):
        raise ValueError(f"blocks_per_sm = {blocks_per_sm} must be 0 (automatic), 1 or 2")
    if m_blocks == 1 and sm_smem > 0 and blocks_per_sm != 1:
        half = two_block_smem(smem_limit, sm_smem)
        two = next((cfg for shape in order for stages in p.two_block_stages
                    for cfg in [dataclasses.replace(shape, stages=stages, blocks_per_sm=2)]
                    if cfg.smem_bytes <= half), None)
        if two is not None and (blocks_per_sm == 2 or (
                weight.bits in p.two_blocks_weight_bits and items_hint * (size_n // two.block_n) > sms)):
            return two
    for shape in order:
        for stages in (p.one_block_stages if m_blocks <= 2 else p.large_stages):
            cfg = dataclasses.replace(shape, stages=stages)
            if cfg.smem_bytes <= smem_limit:
                return cfg
    raise ValueError(f"no fused MoE tile for moe_block_size {moe_block_size} fits {smem_limit} bytes of shared memory")



_config_cache: dict[tuple, MoeConfig] = {}
_MAX_CACHED = 1024  # entries per cache: a serving loop sees a few dozen shapes; the bound keeps a sweep finite


def cached_moe_config(act, weight, moe_block_size: int, size_n: int, size_k: int, group_size: int, items_hint: int,
                      sms: int, smem_limit: int, sm_smem: int, policy: MoePolicy | None = None,
                      e8m0_scales: bool = False) -> MoeConfig:
    """choose_moe_config, remembered per arguments and policy (choose_moe_config costs more host time than
    the launch it configures, twice a layer)."""
    policy = policy or _default()
    key = (act, weight, moe_block_size, size_n, size_k, group_size, items_hint, sms, smem_limit, sm_smem, policy,
           e8m0_scales)
    cfg = _config_cache.get(key)
    if cfg is None:
        cfg = choose_moe_config(act, weight, moe_block_size, size_n, size_k, group_size, items_hint, sms, smem_limit,
                                sm_smem, policy=policy, e8m0_scales=e8m0_scales)
        if len(_config_cache) >= _MAX_CACHED:
            _config_cache.clear()
        _config_cache[key] = cfg
    return cfg

