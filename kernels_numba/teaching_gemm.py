"""A teaching Marlin GEMM: ``C = A @ W`` with W in Marlin's 16×64 tiles, one warp per 16×64 block of C.

It is written to be read beside the fast kernel (``kernels_cuda/marlin_mainloop.cuh``, ``WarpLoop``), not to be
fast: the same phases in the same order, with the hardware steps Numba cannot express done in the open.

    for each 16-row k tile:                                                         fast kernel (marlin_mainloop.cuh)
      1. fetch_to_shared  lane l copies words wpl*l .. wpl*l + wpl - 1 of the      WeightFetch + cp_async16_at
                          tile (16 bytes per lane per load) and 8 values of A
      2. load_registers   lane l reads the same words back, and its A fragment     lds128, ldmatrix_x4_at
      3. dequant          the words become B registers b[h][r] per sub-block      dequant_subblock (dequant.cuh)
      4. mma              8 × mma.m16n8k16 (4 sub-blocks × 2 column halves),       mma_m16n8k16 (mma.cuh)
                          emulated through shared memory (below)
    epilogue: each lane writes its accumulators to the C elements it owns          the kernel's write-out

**Why the mma is emulated through shared memory.** Numba has no ``mma.sync`` intrinsic, and the CUDA simulator has
no warp shuffles. A tensor-core instruction is a warp-wide exchange: every lane contributes its A and B fragment
registers and receives its C fragment. Here each lane writes its fragment values to shared matrices at the
positions the fragment maps of ``workbench.formats.warp_stage`` name, the warp synchronizes, and each lane computes
its own C elements from those matrices. The maps are kernel arguments (lookup tables), so the tests can hand it a
wrong map and see the result break.

**Dequantization** follows ``dequant_subblock`` bit for bit up to the point where the fast kernel reads a register
as a half: Numba has no bit cast, so ``magic_value`` says what number the pattern ``0x6400 | m`` is (1024 + m).
The products stay in float32 (the fast kernel rounds each scaled weight to fp16 with ``hmul2``), so the result
equals ``A @ dequantize(..., rounded=False)`` exactly wherever the sums are exact (small integers times powers of
two), and to float32 accumulation accuracy otherwise.

Supported: u4b8 and u8b128 weights (the symmetric types: no zero points), grouped scales (P64, applied to B before
each mma) and channelwise scales (P32, applied to the accumulators in the epilogue), any M.
"""
from __future__ import annotations

import functools

import numpy as np
from numba import cuda, float32, int32, uint32

from workbench.formats import register_dequant as rd
from workbench.formats import scales as sc
from workbench.formats import warp_stage
from workbench.formats._checks import require, require_ndim, require_shape
from workbench.formats.marlin_tile import TILE_K, TILE_N, words_per_lane, words_per_tile
from workbench.scalar_types import ScalarType

THREADS = 32  # one warp per block: the unit a tensor-core instruction works on
M_TILE = 16  # rows of A per block: the m of m16n8k16
FRAGS = 8  # 16×8 B fragments per 16×64 tile: 4 sub-blocks × 2 column halves
FRAG_VALUES = 4 * FRAGS  # a lane's B values (or C accumulators) of one tile: 4 per fragment
WPT4, WPT8 = words_per_tile(4), words_per_tile(8)  # 128 / 256 words per tile (shared-array sizes must be constants)
WPL_MAX = words_per_lane(8)  # 8: a lane's words for one tile (4-bit uses the first 4)
MAGIC_PAIR = 0x64006400  # (1024, 1024) in fp16: OR a code into the mantissa, get 1024 + code
LO_MASK, HI_MASK = 0x000F000F, 0x00F000F0  # the two nibbles of each 16-bit half that one lop3 keeps
BYTE_MASK = 0x00FF00FF  # bytes 0 and 2: what __byte_perm(x, 0x64646464, 0x4240) keeps under the magic byte


@cuda.jit(device=True, inline=True)
def magic_value(half_bits):
    """The number the fp16 pattern ``0x6400 | m`` (m < 1024) stands for: 1024 + m. (The exponent field of 0x6400 is
    25 = 15 + 10, so the ulp is exactly 1.) The fast kernel never computes this: the register simply *is* it."""
    return float32(1024 + int32(uint32(half_bits) & uint32(0x3FF)))


