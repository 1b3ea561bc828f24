"""``moe_align_block_size``: group routed (token, slot) pairs by expert into blocks of ``block_size`` rows.

Specified in docs/formats.md, "moe_align_block_size".

A router gives every token ``top_k`` experts: ``topk_ids [M, top_k]``. Flattened, entry ``i`` is token ``i // top_k``,
slot ``i % top_k``. A fused MoE kernel wants, for every block of ``block_size`` rows, one expert; so each expert's
entries are laid out in one segment padded up to a multiple of the block size::

    topk_ids = [[2,3,4],[1,2,4],[1,3,4],[1,2,3]]   block_size 4, 5 experts, numel 12 (sentinel 12)
    sorted_token_ids = [ 3  6  9 12 | 0  4 10 12 | 1  7 11 12 | 2  5  8 12 ]   (experts 1, 2, 3, 4)
    expert_ids       = [ 1          | 2          | 3          | 4          ]
    num_tokens_post_padded = 16

The order of indices inside a segment is not part of the contract (GPU implementations rank with atomics);
this reference lists them ascending. Compare segments as sets.
"""
from __future__ import annotations

import numpy as np

from workbench.formats._checks import require, require_ndim

SUPPORTED_BLOCK_SIZES = (8, 16, 32, 48, 64)  # the fused Marlin MoE kernel's moe_block_size values


def aligned_capacity(numel: int, block_size: int, num_experts: int) -> int:
    """Upper bound of sorted_token_ids' length: every expert may waste block_size - 1 slots, rounded to a block."""
    cap = numel + num_experts * (block_size - 1)
    return -(-cap // block_size) * block_size


def moe_align_block_size(topk_ids: np.ndarray, block_size: int, num_experts: int,
                         expert_map: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Returns ``(sorted_token_ids int32 [cap], expert_ids int32 [cap/block], num_tokens_post_padded int32 [1])``.

    Ids outside ``[0, num_experts)`` (e.g. -1 for a dropped slot) are ignored. With ``expert_map`` (global id ->
    local id, -1 when the expert lives on another device), blocks of non-local experts get expert id -1, which
    kernels skip. Blocks past ``num_tokens_post_padded`` have expert id 0.
    """
    topk_ids = np.asarray(topk_ids)
    require_ndim(topk_ids, 2, "topk_ids")
    if not np.issubdtype(topk_ids.dtype, np.integer):
        raise TypeError(f"topk_ids must be an integer array, got dtype {topk_ids.dtype}")
    require(isinstance(block_size, (int, np.integer)) and block_size > 0, f"block_size = {block_size} must be > 0")
    require(isinstance(num_experts, (int, np.integer)) and num_experts > 0,
            f"num_experts = {num_experts} must be > 0")
    if expert_map is not None:
        expert_map = np.asarray(expert_map)
        require(expert_map.shape == (num_experts,),
                f"expert_map has shape {expert_map.shape}, expected ({num_experts},)")
    flat = topk_ids.reshape(-1)
    numel = flat.size
    cap = aligned_capacity(numel, block_size, num_experts)
    sorted_ids = np.full(cap, numel, dtype=np.int32)  # sentinel: numel is never a real index
    expert_ids = np.zeros(cap // block_size, dtype=np.int32)
    valid = (flat >= 0) & (flat < num_experts)
    cursor = 0
    for e in range(num_experts):
        members = np.flatnonzero(valid & (flat == e)).astype(np.int32)
        if members.size == 0:
            continue
        padded = -(-members.size // block_size) * block_size
        sorted_ids[cursor:cursor + members.size] = members
        local = e if expert_map is None else int(expert_map[e])
        expert_ids[cursor // block_size:(cursor + padded) // block_size] = local
        cursor += padded
    return sorted_ids, expert_ids, np.array([cursor], dtype=np.int32)


def segments(sorted_token_ids: np.ndarray, expert_ids: np.ndarray, num_tokens_post_padded, block_size: int,
             numel: int) -> dict[int, set[int]]:
    """expert -> set of flat indices routed to it (sentinels dropped): the order-free content to compare."""
    out: dict[int, set[int]] = {}
    total = int(np.asarray(num_tokens_post_padded).reshape(-1)[0])
    for b in range(total // block_size):
        ids = np.asarray(sorted_token_ids[b * block_size:(b + 1) * block_size])
        out.setdefault(int(expert_ids[b]), set()).update(int(i) for i in ids if i < numel)
    return out
