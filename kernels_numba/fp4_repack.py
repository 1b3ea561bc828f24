"""The microscaled formats' transforms (NVFP4, MXFP4, MXFP8) as Numba-CUDA kernels.

Specified in docs/formats.md, "Microscaling in Marlin"; NumPy references in ``workbench.formats.fp4_marlin``.
Every kernel takes a leading expert axis (a stack of experts is one launch) and each transform is one launch.

**Weights.** A row of the checkpoint, E2M1 bytes [N, K/2] (or MXFP8 bytes [N, K]), read as little-endian words is
the transpose of the GPTQ qweight: FP4 word (n, c) = GPTQ 4-bit word (c, n) (8 codes k = 8c..8c+7 of column n),
FP8 word (n, c) = GPTQ 8-bit word (c, n). So a k-tile of row n is one 8-byte word (4-bit) or two (8-bit), and the
Marlin words are the direct GPTQ kernel's (``marlin_repack.marlin_words_4bit`` / ``marlin_words_8bit``) of those
words. The kernels here ("sector" kernels) take the transpose out of the memory accesses::

    warp = one n-tile (64 rows) x 4 k-tiles (x groups_per_warp); lane = (col = lane // 4, j = lane % 4)
    loads   lane (col, j) reads k-tile j of rows col + 8 i, i = 0..7: each load instruction reads 8 rows x 32
            contiguous bytes, whole 32-byte sectors (8-bit: two instructions read 8 rows x 64 bytes, each one half
            of every sector)
    compute rows col + 8 i are the columns n = 16 sub + col and n + 8 of every sub-block: all a lane needs for the
            Marlin words 16 col .. 16 col + 15 of its k-tile (4-bit; 8-bit: 32 col + 8 row2 + sub, row2 = 2 words)
    stores  those words go to a warp-private shared-memory tile (padded so that neither side has bank conflicts),
            then each warp writes its k-tile rows with whole 128-byte lines

One k-tile row of an n-tile is 512 (4-bit) or 1024 (8-bit) contiguous bytes of the Marlin array, so every global
access is a whole sector or line; no word is read or written twice. The inverse FP4 kernel runs the same layout
backwards. Inputs whose address is not 8-byte aligned (a view into another buffer) are first copied to an aligned
buffer (the kernels read 8-byte words).

**Shapes that are not tile multiples** (docs/formats.md, "Microscaling in Marlin"): K is a whole number of the
format's groups, so always whole k-tiles; N may end in a partial tile. The sector kernels then run unchanged on the
floor(N / 64) whole n-tiles (the same launch as for an aligned N of that size), and an edge kernel does the last
n-tile column: one Marlin word (forwards) or checkpoint word (backwards) per thread through the tile map, every load
predicated on N, the padding written as zero codes. No copy of the weight is made.

**Scales.** A scale tile kernel moves a 64-column x 32-group tile of the checkpoint scales [N, ng] through shared
memory: a warp reads 32 consecutive groups of one row, and writes 32 consecutive Marlin bytes of one group row::

    Marlin byte d of [ng, N]: p = d with bits 0 and 1 swapped (the [0, 2, 1, 3] shuffle),
    then logical = p - p % W + P[p % W] (P64, or P32 for one group), (g, n) = divmod(logical, N),
    source = weight_scale[n, g]

(W divides N_pad, so the permutation stays inside the tile's 64 columns; rows n >= N of the last tile are staged as
byte 0, the padding, and not read.) The byte conversion and every check are fused into the same pass. The NVFP4 scale byte is computed with integer moves, not through fp16: an E4M3 magnitude
``(e, m)`` with scale factor ``2^s`` becomes S0E5M3 ``(e + 15 + s, m)`` for a normal code and, for a subnormal
``m / 8 · 2^-6``, the normalised ``(p + 13 + s, (m << (3 - p)) & 7)`` with ``p = floor(log2 m)`` — the bits
``fp16(value · 2^7 · 2^s)`` has in positions 14..7. Bad values (NaN codes, an fp16 overflow) are marked in a zeroed
error slot (the lowest index i as an atomic max of ``MARK_BASE - i``, and a count) and reported by the host wrapper
with the NumPy reference's message; negative NVFP4 scales are counted and warned about the same way. The host reads
the slot back once, after the launch (the check has to see the kernel's result before the call returns).

Launch shapes (k-tile groups per warp, grid order, warps per block, barrier) are ``WEIGHT_LAUNCH``; the
measurements behind them are in docs/performance.md, "Repack kernels".
"""
from __future__ import annotations

import functools
import warnings

import numpy as np
from numba import cuda, int64, uint8, uint32, uint64

from kernels_numba._launch import SIMULATOR, Arrays, copy_to_host_checked, is_device_array, jit
from kernels_numba.marlin_repack import gptq_byte_from_marlin_4bit, marlin_words_4bit, marlin_words_8bit
from workbench.formats import fp4_marlin as fm
from workbench.formats import microscale as ms
from workbench.formats._checks import TILE_K, TILE_N, padded_n, require
from workbench.formats.marlin_tile import tile_permutation
from workbench.formats.scales import SCALE_PERM_32, SCALE_PERM_64

THREADS = 256  # element-wise kernels (the scale process steps, the smallest-scale reduction)
MAX_BLOCKS = 132 * 16  # their grid-stride cap, as kernels_numba.scales
MARK_BASE = 1 << 62  # error slots: the lowest bad index i is kept as an atomic max of MARK_BASE - i (0: none)

# weights: the sector kernels
SECTOR_WARPS = 4
# the warp-private stage: word (k-tile j, column col, m) at j * STAGE_ROW + col * STAGE_COL + m. A row stride of
# 8 mod 32 and an odd column stride put the 32 lanes' (col, j) stores of one m into 32 banks, and a warp's reads of
# 32 consecutive Marlin words hit 32 banks too (8-bit; 4-bit: 31, lanes 0 and 31 share one)
STAGE_ROW_4 = 136  # 4-bit: 8 columns x 17 (16 words + 1 pad)
STAGE_COL_4 = 17
STAGE_ROW_8 = 264  # 8-bit: 8 columns x 33 (32 words + 1 pad)
STAGE_COL_8 = 33
# kernel -> (k-tile groups per warp, n-tiles fastest in the grid, warps per block, a warp's own barrier instead of
# the block's): the shipped launch shapes, the fastest of a sweep of all eight (docs/performance.md, "Repack kernels")
WEIGHT_LAUNCH = {"fp4_repack": (1, False, SECTOR_WARPS, False), "fp4_unpack": (1, False, SECTOR_WARPS, True),
                 "fp8_repack": (2, True, SECTOR_WARPS, False)}