@cuda.jit(device=True, inline=True)
def dequant_subblock_4bit(word, h, scale, out, base):
    """u4b8: the lane's word of one sub-block -> the 4 values of column half h, fragment order (e = 2r + half).

    x = word >> 8h; lop3 with LO_MASK carries fields 0, 4 (rows k0, k0+1) as 1024 + code; with HI_MASK fields 1, 5
    (rows k0+8, k0+9) as 1024 + 16 code, which one hfma2 by 1/16 minus (64 + 8) turns into code - 8."""
    x = uint32(word) >> uint32(8 * h)
    lo = (x & uint32(LO_MASK)) | uint32(MAGIC_PAIR)  # lop3.b32 ..., 0xEA
    hi = (x & uint32(HI_MASK)) | uint32(MAGIC_PAIR)
    out[base + 0] = (magic_value(lo) - float32(1024 + 8)) * scale  # b[h][0] low:  row k0
    out[base + 1] = (magic_value(lo >> uint32(16)) - float32(1024 + 8)) * scale  # b[h][0] high: row k0 + 1
    out[base + 2] = (magic_value(hi) * float32(0.0625) - float32(64 + 8)) * scale  # b[h][1] low:  row k0 + 8
    out[base + 3] = (magic_value(hi >> uint32(16)) * float32(0.0625) - float32(64 + 8)) * scale  # row k0 + 9


@cuda.jit(device=True, inline=True)
def dequant_subblock_8bit(word, scale, out, base):
    """u8b128: the word of column half h (bytes: rows k0, k0+8, k0+1, k0+9) -> its 4 values in fragment order.

    prmt puts bytes 0, 2 under the magic byte 0x64 (1024 + b0, 1024 + b2); bytes 1, 3 likewise."""
    x = uint32(word)
    lo = (x & uint32(BYTE_MASK)) | uint32(MAGIC_PAIR)  # __byte_perm(x, 0x64646464, 0x4240)
    hi = ((x >> uint32(8)) & uint32(BYTE_MASK)) | uint32(MAGIC_PAIR)  # __byte_perm(x, 0x64646464, 0x4341)
    out[base + 0] = (magic_value(lo) - float32(1024 + 128)) * scale
    out[base + 1] = (magic_value(lo >> uint32(16)) - float32(1024 + 128)) * scale
    out[base + 2] = (magic_value(hi) - float32(1024 + 128)) * scale
    out[base + 3] = (magic_value(hi >> uint32(16)) - float32(1024 + 128)) * scale


