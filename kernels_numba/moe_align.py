"""``moe_align_block_size`` on the device: one Numba-CUDA block groups routed (token, slot) pairs by expert.

NumPy spec: ``workbench.formats.moe_align.moe_align_block_size`` (docs/formats.md, "moe_align_block_size"). The
content of every expert segment matches it exactly; the order inside a segment does not (ranks come from
shared-memory atomics), so compare with ``workbench.formats.moe_align.segments``.

One block does everything, in four phases separated by barriers (routing tensors are small: M·top_k entries):

    1. count     counts[e] += 1 for every valid flat entry               (shared atomics)
    2. offsets   thread 0: offsets[e] = Σ_{e' < e} roundup(counts[e'], block)    (E <= MAX_EXPERTS, serial)
    3. prefill   sorted_token_ids[:] = numel (sentinel), expert_ids[b] = expert owning block b (tail 0)
    4. scatter   sorted_token_ids[offsets[e] + rank] = i, rank from atomics on a per-expert cursor

The kernel writes every element of its three outputs, so callers may pass uninitialised (or poisoned) buffers.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, int32

from kernels_numba._launch import Arrays, jit

MAX_EXPERTS = 1024  # shared counters per expert (docs/formats.md, "moe_align_block_size": at most 1024 experts)
CURSOR_SLOTS = MAX_EXPERTS + 1  # segment starts plus the end; a global, as shared shapes must be constants
THREADS = 256  # one block; every phase is a block-stride loop, so any power of two works (tests use 32)


@jit
def _moe_align_kernel(topk_flat, numel, num_experts, block_size, expert_map, has_map, sorted_ids, expert_ids,
                      num_post_padded):
    counts = cuda.shared.array(MAX_EXPERTS, int32)
    cursors = cuda.shared.array(CURSOR_SLOTS, int32)  # phase 2: segment starts; phase 4: next free slot
    tid = cuda.threadIdx.x
    nthreads = cuda.blockDim.x
    for e in range(tid, num_experts, nthreads):
        counts[e] = 0
    cuda.syncthreads()

    # 1. count
    for i in range(tid, numel, nthreads):
        e = topk_flat[i]
        if e >= 0 and e < num_experts:
            cuda.atomic.add(counts, e, 1)
    cuda.syncthreads()

    # 2. segment starts (exclusive scan of the block-rounded counts)
    if tid == 0:
        total = 0
        for e in range(num_experts):
            cursors[e] = total
            total += (counts[e] + block_size - 1) // block_size * block_size
        cursors[num_experts] = total
        num_post_padded[0] = total
    cuda.syncthreads()

    # 3. prefill: sentinels everywhere, expert of every block (0 past the padded total, -1 for non-local experts)
    for j in range(tid, sorted_ids.shape[0], nthreads):
        sorted_ids[j] = numel
    total_blocks = cursors[num_experts] // block_size
    for b in range(tid, expert_ids.shape[0], nthreads):
        if b >= total_blocks:
            expert_ids[b] = 0
    for e in range(tid, num_experts, nthreads):
        local = e
        if has_map:
            local = expert_map[e]
        for b in range(cursors[e] // block_size, cursors[e + 1] // block_size):
            expert_ids[b] = local
    cuda.syncthreads()  # the sentinel prefill must land before the scatter overwrites part of it

    # 4. scatter
    for i in range(tid, numel, nthreads):
        e = topk_flat[i]
        if e >= 0 and e < num_experts:
            pos = cuda.atomic.add(cursors, e, 1)
            sorted_ids[pos] = i


def moe_align_block_size(topk_ids, block_size: int, num_experts: int, expert_map=None, *, threads: int = THREADS,
                         stream=None):
    """Device ``moe_align_block_size``: ``(sorted_token_ids [cap], expert_ids [cap/block], num_tokens_post_padded
    [1])``, all int32, ``cap = aligned_capacity(numel, block_size, num_experts)``.

    ``topk_ids`` [M, top_k] int32 (NumPy, CuPy, Numba device array); ``expert_map`` [num_experts] int32 maps a global
    expert to its local id or -1 (expert on another device). NumPy in -> NumPy out; device in -> device out.
    """
    from workbench.formats.moe_align import aligned_capacity

    shape = tuple(int(s) for s in topk_ids.shape)
    if len(shape) != 2:
        raise ValueError(f"topk_ids must be 2-D (M, top_k), got shape {shape}")
    if np.dtype(topk_ids.dtype) != np.dtype(np.int32):
        raise TypeError(f"topk_ids dtype = {np.dtype(topk_ids.dtype)} must be int32")
    for name, v in (("block_size", block_size), ("num_experts", num_experts), ("threads", threads)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
            raise ValueError(f"{name} = {v!r} must be a positive int")
    if num_experts > MAX_EXPERTS:
        raise ValueError(f"num_experts = {num_experts} exceeds MAX_EXPERTS = {MAX_EXPERTS} (shared counters)")
    if threads % 32 or threads > 1024:
        raise ValueError(f"threads = {threads} must be a multiple of 32 and at most 1024")
    if expert_map is not None:
        map_shape = tuple(int(s) for s in expert_map.shape)
        if map_shape != (num_experts,):
            raise ValueError(f"expert_map has shape {map_shape}, expected ({num_experts},)")
        if np.dtype(expert_map.dtype) != np.dtype(np.int32):
            raise TypeError(f"expert_map dtype = {np.dtype(expert_map.dtype)} must be int32")
    numel = shape[0] * shape[1]
    cap = aligned_capacity(numel, int(block_size), int(num_experts))
    arrays = Arrays(stream)
    d_topk = arrays.take(topk_ids, "topk_ids").reshape(max(numel, 1)) if numel else arrays.empty((1,), np.int32)
    d_map = arrays.take(expert_map, "expert_map") if expert_map is not None else arrays.empty((1,), np.int32)
    sorted_ids = arrays.empty((cap,), np.int32)
    expert_ids = arrays.empty((cap // block_size,), np.int32)
    post = arrays.empty((1,), np.int32)
    _moe_align_kernel[1, threads, arrays.stream](d_topk, np.int32(numel), np.int32(num_experts),
                                                  np.int32(block_size), d_map, expert_map is not None, sorted_ids,
                                                  expert_ids, post)
    return arrays.give(sorted_ids), arrays.give(expert_ids), arrays.give(post)