# scales: the tile kernels
SCALE_TILE_N = 64
SCALE_TILE_G = 32
SCALE_THREADS = 256
SCALE_STAGE_STRIDE = 68  # bytes a staged group row takes: 64 + 4, so 32 lanes storing one byte each hit 32 banks
SCALE_STAGE_BYTES = SCALE_TILE_G * SCALE_STAGE_STRIDE  # (a shared array's size must be one constant)


def _blocks(total: int) -> int:
    return max(1, min(MAX_BLOCKS, -(-total // THREADS)))


# ---------------------------------------------------------------------------------------------------------------
# device helpers
# ---------------------------------------------------------------------------------------------------------------
@cuda.jit(device=True, inline=True)
def shuffled(d):
    """d with bits 0 and 1 swapped: the [0, 2, 1, 3] shuffle of every four scale bytes (its own inverse)."""
    j = d & 3
    return d - j + (((j & 1) << 1) | (j >> 1))


@cuda.jit(device=True, inline=True)
def marlin_scale_column(c, grouped):
    """Column c (0..63) of a 64-column chunk of a Marlin scale row -> the logical column it holds: the shuffle,
    then P64 (grouped: more than one group) or P32."""
    p = shuffled(c)
    if grouped:
        return (p >> 3) + ((p & 7) << 3)
    lane = p & 31
    return p - lane + ((lane >> 3) << 1) + (lane & 1) + (((lane >> 1) & 3) << 3)


@cuda.jit(device=True, inline=True)
def mark(error, slot, where):
    """Keep the lowest ``where`` in error[slot] (zeroed: none yet) and count it in error[slot + 1]."""
    cuda.atomic.max(error, slot, uint64(MARK_BASE) - uint64(where))
    cuda.atomic.add(error, slot + 1, uint64(1))


@cuda.jit(device=True, inline=True)
def s0e5m3_of_e4m3(magnitude, s):
    """E4M3 magnitude byte (0..0x7E) and scale factor 2^s -> the S0E5M3 byte (as an int; > 0xFF: fp16 overflow)."""
    if magnitude == 0:
        return 0
    e = magnitude >> 3
    m = magnitude & 7
    if e > 0:
        exp = e + 15 + s
        if exp >= 31:
            return 0x100
        return (exp << 3) | m
    p = 0 if m == 1 else (1 if m < 4 else 2)
    return ((p + 13 + s) << 3) | ((m << (3 - p)) & 7)


@cuda.jit(device=True, inline=True)
def e4m3_of_s0e5m3(b, s):
    """S0E5M3 byte and scale factor 2^s -> the E4M3 byte of ``value / 2^s`` (round to nearest even, saturating at
    448, as the reference's float_to_e4m3)."""
    exp = b >> 3
    m = b & 7
    if exp == 31:
        return 0x7E if m == 0 else 0x7F  # fp16 inf saturates, NaN stays NaN
    if exp == 0:
        return 0  # an fp16 subnormal: far below E4M3's smallest subnormal
    e4 = exp - 15 - s
    if e4 > 15 or (e4 == 15 and m == 7):
        return 0x7E
    if e4 >= 1:
        return (e4 << 3) | m
    shift = 1 - e4
    if shift > 5:
        return 0
    full = 8 + m
    q = full >> shift
    rem = full & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    if rem > half or (rem == half and (q & 1) == 1):
        q += 1
    return q


# ---------------------------------------------------------------------------------------------------------------
# weights: the sector kernels
# ---------------------------------------------------------------------------------------------------------------
def sector_grid(size_k: int, size_n: int, experts: int, groups: int, n_fastest: bool,
                warps: int = SECTOR_WARPS) -> tuple[int, int, int]:
    """Grid of the sector kernels: a block is ``warps`` warps along K of one n-tile, a warp 4 * groups k-tiles."""
    k_blocks = -(-(size_k // 16) // (4 * groups * warps))
    n_tiles = size_n // 64
    return (n_tiles, k_blocks, experts) if n_fastest else (k_blocks, n_tiles, experts)


@cuda.jit(device=True, inline=True)
def _block_barrier():
    cuda.syncthreads()


@cuda.jit(device=True, inline=True)
def _warp_barrier():
    cuda.syncwarp()


def _stage_barrier(warp_sync: bool):
    """The barrier between a warp's stores into its private stage and its reads of it: the block's, or (warp_sync,
    on a GPU) the warp's own, so a warp need not wait for the block's other warps (the simulator has no syncwarp)."""
    return _warp_barrier if warp_sync and not SIMULATOR else _block_barrier


def fp4_sector_repack_source(groups: int = 1, n_fastest: bool = False, warps: int = SECTOR_WARPS,
                             warp_sync: bool = False):
    """src uint64 [E, N, K/16] (word (n, kt): codes 16 kt .. 16 kt + 15 of row n, i.e. GPTQ words a | b << 32 of
    k-tile kt, column n) -> out uint32 [E, K/16, 2N] Marlin words."""
    held = 8 * groups
    stage_words = warps * 4 * groups * STAGE_ROW_4
    per_warp = 4 * groups * STAGE_ROW_4
    barrier = _stage_barrier(warp_sync)

    def fp4_sector_repack(src, out, size_n):
        """Grid sector_grid(K, N, E, groups, n_fastest, warps), 32 * warps threads."""
        stage = cuda.shared.array(stage_words, dtype=uint32)
        if n_fastest:
            nt = cuda.blockIdx.x
            kb = cuda.blockIdx.y
        else:
            kb = cuda.blockIdx.x
            nt = cuda.blockIdx.y
        e = uint64(cuda.blockIdx.z)
        tid = cuda.threadIdx.x
        warp = tid >> 5
        lane = tid & 31
        col = lane >> 2
        j = lane & 3
        k_tiles = out.shape[1]
        kt_w = (kb * warps + warp) * (4 * groups)  # the warp's first k-tile
        row0 = (nt << 6) + col
        sbase = warp * per_warp
        words = cuda.local.array(held, dtype=uint64)
        for t in range(held):  # rows col + 8 i of k-tile kt_w + 4 g + j, all loads before any use
            kt = kt_w + 4 * (t >> 3) + j
            if kt < k_tiles:
                words[t] = src[e, uint64(row0 + 8 * (t & 7)), uint64(kt)]
        for g in range(groups):
            kt = kt_w + 4 * g + j
            if kt < k_tiles:
                srow = sbase + (4 * g + j) * STAGE_ROW_4 + STAGE_COL_4 * col
                for sub in range(4):
                    ab = words[8 * g + 2 * sub]  # row n = 16 sub + col: a (k 0-7), b (k 8-15)
                    cd = words[8 * g + 2 * sub + 1]  # row n + 8
                    a = uint32(ab & uint64(0xFFFFFFFF))
                    b = uint32(ab >> uint64(32))
                    c = uint32(cd & uint64(0xFFFFFFFF))
                    d = uint32(cd >> uint64(32))
                    for row2 in range(4):  # Marlin word 16 col + 4 row2 + sub
                        stage[srow + 4 * row2 + sub] = marlin_words_4bit(a, b, c, d, row2)
        barrier()
        obase = nt << 7
        for q in range(4 * groups):
            kt = kt_w + q
            if kt < k_tiles:
                for r in range(4):
                    p = 32 * r + lane
                    out[e, uint64(kt), uint64(obase + p)] = stage[sbase + q * STAGE_ROW_4 + STAGE_COL_4 * (p >> 4)
                                                                  + (p & 15)]

    return fp4_sector_repack


def fp4_sector_unpack_source(groups: int = 1, n_fastest: bool = False, warps: int = SECTOR_WARPS,
                             warp_sync: bool = False):
    """The inverse: Marlin uint32 [E, K/16, 2N] -> uint64 [E, N, K/16] (E2M1 bytes [E, N, K/2])."""
    stage_words = warps * 4 * groups * STAGE_ROW_4
    per_warp = 4 * groups * STAGE_ROW_4
    barrier = _stage_barrier(warp_sync)

    def fp4_sector_unpack(marlin, out, size_n):
        """Grid sector_grid(K, N, E, groups, n_fastest, warps), 32 * warps threads."""
        stage = cuda.shared.array(stage_words, dtype=uint32)
        if n_fastest:
            nt = cuda.blockIdx.x
            kb = cuda.blockIdx.y
        else:
            kb = cuda.blockIdx.x
            nt = cuda.blockIdx.y
        e = uint64(cuda.blockIdx.z)
        tid = cuda.threadIdx.x
        warp = tid >> 5
        lane = tid & 31
        col = lane >> 2
        j = lane & 3
        k_tiles = marlin.shape[1]
        kt_w = (kb * warps + warp) * (4 * groups)
        sbase = warp * per_warp
        obase = nt << 7
        for q in range(4 * groups):  # whole 128-byte lines of the warp's k-tile rows
            kt = kt_w + q
            if kt < k_tiles:
                for r in range(4):
                    p = 32 * r + lane
                    stage[sbase + q * STAGE_ROW_4 + STAGE_COL_4 * (p >> 4) + (p & 15)] = marlin[
                        e, uint64(kt), uint64(obase + p)]
        barrier()
        row0 = (nt << 6) + col
        for g in range(groups):
            kt = kt_w + 4 * g + j
            if kt < k_tiles:
                srow = sbase + (4 * g + j) * STAGE_ROW_4 + STAGE_COL_4 * col
                for sub in range(4):
                    a = uint32(0)
                    b = uint32(0)
                    c = uint32(0)
                    d = uint32(0)
                    for row2 in range(4):
                        w = stage[srow + 4 * row2 + sub]
                        sh = uint32(row2 << 3)
                        a = a | uint32(gptq_byte_from_marlin_4bit(w, 0) << sh)
                        b = b | uint32(gptq_byte_from_marlin_4bit(w, 1) << sh)
                        c = c | uint32(gptq_byte_from_marlin_4bit(w, 2) << sh)
                        d = d | uint32(gptq_byte_from_marlin_4bit(w, 3) << sh)
                    out[e, uint64(row0 + 16 * sub), uint64(kt)] = uint64(a) | (uint64(b) << uint64(32))
                    out[e, uint64(row0 + 16 * sub + 8), uint64(kt)] = uint64(c) | (uint64(d) << uint64(32))

    return fp4_sector_unpack


def fp8_sector_repack_source(groups: int = 1, n_fastest: bool = False, warps: int = SECTOR_WARPS,
                             warp_sync: bool = False):
    """src uint64 [E, N, K/8] (words (n, 2 kt + h): bytes 16 kt + 8 h .. + 7 of row n, i.e. GPTQ 8-bit words
    4 kt + 2 h and 4 kt + 2 h + 1 of column n) -> out uint32 [E, K/16, 4N] Marlin words."""
    held = 16 * groups
    stage_words = warps * 4 * groups * STAGE_ROW_8
    per_warp = 4 * groups * STAGE_ROW_8
    barrier = _stage_barrier(warp_sync)

    def fp8_sector_repack(src, out, size_n):
        """Grid sector_grid(K, N, E, groups, n_fastest, warps), 32 * warps threads."""
        stage = cuda.shared.array(stage_words, dtype=uint32)
        if n_fastest:
            nt = cuda.blockIdx.x
            kb = cuda.blockIdx.y
        else:
            kb = cuda.blockIdx.x
            nt = cuda.blockIdx.y
        e = uint64(cuda.blockIdx.z)
        tid = cuda.threadIdx.x
        warp = tid >> 5
        lane = tid & 31
        col = lane >> 2
        j = lane & 3
        k_tiles = out.shape[1]
        kt_w = (kb * warps + warp) * (4 * groups)
        row0 = (nt << 6) + col
        sbase = warp * per_warp
        words = cuda.local.array(held, dtype=uint64)
        for t in range(held):  # t = 16 g + 2 sub + h: row col + 8 sub, k-tile kt_w + 4 g + j, half h
            kt = kt_w + 4 * (t >> 4) + j
            if kt < k_tiles:
                words[t] = src[e, uint64(row0 + 8 * ((t >> 1) & 7)), uint64(2 * kt + (t & 1))]
        for g in range(groups):
            kt = kt_w + 4 * g + j
            if kt < k_tiles:
                srow = sbase + (4 * g + j) * STAGE_ROW_8 + STAGE_COL_8 * col
                for sub in range(8):  # column n = 8 sub + col of the n-tile
                    lo = words[16 * g + 2 * sub]
                    hi = words[16 * g + 2 * sub + 1]
                    r0 = uint32(lo & uint64(0xFFFFFFFF))
                    r1 = uint32(lo >> uint64(32))
                    r2 = uint32(hi & uint64(0xFFFFFFFF))
                    r3 = uint32(hi >> uint64(32))
                    # Marlin word 32 col + 8 row2 + sub from GPTQ words (row2 // 2, 2 + row2 // 2)
                    stage[srow + sub] = marlin_words_8bit(r0, r2, 0)
                    stage[srow + 8 + sub] = marlin_words_8bit(r0, r2, 1)
                    stage[srow + 16 + sub] = marlin_words_8bit(r1, r3, 2)
                    stage[srow + 24 + sub] = marlin_words_8bit(r1, r3, 3)
        barrier()
        obase = nt << 8
        for q in range(4 * groups):
            kt = kt_w + q
            if kt < k_tiles:
                for r in range(8):
                    out[e, uint64(kt), uint64(obase + 32 * r + lane)] = stage[sbase + q * STAGE_ROW_8 +
                                                                             STAGE_COL_8 * r + lane]

    return fp8_sector_repack


@functools.lru_cache(maxsize=None)
def _sector_kernel(name: str, groups: int, n_fastest: bool, warps: int, warp_sync: bool):
    sources = {"fp4_repack": fp4_sector_repack_source, "fp4_unpack": fp4_sector_unpack_source,
               "fp8_repack": fp8_sector_repack_source}
    return jit(sources[name](groups, n_fastest, warps, warp_sync))


def _sector_launch(name: str, launch, size_k: int, size_n: int, experts: int, stream):
    """kernel[grid, threads, stream] of the sector kernel ``name`` for WEIGHT_LAUNCH[name] or ``launch`` =
    (k-tile groups per warp, n-tiles fastest[, warps per block[, warp_sync]])."""
    shape = tuple(WEIGHT_LAUNCH[name] if launch is None else launch)
    groups, n_fastest, warps, warp_sync = shape + (SECTOR_WARPS, False)[len(shape) - 2:]
    kernel = _sector_kernel(name, int(groups), bool(n_fastest), int(warps), bool(warp_sync))
    return kernel[sector_grid(size_k, size_n, experts, int(groups), bool(n_fastest), int(warps)), 32 * int(warps),
                  stream]


# ---------------------------------------------------------------------------------------------------------------
# weights: the last, partial n-tile column of an N that is not a multiple of 64 (docs/formats.md, "Shapes that are
# not tile multiples"). K is always whole k-tiles here (a multiple of the format's group), so the sector kernels
# above run unchanged on the floor(N / 64) whole n-tiles and these kernels do the one column of tiles left, one
# Marlin (or checkpoint) word per thread through the tile map, every load predicated on N.
# ---------------------------------------------------------------------------------------------------------------
def edge_repack_source(bits: int):
    """Row-major codes as words, src uint32 [E, N, K * bits / 32] (FP4: 8 codes a word, MXFP8: 4 bytes; code k of
    row n in field k % pf of word k // pf) -> the words of n-tile ``nt`` of Marlin out uint32 [E, K/16, N_pad*16/pf],
    codes of rows n >= size_n written as 0."""
    pf = 32 // bits
    log_pf = 3 if bits == 4 else 2
    mask = (1 << bits) - 1
    wpt = TILE_K * TILE_N // pf

    def edge_repack(src, tile_perm, out, size_n, nt):
        """Grid-stride over E * K/16 * wpt words; tile_perm int32 [1024]: packed position w*pf + f of a tile -> its
        element dk*64 + dn (marlin_tile.tile_permutation)."""
        start = cuda.grid(1)
        stride = cuda.gridsize(1)
        per_expert = out.shape[1] * wpt
        for t in range(start, out.shape[0] * per_expert, stride):
            e = t // per_expert
            r = t - e * per_expert
            kt = r // wpt
            w = r - kt * wpt
            word = uint32(0)
            for f in range(pf):
                el = tile_perm[w * pf + f]
                k = kt * TILE_K + (el >> 6)
                n = nt * TILE_N + (el & 63)
                if n < size_n:  # the padding is zero codes, read from nowhere
                    code = uint32(src[e, n, k >> log_pf] >> uint32((k & (pf - 1)) * bits)) & uint32(mask)
                    word = word | uint32(code << uint32(f * bits))
            out[e, kt, nt * wpt + w] = word

    return edge_repack


def fp4_edge_unpack_source():
    """Marlin uint32 [E, K/16, 2 N_pad] -> rows n0 .. N-1 of the E2M1 words out uint32 [E, N, K/8] (the rows the
    sector kernel, run on the whole n-tiles, leaves)."""
    wpt = TILE_K * TILE_N // 8

    def fp4_edge_unpack(marlin, tile_inverse, out, n0):
        """Grid-stride over E * (N - n0) * K/8 words; tile_inverse int32 [1024]: element dk*64 + dn -> packed
        position of a tile."""
        start = cuda.grid(1)
        stride = cuda.gridsize(1)
        cols = out.shape[2]
        per_expert = (out.shape[1] - n0) * cols
        for t in range(start, out.shape[0] * per_expert, stride):
            e = t // per_expert
            i = t - e * per_expert
            r = i // cols
            c = i - r * cols
            n = n0 + r
            word = uint32(0)
            for f in range(8):
                k = 8 * c + f
                p = tile_inverse[((k & 15) << 6) + (n & 63)]
                mw = marlin[e, k >> 4, (n >> 6) * wpt + (p >> 3)]
                word = word | uint32(((mw >> uint32((p & 7) * 4)) & uint32(0xF)) << uint32(4 * f))
            out[e, n, c] = word

    return fp4_edge_unpack


# ---------------------------------------------------------------------------------------------------------------
# scales: the tile kernels (checkpoint [E, N, ng] <-> Marlin [E, ng, N]) and the process steps ([ng, N] in place)
# ---------------------------------------------------------------------------------------------------------------
@cuda.jit(device=True, inline=True)
def nvfp4_byte(raw, s, error, where_src, where_p):
    """One E4M3 scale byte -> its S0E5M3 byte; NaN, overflow and negative scales marked (error slots 0, 2, 4)."""
    magnitude = raw & 0x7F
    if magnitude == 0x7F:
        mark(error, 0, where_src)
        return uint8(0)
    if raw != magnitude and magnitude != 0:
        mark(error, 4, where_p)
    b = s0e5m3_of_e4m3(magnitude, s)
    if b > 0xFF:
        mark(error, 2, where_p)
        b = 0
    return uint8(b)


def scale_tile_source(kind: str):
    """kind "nvfp4" (E4M3 -> S0E5M3, scale factor 2^s) or "mx" (E8M0 codes moved, NaN code refused)."""
    nvfp4 = kind == "nvfp4"

    def marlin_scales_tile(src, out, ng, size_n, s, error):
        """src uint8 [E, N, ng]; out uint8 [E, ng, N_pad]; error uint64[6] (zeroed): (NaN, count, overflow, count,
        negative, count), NaN by its index in the source, the others by their pre-shuffle Marlin position, as the
        reference names them. Grid (ceil(ng / 32), N_pad / 64, E), SCALE_THREADS threads. Rows n >= size_n of the
        last tile are read from nowhere: staged as byte 0, which every format stores as 0 (E4M3 +0 -> S0E5M3 0;
        E8M0 code 0)."""
        stage = cuda.shared.array(SCALE_STAGE_BYTES, dtype=uint8)
        g0 = cuda.blockIdx.x * SCALE_TILE_G
        n0 = cuda.blockIdx.y * SCALE_TILE_N
        e = cuda.blockIdx.z
        tid = cuda.threadIdx.x
        gl = tid & 31
        width = out.shape[2]
        if g0 + gl < ng:  # a warp reads 32 consecutive groups of one row
            for i in range(8):
                nl = (tid >> 5) + 8 * i
                stage[gl * SCALE_STAGE_STRIDE + nl] = src[uint64(e), uint64(n0 + nl), uint64(g0 + gl)] if (
                    n0 + nl < size_n) else uint8(0)
        cuda.syncthreads()
        c = tid & 63
        nl = marlin_scale_column(c, ng > 1)
        per_expert = ng * width
        for i in range(8):  # a warp writes 32 consecutive bytes of one Marlin group row
            gr = (tid >> 6) + 4 * i
            g = g0 + gr
            if g < ng:
                raw = stage[gr * SCALE_STAGE_STRIDE + nl]
                if nvfp4:
                    value = nvfp4_byte(int64(raw), s, error, (e * size_n + n0 + nl) * ng + g,
                                       e * per_expert + g * width + n0 + shuffled(c))
                else:
                    value = raw
                    if raw == 0xFF:
                        mark(error, 0, (e * size_n + n0 + nl) * ng + g)
                out[uint64(e), uint64(g), uint64(n0 + c)] = value

    return marlin_scales_tile


def scale_untile_source(kind: str):
    nvfp4 = kind == "nvfp4"

    def marlin_scales_untile(raw, out, ng, size_n, s):
        """raw uint8 [E, ng, N_pad] Marlin bytes; out uint8 [E, N, ng] checkpoint bytes (E4M3 of S0E5M3 / 2^s, or the
        E8M0 code); the padded columns n >= size_n are not written. Grid (ceil(ng / 32), N_pad / 64, E),
        SCALE_THREADS threads."""
        stage = cuda.shared.array(SCALE_STAGE_BYTES, dtype=uint8)
        g0 = cuda.blockIdx.x * SCALE_TILE_G
        n0 = cuda.blockIdx.y * SCALE_TILE_N
        e = cuda.blockIdx.z
        tid = cuda.threadIdx.x
        c = tid & 63
        nl = marlin_scale_column(c, ng > 1)
        for i in range(8):
            gr = (tid >> 6) + 4 * i
            if g0 + gr < ng:
                b = raw[uint64(e), uint64(g0 + gr), uint64(n0 + c)]
                stage[gr * SCALE_STAGE_STRIDE + nl] = uint8(e4m3_of_s0e5m3(int64(b), s)) if nvfp4 else b
        cuda.syncthreads()
        gl = tid & 31
        if g0 + gl < ng:
            for i in range(8):
                row = (tid >> 5) + 8 * i
                if n0 + row < size_n:
                    out[uint64(e), uint64(n0 + row), uint64(g0 + gl)] = stage[gl * SCALE_STAGE_STRIDE + row]

    return marlin_scales_untile


def nvfp4_process_source():
    def nvfp4_process(src, out, s, error):
        """Permuted E4M3 bytes [1, ng * N] -> S0E5M3 bytes, shuffled; error as marlin_scales_tile's."""
        start = cuda.grid(1)
        stride = cuda.gridsize(1)
        for d in range(start, out.shape[1], stride):
            p = shuffled(d)
            out[0, d] = nvfp4_byte(int64(src[0, p]), s, error, p, p)

    return nvfp4_process


def mx_process_source():
    def mx_process(src, out, error):
        """Permuted E8M0 codes [1, ng * N] -> shuffled; error uint64[2] (zeroed): the lowest NaN code, count."""
        start = cuda.grid(1)
        stride = cuda.gridsize(1)
        for d in range(start, out.shape[1], stride):
            p = shuffled(d)
            code = src[0, p]
            if code == 0xFF:
                mark(error, 0, p)
            out[0, d] = code

    return mx_process


def smallest_scale_source():
    def smallest_scale(src, out):
        """src uint8 flat E4M3 bytes; out int64[1]: the smallest magnitude byte among non-zero, non-NaN positive
        scales (vLLM's minimum over positive scales), 0x7F when there is none."""
        start = cuda.grid(1)
        stride = cuda.gridsize(1)
        for i in range(start, src.size, stride):
            b = int64(src[i])
            if b != 0 and b < 0x7F:
                cuda.atomic.min(out, 0, b)

    return smallest_scale


@functools.lru_cache(maxsize=None)
def _kernel(name: str, *flags):
    sources = {"scale_tile": scale_tile_source, "scale_untile": scale_untile_source,
               "nvfp4_process": nvfp4_process_source, "mx_process": mx_process_source,
               "smallest_scale": smallest_scale_source, "edge_repack": edge_repack_source,
               "fp4_edge_unpack": fp4_edge_unpack_source}
    return jit(sources[name](*flags))


# ---------------------------------------------------------------------------------------------------------------
# host wrappers: check -> allocate -> launch (-> report)
# ---------------------------------------------------------------------------------------------------------------
def _bytes(arrays: Arrays, x, name: str, tail: tuple[int, ...]):
    """A uint8-like array [tail] or [E, tail] -> (device uint8 [E, tail], stacked?)."""
    if not is_device_array(x):
        x = np.asarray(x)
        require(x.dtype.itemsize == 1, f"{name} must hold bytes (uint8, float8), got {x.dtype}")
        x = x.view(np.uint8)
    d = arrays.take(x, name)
    require(np.dtype(d.dtype).itemsize == 1, f"{name} must hold bytes (uint8, float8), got {d.dtype}")
    d = d.view(np.uint8)
    shape = tuple(d.shape)
    if shape[-len(tail):] != tail or len(shape) not in (len(tail), len(tail) + 1):
        raise ValueError(f"{name} has shape {shape}, expected {tail} or (experts,) + {tail}")
    stacked = len(shape) == len(tail) + 1
    return d.reshape(((shape[0] if stacked else 1),) + tail), stacked


def _words(arrays: Arrays, x, name: str, rows: int, cols: int):
    d = arrays.take(x, name)
    require(np.dtype(d.dtype).itemsize == 4, f"{name} must hold int32 words, got {d.dtype}")
    d = d.view(np.uint32)
    shape = tuple(d.shape)
    if shape[-2:] != (rows, cols) or len(shape) not in (2, 3):
        raise ValueError(f"{name} has shape {shape}, expected ({rows}, {cols}) or (experts, {rows}, {cols})")
    stacked = len(shape) == 3
    return d.reshape(((shape[0] if stacked else 1), rows, cols)), stacked


def _give(arrays: Arrays, out, shape, stacked: bool, dtype=None):
    return arrays.give(out.reshape((out.shape[0],) + shape if stacked else shape), dtype)


def _aligned(arrays: Arrays, d, alignment: int = 8):
    """``d``, or an aligned copy of it when its address is not a multiple of ``alignment`` (the sector kernels
    read 8-byte words)."""
    ptr = getattr(d, "ptr", None)
    if ptr is None or ptr % alignment == 0:
        return d
    return arrays.copy(d)


def _tile_map(arrays: Arrays, bits: int, inverse: bool):
    perm = tile_permutation(bits)
    return arrays.take(np.ascontiguousarray(np.argsort(perm) if inverse else perm, dtype=np.int32), "tile_map")


def _weight_launches(name: str, launch, src, out, bits: int, size_k: int, size_n: int, stream, arrays: Arrays):
    """The sector kernel on the floor(N / 64) whole n-tiles (exactly the aligned launch when N is a multiple of 64),
    then the edge kernel on the last, partial one."""
    nt_full = size_n // TILE_N
    if nt_full:
        _sector_launch(name, launch, size_k, nt_full * TILE_N, src.shape[0], stream)(src, out, size_n)
    if size_n % TILE_N:
        words = src.view(np.uint32)  # [E, N, K * bits / 32]
        _kernel("edge_repack", bits)[_blocks(out.shape[0] * out.shape[1] * TILE_K * TILE_N * bits // 32), THREADS,
                                     stream](words, _tile_map(arrays, bits, False), out, size_n, nt_full)


def fp4_marlin_repack(weight_packed, size_k: int, size_n: int, *, stream=None, launch=None):
    """E2M1 bytes uint8 [N, K/2] (or [E, N, K/2]) -> Marlin int32 [K/16, 2 N_pad]. ``launch``: (k-tile groups per
    warp, n-tiles fastest[, warps per block[, warp_sync]]) instead of WEIGHT_LAUNCH (for timing other shapes)."""
    size_k, size_n = fm.check_weight_k_tiles(size_k, size_n)
    arrays = Arrays(stream)
    src, stacked = _bytes(arrays, weight_packed, "weight_packed", (size_n, size_k // 2))
    src = _aligned(arrays, src).view(np.uint64)  # [E, N, K/16]: one word a k-tile
    out = arrays.empty((src.shape[0], size_k // 16, 2 * padded_n(size_n)), np.uint32)
    _weight_launches("fp4_repack", launch, src, out, 4, size_k, size_n, arrays.stream, arrays)
    return _give(arrays, out, (size_k // 16, 2 * padded_n(size_n)), stacked, np.int32)


def marlin_to_fp4(marlin_q, size_k: int, size_n: int, *, stream=None, launch=None):
    """Inverse of fp4_marlin_repack: Marlin int32 [K/16, 2 N_pad] (or [E, ...]) -> E2M1 bytes uint8 [N, K/2]."""
    size_k, size_n = fm.check_weight_k_tiles(size_k, size_n)
    arrays = Arrays(stream)
    q, stacked = _words(arrays, marlin_q, "marlin_q", size_k // 16, 2 * padded_n(size_n))
    q = _aligned(arrays, q, 4)
    out = arrays.empty((q.shape[0], size_n, size_k // 16), np.uint64)
    nt_full = size_n // TILE_N
    if nt_full:
        _sector_launch("fp4_unpack", launch, size_k, nt_full * TILE_N, q.shape[0], arrays.stream)(q, out, size_n)
    if size_n % TILE_N:
        words = out.view(np.uint32)  # [E, N, K/8]
        rows = size_n - nt_full * TILE_N
        _kernel("fp4_edge_unpack")[_blocks(q.shape[0] * rows * (size_k // 8)), THREADS, arrays.stream](
            q, _tile_map(arrays, 4, True), words, nt_full * TILE_N)
    return _give(arrays, out.view(np.uint8), (size_n, size_k // 2), stacked)


def mxfp8_marlin_repack(weight, size_k: int, size_n: int, *, stream=None, launch=None):
    """MXFP8 E4M3 bytes uint8 [N, K] (or [E, N, K]) -> Marlin W8 int32 [K/16, 4 N_pad], transpose fused (the bytes
    of ``marlin_repack.block_fp8_group128_repack``, through the sector kernel)."""
    size_k, size_n = fm.check_weight_k_tiles(size_k, size_n)
    arrays = Arrays(stream)
    src, stacked = _bytes(arrays, weight, "weight", (size_n, size_k))
    src = _aligned(arrays, src).view(np.uint64)  # [E, N, K/8]: two words a k-tile
    out = arrays.empty((src.shape[0], size_k // 16, 4 * padded_n(size_n)), np.uint32)
    _weight_launches("fp8_repack", launch, src, out, 8, size_k, size_n, arrays.stream, arrays)
    return _give(arrays, out, (size_k // 16, 4 * padded_n(size_n)), stacked, np.int32)


def _scale_grid(ng: int, size_n: int, experts: int) -> tuple[int, int, int]:
    return (-(-ng // SCALE_TILE_G), padded_n(size_n) // SCALE_TILE_N, experts)


def _marks(host) -> list:
    """The error slots read back -> [(lowest index or None, count), ...]."""
    return [(None if int(host[i]) == 0 else MARK_BASE - int(host[i]), int(host[i + 1]))
            for i in range(0, len(host), 2)]


def _log2(scale_factor: float) -> int:
    sf = fm._check_scale_factor(scale_factor)
    return int(np.frexp(sf)[1] - 1)


def _value_at(d, flat: int) -> int:
    return int(copy_to_host_checked(d.reshape((d.size,))[flat:flat + 1], cuda.default_stream())[0])


def _report_nvfp4(arrays: Arrays, error, src, sf: float, stacked: bool, shape: tuple[int, ...], name: str,
                  marlin_shape: tuple[int, int], gather: bool) -> None:
    """Raise or warn what the NVFP4 scale kernel marked, with the reference's messages."""
    (nan, nans), (big, bigs), (neg, negs) = _marks(copy_to_host_checked(error, arrays.stream))
    lead = (src.shape[0],) if stacked else ()

    def at(flat: int, dims: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(int(i) for i in np.unravel_index(flat, lead + dims))

    def value(p_flat: int) -> float:  # the scale behind pre-shuffle Marlin position p (of all experts)
        e, p = divmod(p_flat, marlin_shape[0] * marlin_shape[1])
        if gather:  # Marlin rows are N_pad wide, the source's [N, ng] (a padded position is never marked)
            ng, width = marlin_shape
            perm = SCALE_PERM_64 if ng > 1 else SCALE_PERM_32
            lane = p % perm.size
            g, n = divmod(p - lane + int(perm[lane]), width)
            p_flat = (e * shape[0] + n) * ng + g
        return float(np.array([_value_at(src, p_flat)], np.uint8).view(ms.E4M3).astype(np.float32)[0])

    if nan is not None:
        raise ValueError(f"{name}[{ms._where(at(nan, shape))}] = {_value_at(src, nan):#04x} is "
                         f"E4M3's NaN ({nans} such)")
    if big is not None:
        v = value(big)
        raise ValueError(f"marlin_scales[{ms._where(at(big, marlin_shape))}] = {v!r}: · scale_factor {sf:g}"
                         f" · 2^7 = {abs(v) * sf * 2.0 ** fm.S0E5M3_SHIFT:g} exceeds fp16's {fm.FP16_MAX:g}"
                         f" ({bigs} such); the S0E5M3 byte cannot hold it (a bf16 layer whose scales span"
                         " more than fp16's range after vLLM's rescale)")
    if neg is not None:
        warnings.warn(f"marlin_scales[{ms._where(at(neg, marlin_shape))}] = {value(neg)!r} is "
                      f"negative ({negs} such): the S0E5M3 byte has no sign bit, so the kernel will use its "
                      "magnitude and those groups dequantize with the wrong sign", RuntimeWarning, stacklevel=3)


def _scale_factor_on_device(arrays: Arrays, src, a_dtype) -> float:
    if np.dtype(a_dtype) == ms.F16:
        return 1.0
    out = arrays.take(np.array([0x7F], np.int64), "smallest")
    flat = src.reshape((src.size,))
    _kernel("smallest_scale")[_blocks(src.size), THREADS, arrays.stream](flat, out)
    smallest = int(copy_to_host_checked(out, arrays.stream)[0])
    return 1.0 if smallest == 0x7F else fm.nvfp4_scale_factor(np.array([[smallest]], np.uint8), a_dtype)


def nvfp4_marlin_scales(weight_scale, size_k: int, size_n: int, a_dtype=np.float16, scale_factor=None, *,
                        stream=None):
    """Checkpoint E4M3 scales [N, K/16] (or [E, N, K/16]) -> (S0E5M3 bytes uint8 [K/16, N_pad], scale_factor): one
    launch (plus the smallest-scale reduction when bf16 needs a computed scale factor), one read-back."""
    size_k, size_n = fm.check_microscale_sizes(size_k, size_n, "nvfp4")
    ng, width = size_k // 16, padded_n(size_n)
    arrays = Arrays(stream)
    src, stacked = _bytes(arrays, weight_scale, "weight_scale", (size_n, ng))
    sf = _scale_factor_on_device(arrays, src, a_dtype) if scale_factor is None else fm._check_scale_factor(
        scale_factor)
    out = arrays.empty((src.shape[0], ng, width), np.uint8)
    error = arrays.zeros((6,), np.uint64)
    _kernel("scale_tile", "nvfp4")[_scale_grid(ng, size_n, src.shape[0]), SCALE_THREADS, arrays.stream](
        src, out, ng, size_n, _log2(sf), error)
    _report_nvfp4(arrays, error, src, sf, stacked, (size_n, ng), "weight_scale", (ng, width), True)
    return _give(arrays, out, (ng, width), stacked), sf


def nvfp4_marlin_process_scales(marlin_scales, scale_factor=None, a_dtype=None, *, stream=None):
    """Permuted NVFP4 scales [ng, N] -> (S0E5M3 bytes, scale_factor). Device input: E4M3 bytes; host input may be
    any float dtype holding E4M3 values (checked and turned into bytes on the host first)."""
    if not is_device_array(marlin_scales):
        marlin_scales = ms.float_to_e4m3(fm.e4m3_exact_values(marlin_scales, "marlin_scales")) if np.asarray(
            marlin_scales).dtype not in (np.dtype(np.uint8), ms.E4M3) else np.asarray(marlin_scales)
    elif np.dtype(marlin_scales.dtype).itemsize != 1:
        raise TypeError(f"marlin_scales on the device must be E4M3 bytes (uint8), got {marlin_scales.dtype}")
    a_dtype = ms.F16 if a_dtype is None else np.dtype(a_dtype)
    arrays = Arrays(stream)
    shape = tuple(marlin_scales.shape)
    require(len(shape) == 2, f"marlin_scales must be 2-D, got shape {shape}")
    src, _ = _bytes(arrays, marlin_scales, "marlin_scales", shape)
    src = src.reshape((1, shape[0] * shape[1]))
    sf = _scale_factor_on_device(arrays, src, a_dtype) if scale_factor is None else fm._check_scale_factor(
        scale_factor)
    out = arrays.empty((1, shape[0] * shape[1]), np.uint8)
    error = arrays.zeros((6,), np.uint64)
    _kernel("nvfp4_process")[_blocks(out.size), THREADS, arrays.stream](src, out, _log2(sf), error)
    _report_nvfp4(arrays, error, src, sf, False, shape, "marlin_scales", shape, False)
    return arrays.give(out.reshape(shape)), sf


def marlin_to_nvfp4_scales(marlin_scales, size_k: int, size_n: int, scale_factor: float = 1.0, *, stream=None):
    """Inverse of nvfp4_marlin_scales: S0E5M3 bytes [K/16, N_pad] (or [E, ...]) -> E4M3 bytes uint8 [N, K/16]."""
    size_k, size_n = fm.check_microscale_sizes(size_k, size_n, "nvfp4")
    ng = size_k // 16
    arrays = Arrays(stream)
    raw, stacked = _bytes(arrays, marlin_scales, "marlin_scales", (ng, padded_n(size_n)))
    out = arrays.empty((raw.shape[0], size_n, ng), np.uint8)
    _kernel("scale_untile", "nvfp4")[_scale_grid(ng, size_n, raw.shape[0]), SCALE_THREADS, arrays.stream](
        raw, out, ng, size_n, _log2(scale_factor))
    return _give(arrays, out, (size_n, ng), stacked)


def _report_nan_code(arrays: Arrays, error, stacked: bool, experts: int, shape, name: str) -> None:
    ((where, count),) = _marks(copy_to_host_checked(error, arrays.stream))
    if where is not None:
        at = tuple(int(i) for i in np.unravel_index(where, ((experts,) if stacked else ()) + shape))
        raise ValueError(f"{name}[{ms._where(at)}] = 0xFF is E8M0's NaN code, not a scale ({count} such "
                         "code(s)); a group with a NaN scale has no value")


def mx_marlin_scales(weight_scale, size_k: int, size_n: int, fmt: str = "mxfp4", *, stream=None):
    """Checkpoint E8M0 codes [N, K/32] (or [E, ...]) -> Marlin E8M0 codes uint8 [K/32, N_pad]: one launch, one
    read-back."""
    size_k, size_n = fm.check_microscale_sizes(size_k, size_n, fmt)
    ng, width = size_k // ms.microscale_format(fmt).group_size, padded_n(size_n)
    arrays = Arrays(stream)
    src, stacked = _bytes(arrays, weight_scale, "weight_scale", (size_n, ng))
    out = arrays.empty((src.shape[0], ng, width), np.uint8)
    error = arrays.zeros((2,), np.uint64)
    _kernel("scale_tile", "mx")[_scale_grid(ng, size_n, src.shape[0]), SCALE_THREADS, arrays.stream](
        src, out, ng, size_n, 0, error)
    _report_nan_code(arrays, error, stacked, src.shape[0], (size_n, ng), "weight_scale")
    return _give(arrays, out, (ng, width), stacked)


def mx_marlin_process_scales(marlin_scales, *, stream=None):
    """Permuted MX scales [ng, N] -> shuffled E8M0 codes. Device input: codes (uint8); host input may be bf16 or
    float32 powers of two (turned into codes on the host first)."""
    if not is_device_array(marlin_scales):
        marlin_scales = fm.e8m0_codes_of(np.asarray(marlin_scales), "marlin_scales") if np.asarray(
            marlin_scales).dtype not in (np.dtype(np.uint8), ms.E8M0) else np.asarray(marlin_scales)
    arrays = Arrays(stream)
    shape = tuple(marlin_scales.shape)
    require(len(shape) == 2, f"marlin_scales must be 2-D, got shape {shape}")
    src, _ = _bytes(arrays, marlin_scales, "marlin_scales", shape)
    src = src.reshape((1, shape[0] * shape[1]))
    out = arrays.empty((1, shape[0] * shape[1]), np.uint8)
    error = arrays.zeros((2,), np.uint64)
    _kernel("mx_process")[_blocks(out.size), THREADS, arrays.stream](src, out, error)
    _report_nan_code(arrays, error, False, 1, shape, "marlin_scales")
    return arrays.give(out.reshape(shape))


def marlin_to_mx_scales(marlin_scales, size_k: int, size_n: int, fmt: str = "mxfp4", *, stream=None):
    """Inverse of mx_marlin_scales: Marlin codes [K/32, N_pad] (or [E, ...]) -> checkpoint codes uint8 [N, K/32]."""
    size_k, size_n = fm.check_microscale_sizes(size_k, size_n, fmt)
    ng = size_k // ms.microscale_format(fmt).group_size
    arrays = Arrays(stream)
    raw, stacked = _bytes(arrays, marlin_scales, "marlin_scales", (ng, padded_n(size_n)))
    out = arrays.empty((raw.shape[0], size_n, ng), np.uint8)
    _kernel("scale_untile", "mx")[_scale_grid(ng, size_n, raw.shape[0]), SCALE_THREADS, arrays.stream](
        raw, out, ng, size_n, 0)
    return _give(arrays, out, (size_n, ng), stacked)


def compile_targets():
    """(name, python function, argument types) of every kernel variant here, for the offline compile check."""
    from numba import types

    def arr(dt, nd):
        return types.Array(dt, nd, "C")

    u8, u32, u64, i64 = types.uint8, types.uint32, types.uint64, types.int64
    shapes = sorted({(1, False, 4, False), (2, False, 4, False), (1, True, 4, False), (2, True, 4, False),
                     (1, False, 8, False), (1, False, 4, True)} | set(WEIGHT_LAUNCH.values()))
    for groups, n_fastest, warps, warp_sync in shapes:
        tag = f"groups={groups},n_fastest={n_fastest},warps={warps},warp_sync={warp_sync}"
        for name, source, types_in, types_out in (("fp4_sector_repack", fp4_sector_repack_source, u64, u32),
                                                   ("fp4_sector_unpack", fp4_sector_unpack_source, u32, u64),
                                                   ("fp8_sector_repack", fp8_sector_repack_source, u64, u32)):
            yield (f"{name}[{tag}]", source(groups, n_fastest, warps, warp_sync),
                   (arr(types_in, 3), arr(types_out, 3), i64))
    for kind in ("nvfp4", "mx"):
        yield (f"scale_tile[{kind}]", scale_tile_source(kind),
               (arr(u8, 3), arr(u8, 3), i64, i64, i64, arr(u64, 1)))
        yield f"scale_untile[{kind}]", scale_untile_source(kind), (arr(u8, 3), arr(u8, 3), i64, i64, i64)
    yield "nvfp4_process", nvfp4_process_source(), (arr(u8, 2), arr(u8, 2), i64, arr(u64, 1))
    yield "mx_process", mx_process_source(), (arr(u8, 2), arr(u8, 2), arr(u64, 1))
    yield "smallest_scale", smallest_scale_source(), (arr(u8, 1), arr(i64, 1))
    for bits in (4, 8):
        yield (f"edge_repack[{bits}-bit]", edge_repack_source(bits),
               (arr(u32, 3), arr(types.int32, 1), arr(u32, 3), i64, i64))
    yield "fp4_edge_unpack", fp4_edge_unpack_source(), (arr(u32, 3), arr(types.int32, 1), arr(u32, 3), i64)