@functools.lru_cache(maxsize=None)
def kernel_source(bits: int, grouped: bool):
    """The kernel's Python function for one weight width and scale layout (compile-time constants: local and shared
    array sizes, the dequant branch)."""
    wpl = words_per_lane(bits)
    wpt = WPT4 if bits == 4 else WPT8
    words_per_subblock = bits // 4

    def teaching_gemm(a, qweight, scales, c, a_map, b_map, c_map, size_m, size_k, size_n, group_size):
        lane = cuda.threadIdx.x
        n_tile = cuda.blockIdx.x
        m0 = cuda.blockIdx.y * M_TILE
        row_words = size_n * TILE_K * bits // 32  # words of one k-tile row of qweight (all n tiles)
        sh_a = cuda.shared.array((M_TILE, TILE_K), float32)  # this k tile of A
        sh_b = cuda.shared.array(wpt, uint32)  # this tile of B: the global bytes, same positions
        x_a = cuda.shared.array((M_TILE, TILE_K), float32)  # the mma's view of A (written by fragments)
        x_b = cuda.shared.array((TILE_K, TILE_N), float32)  # the mma's view of B, all 8 fragments of the tile
        words = cuda.local.array(WPL_MAX, uint32)
        a_frag = cuda.local.array(8, float32)  # a0..a3, two halves each
        b_frag = cuda.local.array(FRAG_VALUES, float32)  # fragment f = 2s + h: b0, b1, two halves each
        acc = cuda.local.array(FRAG_VALUES, float32)  # fragment f: c0..c3
        for i in range(FRAG_VALUES):
            acc[i] = float32(0.0)

        for k_tile in range(size_k // TILE_K):
            # 1. fetch_to_shared: one (4-bit) or two (8-bit) 16-byte copies per lane, the same offsets in shared
            tile_start = k_tile * row_words + n_tile * wpt
            for i in range(wpl):
                sh_b[wpl * lane + i] = uint32(qweight[tile_start + wpl * lane + i])
            r, k_first = lane // 2, 8 * (lane % 2)  # A: 16 rows × 16 values, 8 (16 bytes of fp16) per lane
            for j in range(8):
                sh_a[r, k_first + j] = a[m0 + r, k_tile * TILE_K + k_first + j] if m0 + r < size_m else float32(0)
            cuda.syncthreads()

            # 2. load_registers: the lane's own words back (lds128), its A fragment (ldmatrix)
            for i in range(wpl):
                words[i] = sh_b[wpl * lane + i]
            for e in range(8):
                a_frag[e] = sh_a[a_map[lane, e, 0], a_map[lane, e, 1]]

            # 3. dequant: sub-block s, column half h -> fragment f = 2s + h. Grouped scales: the lane's 16-byte P64
            #    vector of its group row holds columns lane//4 + 8e, value e = 2s + h (grouped_scale_slot)
            group = (k_tile * TILE_K) // group_size
            for s in range(4):
                for h in range(2):
                    scale = scales[group, n_tile * TILE_N + 8 * (lane // 4) + 2 * s + h] if grouped else float32(1)
                    if bits == 4:
                        dequant_subblock_4bit(words[s], h, scale, b_frag, 4 * (2 * s + h))
                    else:
                        dequant_subblock_8bit(words[words_per_subblock * s + h], scale, b_frag, 4 * (2 * s + h))

            # 4. mma, emulated: every lane puts its fragments where the maps say, the warp meets, each lane computes
            #    its own C elements. (One exchange for the 8 instructions of the tile; the hardware does 8.)
            for e in range(8):
                x_a[a_map[lane, e, 0], a_map[lane, e, 1]] = a_frag[e]
            for f in range(FRAGS):
                for e in range(4):
                    x_b[b_map[lane, e, 0], 8 * f + b_map[lane, e, 1]] = b_frag[4 * f + e]
            cuda.syncthreads()
            for f in range(FRAGS):
                for e in range(4):
                    row, col = c_map[lane, e, 0], 8 * f + c_map[lane, e, 1]
                    total = acc[4 * f + e]
                    for k in range(TILE_K):
                        total += x_a[row, k] * x_b[k, col]
                    acc[4 * f + e] = total
            cuda.syncthreads()  # before the next tile overwrites sh_a, sh_b, x_a, x_b

        # epilogue: C elements of fragment f = 2s + h; channelwise scales (P32) multiply the fp32 sums here
        for f in range(FRAGS):
            s, h = f // 2, f % 2
            for e in range(4):
                row, col = c_map[lane, e, 0], c_map[lane, e, 1]
                value = acc[4 * f + e]
                if not grouped:  # channelwise_scale_index(col, s, h)
                    value *= scales[0, n_tile * TILE_N + 32 * (s // 2) + 8 * (col // 2) + 4 * (s % 2) + 2 * h
                                    + col % 2]
                if m0 + row < size_m:
                    c[m0 + row, n_tile * TILE_N + 8 * f + col] = value

    return teaching_gemm


@functools.lru_cache(maxsize=None)
def _kernel(bits: int, grouped: bool):
    return cuda.jit(kernel_source(bits, grouped))


def fragment_maps():
    """The A, B, C operand maps as device-ready int32 tables (workbench.formats.warp_stage.fragment_tables)."""
    return warp_stage.fragment_tables()


def teaching_gemm(a, qweight, scales, size_k: int, size_n: int, weight_type, group_size: int, maps=None):
    """C (M, N) float32 = A (M, K) @ W, W given as Marlin qweight (K/16, N*16/pf) and Marlin-permuted scales (ng, N).

    ``maps``: the fragment tables to use (default: the true ones); the tests pass broken ones."""
    wt = ScalarType.parse(weight_type)
    require(wt in (ScalarType.U4B8, ScalarType.U8B128),
            f"the teaching kernel supports u4b8 and u8b128 weights, got {wt}")
    bits = wt.bits
    a = np.asarray(a, dtype=np.float32)
    require_ndim(a, 2, "a")
    size_m = a.shape[0]
    require_shape(a, (size_m, size_k), "a", "M, K")
    require(size_k % TILE_K == 0 and size_n % TILE_N == 0,
            f"size_k = {size_k}, size_n = {size_n}: K must be a multiple of 16 and N of 64 (Marlin tile)")
    qweight = np.ascontiguousarray(np.asarray(qweight)).view(np.uint32)
    require_shape(qweight, (size_k // TILE_K, size_n * TILE_K * bits // 32), "qweight", f"K/16, N*16/pf ({wt})")
    grouped = sc.uses_grouped_permutation(size_k, group_size)
    scales = np.asarray(scales, dtype=np.float32)
    require_shape(scales, (sc.num_groups(size_k, group_size), size_n), "scales", "num_groups, N")
    maps = fragment_maps() if maps is None else maps
    c = cuda.to_device(np.full((size_m, size_n), np.nan, dtype=np.float32))  # poisoned: every element is written
    grid = (size_n // TILE_N, -(-size_m // M_TILE))
    _kernel(bits, grouped)[grid, THREADS](
        cuda.to_device(a), cuda.to_device(qweight.reshape(-1)), cuda.to_device(scales), c,
        cuda.to_device(maps["a"]), cuda.to_device(maps["b"]), cuda.to_device(maps["c"]),
        size_m, size_k, size_n, group_size if grouped else size_k)
    return c.copy_to_host()


def stage_reference(a, qweight, scales, size_k: int, size_n: int, weight_type, group_size: int, k_tile: int,
                    n_tile: int = 0, m_block: int = 0) -> dict[str, np.ndarray]:
    """NumPy spec of one stage of one block, lane by lane: what each lane holds after each phase.

    ``words`` (32, wpl) uint32 the lane loads; ``a`` (32, 8) its A fragment; ``b`` (32, 8, 4) its B fragments
    (f = 2s + h: sub-block s, column half h; scaled for grouped scales, as the kernel does); ``c`` (32, 8, 4) what the
    stage's 8 mma add to its accumulators. Summed over k tiles (and scaled by the channelwise scales in the epilogue)
    ``c`` is the block's output, element (row, col) of fragment f at ``c_map``.
    """
    wt = ScalarType.parse(weight_type)
    bits = wt.bits
    maps = fragment_maps()
    lanes = np.arange(THREADS)
    flat = np.ascontiguousarray(np.asarray(qweight)).view(np.uint32).reshape(-1)
    words = flat[(k_tile * (size_n // TILE_N) + n_tile) * words_per_tile(bits) + warp_stage.lane_load_words(lanes, bits)]
    a = np.asarray(a, dtype=np.float32)
    rows = 16 * m_block + maps["a"][..., 0]
    a_frag = np.where(rows < a.shape[0], a[np.minimum(rows, a.shape[0] - 1), 16 * k_tile + maps["a"][..., 1]], 0)
    grouped = sc.uses_grouped_permutation(size_k, group_size)
    group = (16 * k_tile) // group_size if grouped else 0
    b = np.zeros((THREADS, FRAGS, 4), dtype=np.float32)
    for s in range(4):
        per_subblock = words[:, (bits // 4) * s:(bits // 4) * (s + 1)]
        regs = rd.dequant_subblock(per_subblock, wt, np.float16, np.ones((THREADS, 2), np.float16), scaled=False)
        for h in range(2):
            scale = np.asarray(scales, np.float32)[group, 64 * n_tile + 8 * (lanes // 4) + 2 * s + h] if grouped \
                else np.float32(1)
            for r in range(2):
                lo, hi = rd.halves(regs[:, h, r], np.float16)
                b[:, 2 * s + h, 2 * r] = lo.astype(np.float32) * scale
                b[:, 2 * s + h, 2 * r + 1] = hi.astype(np.float32) * scale
    c = np.stack([warp_stage.mma_reference(a_frag, b[:, f], np.zeros((THREADS, 4))) for f in range(FRAGS)], axis=1)
    return {"words": words, "a": a_frag.astype(np.float32), "b": b, "c": c}


def compile_targets():
    """(name, python function, argument types) of every variant, for the offline compile check."""
    from numba import types

    def arr(dt, nd):
        return types.Array(dt, nd, "C")

    for bits in (4, 8):
        for grouped in (True, False):
            yield (f"teaching_gemm[{bits}-bit,{'grouped' if grouped else 'channelwise'}]", kernel_source(bits, grouped),
                   (arr(types.float32, 2), arr(types.uint32, 1), arr(types.float32, 2), arr(types.float32, 2),
                    arr(types.int32, 3), arr(types.int32, 3), arr(types.int32, 3), types.int64, types.int64,
                    types.int64, types.int64))
