"""Weight repacks into and out of the Marlin tile layout (docs/formats.md, "The Marlin tile", docs/formats.md, "FP8
E4M3 weight-only"), as Numba-CUDA kernels.

What it computes (the NumPy references are ``workbench.formats.marlin_tile.marlin_repack_codes`` and friends):
the K×N code matrix is cut into 16×64 tiles, k-tile-major; each tile becomes ``wpt`` consecutive words (128 for
4-bit, 256 for 8-bit) whose fields follow the closed form of docs/formats.md, "Closed form and the 1024-entry
permutation". Four checkpoint layouts feed it:

    GPTQ qweight   [K/pf, N]  word (r, n), field f = code(r*pf + f, n)           (optionally rows gathered by perm)
    AWQ qweight    [K, N/pf]  word (k, c), field AWQ_ORDER⁻¹ = code(k, c*pf + i)
    FP8 raw bits   [K/4, N]   = GPTQ 8-bit with the E4M3 bytes as codes
    block FP8      [N, K]     row-major bytes (transpose fused: 4 consecutive k of row n = one little-endian word)

Kernel shapes:

* **direct** (GPTQ rows, FP8 raw bits, and their inverses): one thread reads the 4 source words that hold
  everything for 4 output words (see "Direct kernels" below) and writes them; no shared memory, no barrier.
  Every input word is read once and every output word written once. Variants with the same thread layout:
  act-order (the thread gathers its 16 rows through perm, one field per load) and AWQ (8 AWQ words in, 8 Marlin
  words out, and back).
* **transpose tile** (row-major FP8 [N, K] and back): 64 rows × 128 bytes through shared memory with whole-row
  accesses, then the direct 8-bit pack; the inverse stages whole Marlin tiles first.
* **two-pass act-order** on one matrix (GPTQ rows -> N-packed rows through a shared tile, then the direct AWQ
  kernel in natural field order reading rows through perm); Marlin -> AWQ and Marlin -> GPTQ 8-bit write 8-byte
  words (two adjacent packed words per store). The launch shapes and routes are ``workbench.policy.RepackPolicy``
  (every wrapper takes ``policy=``).

Every kernel takes a leading expert axis (E, ...) so a stack of experts is one launch (grid z = expert).

Shapes that are not tile multiples (docs/formats.md, "Shapes that are not tile multiples"): the Marlin array is
that of the weight zero-padded to K_pad x N_pad. The kernels above run on the whole tiles inside (K, N) unchanged;
the edge kernels (``edge_repack_kernel_source``, ``edge_unpack_kernel_source``) do the rest — the tiles of the last
k-tile row and n-tile column in the forward direction (every code past K or N written as 0, nothing read there),
and the checkpoint words those tiles hold in the inverse — one word per thread through the tile map, every load
predicated on the true sizes. The extra work is at most one tile row and one tile column.

A perm is data the kernels index with, so no value in it may reach memory unchecked: every row read through a perm
goes through ``perm_row`` (a row outside [0, K) reads row 0), and the wrappers refuse a perm that is not a
permutation before they return — a host perm on the host, a device perm with ``check_perm_kernel_source`` on the
device (nothing K-sized is copied back; the host reads a 32-byte verdict).
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np
from numba import cuda, int32, uint32, uint64

from kernels_numba._launch import Arrays, copy_to_host_checked, is_device_array, jit
from workbench.formats._checks import (check_bits, check_permutation_values, check_weight_sizes, padded_k, padded_n,
                                       permutation_message, require_native_byte_order, require_pack_multiple)
from workbench.formats.fp8 import E4M3
from workbench.formats.marlin_tile import tile_permutation
from workbench.policy import DEFAULT_REPACK_POLICY, REPACK_GLOBALS, RepackPolicy, install_deprecated_globals

_policy = DEFAULT_REPACK_POLICY  # what calls without policy= use (the old module switches write it, deprecated)

# ---------------------------------------------------------------------------------------------------------------
# Constants
# ---------------------------------------------------------------------------------------------------------------
TILE_K = 16  # rows of a Marlin tile (the k extent of mma.m16n8k16)
TILE_N = 64  # columns of a Marlin tile (four 16-wide sub-blocks)
THREADS = 256  # 8 warps: enough to cover load latency with 8 independent loads each



def _consts(bits: int):
    pf = 32 // bits
    return dict(
        pf=pf,
        log_pf=3 if bits == 4 else 2,
        rows=TILE_K // pf,  # GPTQ-form rows per k-tile
        mask=(1 << bits) - 1,
        wpt=TILE_K * TILE_N // pf,  # Marlin words per tile
        wpt_shift=7 if bits == 4 else 8,
    )


# ---------------------------------------------------------------------------------------------------------------
# Device helpers: a row read through a permutation
# ---------------------------------------------------------------------------------------------------------------
@cuda.jit(device=True, inline=True)
def perm_row(perm, e, k):
    """Row perm[e, k], or row 0 when it lies outside [0, K): whatever a permutation holds, no kernel reads out of
    bounds through it. (The wrappers check perms before they return a result, check_perm_kernel_source: a row 0
    here only ever lands in an output that is then refused.)"""
    v = perm[e, k]
    if v >= 0 and v < perm.shape[1]:
        return int32(v)
    return int32(0)


# ---------------------------------------------------------------------------------------------------------------
# Direct kernels (no shared memory): GPTQ rows / FP8 raw bits / row-major FP8 bytes <-> Marlin
# ---------------------------------------------------------------------------------------------------------------
# One thread owns the pieces of one tile that belong together: 4-bit, lane (col, warp) reads the 4 GPTQ words
# A, B (rows 0-7 / 8-15 of column n = 16*warp + col) and C, D (column n + 8) and writes the 4 Marlin words
# 16*col + 4*row2 + warp, row2 = 0..3, which are exactly the byte pairs of those 4 words. 8-bit, lane (col, warp,
# half) reads the 4 words of column n = 16*warp + col + 8*half (rows 4r..4r+3, r = 0..3) and writes words
# 32*col + 8*row2 + 2*warp + half. Every input word is read once, by one thread, and every output word written once:
# no staging, no barrier, 4 independent loads in flight per thread.
DIRECT_THREADS = 128  # 4 tiles (4-bit, 32 lanes each) or 2 tiles (8-bit, 64 lanes each) per block
# k-tiles a thread loads before its first store (more loads in flight per thread is what 4-bit lacks): the policy's
# direct_k_tiles_per_thread and, for the inverse, direct_unpack_k_tiles_per_thread; the share of copy bandwidth
# each count reached is in docs/performance.md, "Repack kernels".


@cuda.jit(device=True, inline=True)
def marlin_words_4bit(a, b, c, d, row2):
    """Marlin 4-bit word ``16*col + 4*row2 + warp`` from the GPTQ words a, b (column n, rows 0-7 / 8-15 of the
    k-tile) and c, d (column n + 8): field order (dk, dn) = (0,0) (8,0) (0,8) (8,8) (1,0) (9,0) (1,8) (9,8)."""
    shift = uint32(row2 << 3)
    pa = uint32(a >> shift) & uint32(0xFF)
    pb = uint32(b >> shift) & uint32(0xFF)
    pc = uint32(c >> shift) & uint32(0xFF)
    pd = uint32(d >> shift) & uint32(0xFF)
    low = (pa & uint32(0xF)) | ((pb & uint32(0xF)) << uint32(4)) | ((pc & uint32(0xF)) << uint32(8)) | (
        (pd & uint32(0xF)) << uint32(12))
    high = (pa >> uint32(4)) | ((pb >> uint32(4)) << uint32(4)) | ((pc >> uint32(4)) << uint32(8)) | (
        (pd >> uint32(4)) << uint32(12))
    return uint32(low | uint32(high << uint32(16)))


@cuda.jit(device=True, inline=True)
def marlin_words_8bit(p, q, row2):
    """Marlin 8-bit word ``32*col + 8*row2 + 2*warp + half``: rows k0, k0+8, k0+1, k0+9 (k0 = 2*row2) of column n,
    from p = GPTQ word of rows 4*(row2//2).. (holds k0, k0+1) and q = the word 8 rows further (k0+8, k0+9)."""
    s = uint32((row2 & 1) << 4)
    return uint32(
        (uint32(p >> s) & uint32(0xFF))
        | ((uint32(q >> s) & uint32(0xFF)) << uint32(8))
        | ((uint32(p >> uint32(s + uint32(8))) & uint32(0xFF)) << uint32(16))
        | ((uint32(q >> uint32(s + uint32(8))) & uint32(0xFF)) << uint32(24))
    )


@cuda.jit(device=True, inline=True)
def gptq_byte_from_marlin_4bit(w, which):
    """Inverse of marlin_words_4bit: byte ``row2`` of GPTQ word a/b/c/d (which = 0..3) from Marlin word w."""
    return (uint32(w >> uint32(which << 2)) & uint32(0xF)) | (
        (uint32(w >> uint32(16 + (which << 2))) & uint32(0xF)) << uint32(4))


@cuda.jit(device=True, inline=True)
def gptq_half_from_marlin_8bit(w, from_q):
    """Inverse of marlin_words_8bit: the 2 bytes (16 bits) that word w took from p (from_q = 0) or q (1)."""
    sh = uint32(from_q << 3)
    return (uint32(w >> sh) & uint32(0xFF)) | ((uint32(w >> uint32(sh + uint32(16))) & uint32(0xFF)) << uint32(8))


@cuda.jit(device=True, inline=True)
def gptq_word_from_marlin_8bit(mw, i, r):
    """GPTQ-form word r (rows 4r..4r+3) of one column from the column's 4 Marlin words mw[i..i+3] (row2 = 0..3):
    marlin_words_8bit backwards (words row2 = 0, 1 hold rows 0-1 / 8-9 and 2-3 / 10-11, i.e. words r = 0 and 2)."""
    a = mw[i + 2 * (r & 1)]
    b = mw[i + 2 * (r & 1) + 1]
    return gptq_half_from_marlin_8bit(a, r >> 1) | uint32(gptq_half_from_marlin_8bit(b, r >> 1) << uint32(16))


def direct_layout(bits: int, threads: int):
    """(four_bit, lanes_per_tile, tiles_per_block, lane_shift, wpt) of the direct kernels' thread layout: 32 (4-bit)
    or 64 (8-bit) lanes per n-tile, ``threads // lanes`` n-tiles per block, wpt Marlin words per tile."""
    four_bit = bits == 4
    lanes_per_tile = 32 if four_bit else 64
    return four_bit, lanes_per_tile, threads // lanes_per_tile, 5 if four_bit else 6, 128 if four_bit else 256


@cuda.jit(device=True, inline=True)
def tile_and_lane(n_block, tiles_per_block, lane_shift):
    """(nt, lane): the n-tile of this thread (block n_block holds tiles_per_block n-tiles, 2**lane_shift lanes
    each) and its lane in that tile."""
    tid = cuda.threadIdx.x
    return n_block * tiles_per_block + (tid >> lane_shift), tid & ((1 << lane_shift) - 1)


@cuda.jit(device=True, inline=True)
def direct_thread_column(nt, lane, four_bit):
    """(col, sub, n): the direct kernels' thread layout for ``lane`` of n-tile ``nt``. 4-bit: col = lane & 7, sub =
    warp = lane >> 3, n = 64*nt + 16*warp + col (the thread also owns column n + 8); 8-bit: col = lane >> 3, sub =
    slot = lane & 7 = 2*warp + half (lanes (warp, half) fastest: each col's 8 output words are consecutive),
    n = 64*nt + 16*warp + 8*half + col."""
    if four_bit:
        col = lane & 7
        sub = lane >> 3
        return col, sub, (nt << 6) + (sub << 4) + col
    col = lane >> 3
    sub = lane & 7
    return col, sub, (nt << 6) + ((sub >> 1) << 4) + col + ((sub & 1) << 3)


@cuda.jit(device=True, inline=True)
def store_direct_marlin_words(out, e, kt, base, col, sub, words, i, four_bit):
    """The 4 Marlin words of k-tile kt that the thread (col, sub) of the direct layout owns, built from its 4
    GPTQ-form words words[i .. i+3] (4-bit: a, b, c, d; 8-bit: rows 4r .. 4r+3, r = 0..3); ``base`` = first word of
    the n-tile in row kt."""
    if four_bit:
        for row2 in range(4):
            out[e, kt, base + (col << 4) + (row2 << 2) + sub] = marlin_words_4bit(
                words[i], words[i + 1], words[i + 2], words[i + 3], row2)
    else:
        o = base + (col << 5) + sub
        for row2 in range(4):
            out[e, kt, o + (row2 << 3)] = marlin_words_8bit(words[i + (row2 >> 1)], words[i + 2 + (row2 >> 1)], row2)


def direct_kernel_body(load_k_tile, bits: int, threads: int, ktpt: int):
    """The device body shared by the direct repack and the one-pass act-order gather: the direct layout's thread
    set-up, then ``load_k_tile(src, perm, e, kt, n, words, i)`` for each of the thread's ``ktpt`` k-tiles inside K
    (it puts the k-tile's 4 GPTQ-form words of column n — 4-bit: a, b, c, d; 8-bit: rows 4r..4r+3 — at
    words[i .. i+3]), all before the first store, then the Marlin words of each k-tile. Called as
    ``body(src, perm, out, size_n)`` on grid (ceil(K/16 / ktpt), ceil(N/64 / tiles_per_block), E)."""
    four_bit, _, tiles_per_block, lane_shift, wpt = direct_layout(bits, threads)
    held = 4 * ktpt  # source words a thread holds between its loads and its stores (registers after unrolling)

    @cuda.jit(device=True, inline=True)
    def body(src, perm, out, size_n):
        e = cuda.blockIdx.z
        nt, lane = tile_and_lane(cuda.blockIdx.y, tiles_per_block, lane_shift)
        k_tiles = out.shape[1]
        if nt < (size_n >> 6):
            base = nt * wpt
            words = cuda.local.array(held, dtype=uint32)
            col, sub, n = direct_thread_column(nt, lane, four_bit)
            # loads of all this thread's k-tiles first ...
            for j in range(ktpt):
                kt = cuda.blockIdx.x * ktpt + j
                if kt < k_tiles:
                    load_k_tile(src, perm, e, kt, n, words, 4 * j)
            # ... then the stores
            for j in range(ktpt):
                kt = cuda.blockIdx.x * ktpt + j
                if kt < k_tiles:
                    store_direct_marlin_words(out, e, kt, base, col, sub, words, 4 * j, four_bit)

    return body


def direct_repack_kernel_source(bits: int, source: str, k_tiles_per_thread: int | None = None,
                                threads: int = DIRECT_THREADS):
    """source "gptq" (words [E, K/pf, N]) or "row_major_bytes" (8-bit; words [E, N, K/4]) -> Marlin [E, K/16, .].

    ``k_tiles_per_thread`` (default: the policy's direct_k_tiles_per_thread) makes each thread issue the loads of that many
    k-tiles before its first store (memory parallelism per thread); it and ``threads`` let other launch shapes be
    timed against the policy's.
    """
    if source not in ("gptq", "row_major_bytes") or (source == "row_major_bytes" and bits != 8):
        raise ValueError(f"direct repack has no {bits}-bit source {source!r}")
    four_bit = bits == 4
    row_major = source == "row_major_bytes"
    ktpt = k_tiles_per_thread or _policy.per_bits("direct_k_tiles_per_thread", bits)

    @cuda.jit(device=True, inline=True)
    def load_k_tile(src, perm, e, kt, n, words, i):
        if four_bit:
            words[i] = src[e, 2 * kt, n]  # a: rows 0-7 of column n
            words[i + 1] = src[e, 2 * kt + 1, n]  # b: rows 8-15
            words[i + 2] = src[e, 2 * kt, n + 8]  # c: column n + 8
            words[i + 3] = src[e, 2 * kt + 1, n + 8]  # d
        elif row_major:  # the 16 bytes of row n for this k-tile: 4 consecutive words
            for r in range(4):
                words[i + r] = src[e, n, 4 * kt + r]
        else:
            for r in range(4):
                words[i + r] = src[e, 4 * kt + r, n]

    body = direct_kernel_body(load_k_tile, bits, threads, ktpt)

    def repack_direct(src, out, size_n):
        """Grid (ceil(K/16 / ktpt), ceil(N/64 / tiles_per_block), E), ``threads`` threads."""
        body(src, src, out, size_n)  # (the direct load reads no perm)

    return repack_direct


def direct_unpack_kernel_source(bits: int, target: str, k_tiles_per_thread: int | None = None):
    """Marlin [E, K/16, .] -> target "gptq" (words [E, K/pf, N]) or "row_major_bytes" (8-bit; words [E, N, K/4]).

    ``k_tiles_per_thread`` (default: the policy's direct_unpack_k_tiles_per_thread): the Marlin words of that many k-tiles
    are loaded before the first store, as in the forward kernel.
    """
    if target not in ("gptq", "row_major_bytes") or (target == "row_major_bytes" and bits != 8):
        raise ValueError(f"direct unpack has no {bits}-bit target {target!r}")
    four_bit, _, tiles_per_block, lane_shift, wpt = direct_layout(bits, DIRECT_THREADS)
    row_major = target == "row_major_bytes"
    ktpt = k_tiles_per_thread or _policy.per_bits("direct_unpack_k_tiles_per_thread", bits)
    held = 4 * ktpt

    def unpack_direct(marlin, out, size_n):
        """Grid (ceil(K/16 / ktpt), ceil(N/64 / tiles_per_block), E), DIRECT_THREADS threads."""
        e = cuda.blockIdx.z
        nt, lane = tile_and_lane(cuda.blockIdx.y, tiles_per_block, lane_shift)
        k_tiles = marlin.shape[1]
        if nt < (size_n >> 6):
            base = nt * wpt
            mw = cuda.local.array(held, dtype=uint32)
            col, sub, n = direct_thread_column(nt, lane, four_bit)
            # the thread's Marlin words: 16*col + 4*row2 + warp (4-bit) / 32*col + 8*row2 + slot (8-bit), row2 = 0..3
            o = base + (col << (4 if four_bit else 5)) + sub
            step = 4 if four_bit else 8
            for j in range(ktpt):
                kt = cuda.blockIdx.x * ktpt + j
                if kt < k_tiles:
                    for row2 in range(4):
                        mw[4 * j + row2] = marlin[e, kt, o + step * row2]
            for j in range(ktpt):
                kt = cuda.blockIdx.x * ktpt + j
                if kt < k_tiles:
                    if four_bit:
                        a = uint32(0)
                        b = uint32(0)
                        c = uint32(0)
                        d = uint32(0)
                        for row2 in range(4):
                            w = mw[4 * j + row2]
                            sh = uint32(row2 << 3)
                            a = a | uint32(gptq_byte_from_marlin_4bit(w, 0) << sh)
                            b = b | uint32(gptq_byte_from_marlin_4bit(w, 1) << sh)
                            c = c | uint32(gptq_byte_from_marlin_4bit(w, 2) << sh)
                            d = d | uint32(gptq_byte_from_marlin_4bit(w, 3) << sh)
                        out[e, 2 * kt, n] = a
                        out[e, 2 * kt + 1, n] = b
                        out[e, 2 * kt, n + 8] = c
                        out[e, 2 * kt + 1, n + 8] = d
                    else:
                        w0 = mw[4 * j]
                        w1 = mw[4 * j + 1]
                        w2 = mw[4 * j + 2]
                        w3 = mw[4 * j + 3]
                        hi = uint32(16)
                        p0 = gptq_half_from_marlin_8bit(w0, 0) | uint32(gptq_half_from_marlin_8bit(w1, 0) << hi)
                        p2 = gptq_half_from_marlin_8bit(w0, 1) | uint32(gptq_half_from_marlin_8bit(w1, 1) << hi)
                        p1 = gptq_half_from_marlin_8bit(w2, 0) | uint32(gptq_half_from_marlin_8bit(w3, 0) << hi)
                        p3 = gptq_half_from_marlin_8bit(w2, 1) | uint32(gptq_half_from_marlin_8bit(w3, 1) << hi)
                        if row_major:
                            out[e, n, 4 * kt] = p0
                            out[e, n, 4 * kt + 1] = p1
                            out[e, n, 4 * kt + 2] = p2
                            out[e, n, 4 * kt + 3] = p3
                        else:
                            out[e, 4 * kt, n] = p0
                            out[e, 4 * kt + 1, n] = p1
                            out[e, 4 * kt + 2, n] = p2
                            out[e, 4 * kt + 3, n] = p3

    return unpack_direct


@functools.lru_cache(maxsize=None)
def _direct_repack_kernel(bits: int, source: str, k_tiles_per_thread: int | None = None,
                          threads: int = DIRECT_THREADS):
    return jit(direct_repack_kernel_source(bits, source, k_tiles_per_thread, threads))


@functools.lru_cache(maxsize=None)
def _direct_unpack_kernel(bits: int, target: str, k_tiles_per_thread: int | None = None):
    return jit(direct_unpack_kernel_source(bits, target, k_tiles_per_thread))


# Marlin -> GPTQ 8-bit / FP8 raw bits, two columns per thread (the policy's paired_unpack_8bit; measured faster
# than the direct unpack, which got slower with more k-tiles per thread: docs/performance.md, "Repack kernels"). In
# the direct unpack a warp's lanes own columns 8*slot + col (col = 0..3 or 4..7), so each store instruction writes
# 8 runs of 16 bytes: every sector half written, the other half by the block's other warp. The paired kernel gives
# a thread two adjacent columns (col = 2*pair, 2*pair + 1: 8 Marlin words, 8 loads in flight) and writes each
# GPTQ row as one 8-byte store of both columns into the output viewed as uint64 [E, K/4, N/2]: a warp store
# instruction covers 256 contiguous bytes (one n-tile's row), loads stay 4 full 32-byte sectors per instruction.
# Lanes: slot (= 2*warp + half) fastest, then pair; 32 lanes per n-tile, 4 n-tiles per 128-thread block.


def paired_unpack_8bit_kernel_source(k_tiles_per_thread: int | None = None):
    """Marlin W8 [E, K/16, 4N] -> GPTQ 8-bit words viewed as uint64 [E, K/4, N/2] (two columns per 8-byte word)."""
    tiles_per_block = DIRECT_THREADS // 32
    ktpt = k_tiles_per_thread or _policy.paired_unpack_k_tiles_per_thread
    held = 8 * ktpt

    def unpack_paired(marlin, out, size_n):
        """Grid (ceil(K/16 / ktpt), ceil(N/64 / 4), E), DIRECT_THREADS threads."""
        e = cuda.blockIdx.z
        tid = cuda.threadIdx.x
        nt = cuda.blockIdx.y * tiles_per_block + (tid >> 5)
        k_tiles = marlin.shape[1]
        if nt < (size_n >> 6):
            lane = tid & 31
            slot = lane & 7
            pair = lane >> 3
            o = nt * 256 + (pair << 6) + slot  # Marlin word 32*col + 8*row2 + slot of col = 2*pair (+32: col + 1)
            c64 = (nt << 5) + (slot << 2) + pair  # 8-byte word of columns n, n + 1 = 64*nt + 8*slot + 2*pair + {0, 1}
            mw = cuda.local.array(held, dtype=uint32)  # [j][c][row2]
            for j in range(ktpt):
                kt = cuda.blockIdx.x * ktpt + j
                if kt < k_tiles:
                    for c in range(2):
                        for row2 in range(4):
                            mw[8 * j + 4 * c + row2] = marlin[e, kt, o + 32 * c + 8 * row2]
            for j in range(ktpt):
                kt = cuda.blockIdx.x * ktpt + j
                if kt < k_tiles:
                    for r in range(4):
                        lo = gptq_word_from_marlin_8bit(mw, 8 * j, r)
                        hi = gptq_word_from_marlin_8bit(mw, 8 * j + 4, r)
                        out[e, 4 * kt + r, c64] = uint64(lo) | (uint64(hi) << uint64(32))

    return unpack_paired


@functools.lru_cache(maxsize=None)
def _paired_unpack_8bit_kernel(k_tiles_per_thread: int | None = None):
    return jit(paired_unpack_8bit_kernel_source(k_tiles_per_thread))


def paired_unpack_grid(size_k: int, size_n: int, experts: int, k_tiles_per_thread: int | None = None):
    ktpt = k_tiles_per_thread or _policy.paired_unpack_k_tiles_per_thread
    return (-(-(size_k // TILE_K) // ktpt), -(-(size_n // TILE_N) // (DIRECT_THREADS // 32)), experts)


def direct_grid(size_k: int, size_n: int, bits: int, experts: int, k_tiles_per_thread: int | None = None,
                threads: int = DIRECT_THREADS):
    """Launch grid of the direct repack (the direct unpack uses k_tiles_per_thread = 1)."""
    tiles_per_block = threads // (32 if bits == 4 else 64)
    k_tiles_per_thread = k_tiles_per_thread or _policy.per_bits("direct_k_tiles_per_thread", bits)
    return (-(-(size_k // TILE_K) // k_tiles_per_thread), -(-(size_n // TILE_N) // tiles_per_block), experts)


# ---------------------------------------------------------------------------------------------------------------
# Direct kernels for the scattered sources (act-order perm, AWQ) and a shared-memory transpose tile for
# row-major FP8. Same rule as above: every output word written once, no staging where none is needed.
# ---------------------------------------------------------------------------------------------------------------
# Act-order: Marlin row k holds checkpoint row perm[k]. A thread of the direct GPTQ kernel needs rows 0..15 of its
# k-tile for its columns; with a perm each of those rows is a whole GPTQ row (contiguous along N), so the thread
# gathers them one field at a time from the source word holding that row. Loads stay coalesced along N exactly as
# in the direct kernel (8 lanes, 32 consecutive bytes); each source word is requested pf times (once per row it
# holds, from pf different k-tiles), which the L2 serves: blockIdx.x (k) runs fastest, so the blocks in flight
# share one column strip of the source.
# k-tiles per thread: the policy's perm_k_tiles_per_thread (docs/performance.md, "Repack kernels").


def perm_repack_kernel_source(bits: int, k_tiles_per_thread: int | None = None, threads: int = DIRECT_THREADS):
    """GPTQ words [E, K/pf, N] with rows gathered through perm int32 [E, K] -> Marlin [E, K/16, .], direct shape."""
    four_bit = bits == 4
    ktpt = k_tiles_per_thread or _policy.per_bits("perm_k_tiles_per_thread", bits)

    @cuda.jit(device=True, inline=True)
    def gather_k_tile(src, perm, e, kt, n, words, i):
        if four_bit:  # a, b: rows 0-7 / 8-15 of column n; c, d: the same of column n + 8
            a = uint32(0)
            b = uint32(0)
            c = uint32(0)
            d = uint32(0)
            # four small loops rather than one: LLVM unrolls these (one loop with 4 gathers per
            # iteration stayed rolled, serializing the 32 loads)
            for f in range(8):
                k_src = perm_row(perm, e, kt * 16 + f)
                a = a | uint32(uint32(uint32(src[e, k_src >> 3, n] >> uint32((k_src & 7) << 2))
                                      & uint32(0xF)) << uint32(f << 2))
            for f in range(8):
                k_src = perm_row(perm, e, kt * 16 + f)
                c = c | uint32(uint32(uint32(src[e, k_src >> 3, n + 8] >> uint32((k_src & 7) << 2))
                                      & uint32(0xF)) << uint32(f << 2))
            for f in range(8):
                k_src = perm_row(perm, e, kt * 16 + 8 + f)
                b = b | uint32(uint32(uint32(src[e, k_src >> 3, n] >> uint32((k_src & 7) << 2))
                                      & uint32(0xF)) << uint32(f << 2))
            for f in range(8):
                k_src = perm_row(perm, e, kt * 16 + 8 + f)
                d = d | uint32(uint32(uint32(src[e, k_src >> 3, n + 8] >> uint32((k_src & 7) << 2))
                                      & uint32(0xF)) << uint32(f << 2))
            words[i] = a
            words[i + 1] = b
            words[i + 2] = c
            words[i + 3] = d
        else:  # word r: rows 4r..4r+3 of column n
            for r in range(4):
                w = uint32(0)
                for f in range(4):
                    k_src = perm_row(perm, e, kt * 16 + 4 * r + f)
                    byte = uint32(src[e, k_src >> 2, n] >> uint32((k_src & 3) << 3)) & uint32(0xFF)
                    w = w | uint32(byte << uint32(f << 3))
                words[i + r] = w

    body = direct_kernel_body(gather_k_tile, bits, threads, ktpt)

    def repack_perm(src, perm, out, size_n):
        """Grid as the direct repack's; Marlin row k of expert e takes source row perm[e, k]."""
        body(src, perm, out, size_n)

    return repack_perm


# AWQ: word (k, c) holds the codes of row k, columns c*pf .. c*pf+pf-1, column c*pf + i in field
# (i >> 1) + pf/2 * (i & 1). The 8 Marlin words one thread writes (one per col = 0..7, the other indices fixed)
# need rows k0, k0+1, k0+8, k0+9 (k0 = 2*row2) of 16 columns that sit in exactly 2 AWQ words per row: 8 loads,
# 8 stores, no redundancy. 4-bit: lane = 4*row2 + warp (16 lanes per tile), columns 16*warp + {0..15} = AWQ words
# 2*warp, 2*warp+1; Marlin words 16*col + lane. 8-bit: lane = 8*row2 + slot (32 lanes per tile, slot = 2*warp +
# half), columns 16*warp + 8*half + {0..7} = AWQ words 2*slot, 2*slot+1; Marlin words 32*col + lane.
# k-tiles per thread: the policy's awq_k_tiles_per_thread (1 was fastest for both widths).
# Grid order of the forward AWQ repack: n-blocks fastest, so the blocks in flight write whole Marlin rows
# (measured faster than the k-fastest grid for both widths: docs/performance.md, "Repack kernels"); False keeps
# the k-fastest grid.


def awq_layout(bits: int, threads: int):
    """(four_bit, tiles_per_block, lane_shift, wpt) of the AWQ kernels' thread layout: 16 (4-bit) or 32 (8-bit)
    lanes per n-tile."""
    four_bit = bits == 4
    return four_bit, threads // (16 if four_bit else 32), 4 if four_bit else 5, 128 if four_bit else 256


@cuda.jit(device=True, inline=True)
def awq_thread_rows_words(nt, lane, four_bit):
    """(row2, c0): the AWQ kernels' thread layout for ``lane`` of n-tile ``nt``: rows k0, k0+1, k0+8, k0+9 of the
    k-tile (k0 = 2*row2) and AWQ words c0, c0 + 1 of each (see the comment above)."""
    if four_bit:
        return lane >> 2, nt * 8 + ((lane & 3) << 1)
    return lane >> 3, nt * 16 + ((lane & 7) << 1)


@cuda.jit(device=True, inline=True)
def block_indices(n_fastest):
    """(n-block, k-block) of this block: blockIdx (x, y) for an n-fastest grid, (y, x) for a k-fastest one."""
    if n_fastest:
        return cuda.blockIdx.x, cuda.blockIdx.y
    return cuda.blockIdx.y, cuda.blockIdx.x


@cuda.jit(device=True, inline=True)
def awq_field(w, field, bits):
    return uint32(w >> uint32(field * bits)) & uint32((1 << bits) - 1)


def awq_direct_repack_kernel_source(bits: int, k_tiles_per_thread: int | None = None,
                                    threads: int = DIRECT_THREADS, natural_order: bool = False,
                                    gathered: bool = False, n_fastest: bool = False):
    """AWQ words [E, K, N/pf] -> Marlin [E, K/16, N*16/pf], direct shape (see the comment above).

    ``natural_order``: the source is plainly column-packed (field i of word c = column c*pf + i, no AWQ interleave);
    ``gathered``: Marlin row k reads source row perm[e, k] and the kernel takes (src, perm, out, size_n). Both
    together are pass 2 of the two-pass act-order repack (see gptq_to_npacked_kernel_source). ``n_fastest``: the
    grid is (n-blocks, k-blocks, E) instead of (k-blocks, n-blocks, E) (see awq_grid).
    """
    four_bit, tiles_per_block, lane_shift, wpt = awq_layout(bits, threads)
    ktpt = k_tiles_per_thread or _policy.per_bits("awq_k_tiles_per_thread", bits)
    held = 8 * ktpt

    @cuda.jit(device=True, inline=True)
    def repack_awq_body(src, perm, out, size_n):
        e = cuda.blockIdx.z
        n_block, k_block = block_indices(n_fastest)
        nt, lane = tile_and_lane(n_block, tiles_per_block, lane_shift)
        k_tiles = out.shape[1]
        if nt < (size_n >> 6):
            row2, c0 = awq_thread_rows_words(nt, lane, four_bit)
            ue = uint64(e)  # unsigned indices: no wraparound code (see awq_direct_unpack_kernel_source)
            words = cuda.local.array(held, dtype=uint32)  # [j][dr: k0, k0+1, k0+8, k0+9][h]
            for j in range(ktpt):
                kt = k_block * ktpt + j
                if kt < k_tiles:
                    k0 = kt * 16 + (row2 << 1)
                    for dr in range(4):
                        k = k0 + (dr & 1) + ((dr >> 1) << 3)
                        if gathered:
                            k = perm_row(perm, ue, uint64(k))  # a whole source row, still read along N (coalesced)
                        words[8 * j + 2 * dr] = src[ue, uint64(k), uint64(c0)]
                        words[8 * j + 2 * dr + 1] = src[ue, uint64(k), uint64(c0 + 1)]
            base = nt * wpt + lane
            for j in range(ktpt):
                kt = k_block * ktpt + j
                if kt < k_tiles:
                    for col in range(8):
                        if four_bit:
                            # column 16*warp + col: word h = 0, field of col; column + 8: word h = 1
                            f = col if natural_order else (col >> 1) + 4 * (col & 1)
                            m = (awq_field(words[8 * j], f, 4)
                                 | uint32(awq_field(words[8 * j + 4], f, 4) << uint32(4))
                                 | uint32(awq_field(words[8 * j + 1], f, 4) << uint32(8))
                                 | uint32(awq_field(words[8 * j + 5], f, 4) << uint32(12))
                                 | uint32(awq_field(words[8 * j + 2], f, 4) << uint32(16))
                                 | uint32(awq_field(words[8 * j + 6], f, 4) << uint32(20))
                                 | uint32(awq_field(words[8 * j + 3], f, 4) << uint32(24))
                                 | uint32(awq_field(words[8 * j + 7], f, 4) << uint32(28)))
                            out[ue, uint64(kt), uint64(base + (col << 4))] = m
                        else:
                            # column 16*warp + 8*half + col: word h = col >> 2, field of col & 3;
                            # bytes: rows k0, k0+8, k0+1, k0+9
                            h = col >> 2
                            i = col & 3
                            f = i if natural_order else (i >> 1) + 2 * (i & 1)
                            m = (awq_field(words[8 * j + h], f, 8)
                                 | uint32(awq_field(words[8 * j + 4 + h], f, 8) << uint32(8))
                                 | uint32(awq_field(words[8 * j + 2 + h], f, 8) << uint32(16))
                                 | uint32(awq_field(words[8 * j + 6 + h], f, 8) << uint32(24)))
                            out[ue, uint64(kt), uint64(base + (col << 5))] = m

    if gathered:
        def repack_awq_gathered(src, perm, out, size_n):
            """Grid (ceil(K/16 / ktpt), ceil(N/64 / tiles_per_block), E), ``threads`` threads; perm int32 [E, K]."""
            repack_awq_body(src, perm, out, size_n)

        return repack_awq_gathered

    def repack_awq(src, out, size_n):
        """Grid (ceil(K/16 / ktpt), ceil(N/64 / tiles_per_block), E), ``threads`` threads."""
        no_perm = cuda.local.array((1, 1), dtype=int32)  # never read (gathered is False): keeps one body
        repack_awq_body(src, no_perm, out, size_n)

    return repack_awq


# Act-order in two passes. The one-pass gather loads a 32-bit word for each 4- or 8-bit
# field it needs (the pf rows of a GPTQ word go to pf random k-tiles), so the L2 -> SM traffic is 8x (4x) the source
# bytes. Two passes instead, every loaded byte used in both:
#   pass 1  GPTQ words [K/pf, N] -> N-packed rows [K, N/pf] (field i of word c = column c*pf + i): per thread an
#           8x8 nibble (4x4 byte) transpose of pf words; loads and stores both 128 contiguous bytes per warp
#           instruction, through a shared-memory tile (one k-tile x pf*128 columns per block);
#   pass 2  the direct AWQ kernel in natural field order with its rows read through perm (whole rows: coalesced).
# The intermediate is one layer's size. For stacked experts the wrapper keeps the one-pass kernel (one launch for
# all experts, no temporary), so peak extra device memory stays 0 there; see _launch_repack.
NPACK_THREADS = 128
NPACK_TILE_WORDS = TILE_K * NPACK_THREADS  # one k-tile x pf*NPACK_THREADS columns = 16*128 words for both widths
NPACK_STAGE_WORDS = NPACK_TILE_WORDS + NPACK_TILE_WORDS // 32  # one pad word per 32: conflict-free strided reads


def gptq_to_npacked_kernel_source(bits: int):
    """GPTQ words [E, K/pf, N] -> N-packed words [E, K, N/pf] (pass 1 of the two-pass act-order repack)."""
    pf = 32 // bits
    log_pf = 3 if bits == 4 else 2
    row_words = TILE_K // pf  # GPTQ rows of words per k-tile
    cols_per_block = pf * NPACK_THREADS
    # transpose network: (distance, shift, mask) stages; stage d swaps field f + d of word i with field f of word i + d
    # for every i, f with bit d clear, on the pf x pf matrix of fields (word = row, field = column)
    stages = ((4, 16, 0x0000FFFF), (2, 8, 0x00FF00FF), (1, 4, 0x0F0F0F0F)) if bits == 4 else (
        (2, 16, 0x0000FFFF), (1, 8, 0x00FF00FF))
    stage_dist = tuple(d for d, _, _ in stages)
    stage_shift = tuple(sh for _, sh, _ in stages)
    stage_mask = tuple(m for _, _, m in stages)
    n_stages = len(stages)

    def to_npacked(src, out, size_n):
        """Grid (K/16, ceil(N / (pf*NPACK_THREADS)), E), NPACK_THREADS threads."""
        stage = cuda.shared.array(NPACK_STAGE_WORDS, dtype=uint32)  # [row_words][cols_per_block], padded
        kt = cuda.blockIdx.x
        e = cuda.blockIdx.z
        tid = cuda.threadIdx.x
        n0 = cuda.blockIdx.y * cols_per_block
        ue = uint64(e)  # unsigned indices: no wraparound code (see awq_direct_unpack_kernel_source)
        held = cuda.local.array(TILE_K, dtype=uint32)  # [h][i]: registers after unrolling
        # coalesced loads (consecutive threads, consecutive columns); a column past N reloads the last one (no
        # branch, so all 16 loads issue before the first shared store); its stage slot is never read
        for h in range(row_words):
            for i in range(pf):
                n = min(n0 + tid + NPACK_THREADS * i, size_n - 1)
                held[h * pf + i] = src[ue, uint64(kt * row_words + h), uint64(n)]
        # a barrier between the loads and the shared stores keeps ptxas from interleaving them (the SASS
        # without it issues 4 loads, waits for the first in a shared store, 3 more, ...); all 16 are in flight first
        cuda.syncthreads()
        for h in range(row_words):
            for i in range(pf):
                j = h * cols_per_block + tid + NPACK_THREADS * i
                stage[uint64(j + (j >> 5))] = held[h * pf + i]
        cuda.syncthreads()
        if n0 + pf * tid < size_n:  # N % 64 == 0: the thread's pf columns exist together
            m = cuda.local.array(8, dtype=uint32)
            for h in range(row_words):
                for i in range(pf):
                    j = h * cols_per_block + pf * tid + i
                    m[i] = stage[uint64(j + (j >> 5))]  # column pf*tid + i, rows h*pf .. h*pf + pf - 1
                for st in range(n_stages):
                    d = stage_dist[st]
                    for i in range(pf):
                        if (i & d) == 0:
                            t = uint32(uint32(m[i] >> uint32(stage_shift[st])) ^ m[i + d]) & uint32(stage_mask[st])
                            m[i + d] = m[i + d] ^ t
                            m[i] = m[i] ^ uint32(t << uint32(stage_shift[st]))
                for f in range(pf):  # now word f = row h*pf + f of the thread's pf columns
                    out[ue, uint64(kt * TILE_K + h * pf + f), uint64((n0 >> log_pf) + tid)] = m[f]

    return to_npacked


@functools.lru_cache(maxsize=None)
def _npacked_kernel(bits: int):
    return jit(gptq_to_npacked_kernel_source(bits))


def npacked_grid(size_k: int, size_n: int, bits: int, experts: int):
    return (size_k // TILE_K, -(-size_n // ((32 // bits) * NPACK_THREADS)), experts)


# Act-order pass 2 grid order: with the n-blocks in blockIdx.x (fastest), the blocks in flight cover whole
# rows: every perm-gathered source row is read along its full length by neighbouring blocks and the Marlin rows are
# written front to back (the k-fastest grid spread both over a ~1 KiB-wide column strip of every row).
# (Column strips of both passes, 8 / 16 MiB of intermediate, were measured at 0.1-1% of copy: a few dozen launches
# on strided views, far slower than their launch cost explains; the cause was not found, so they are not used.)


def launch_act_order_two_pass(src, perm, out, size_k: int, size_n: int, bits: int, stream, temp=None,
                              n_fastest: bool | None = None, policy: RepackPolicy | None = None):
    """Two-pass act-order repack of one matrix (src [1, K/pf, N], perm [1, K], out [1, K/16, N*16/pf]) on
    ``stream``; ``temp`` is the N-packed intermediate [1, K, N/pf] (allocated here when None)."""
    p = policy or _policy
    pf = 32 // bits
    if temp is None:
        temp = Arrays(stream).empty((1, size_k, size_n // pf), np.uint32)
    ktpt = p.per_bits("act_order_pass2_k_tiles_per_thread", bits)
    nfast = p.act_order_pass2_n_fastest if n_fastest is None else n_fastest
    nfast = nfast and grid_n_fastest_fits(size_k, ktpt)
    pass1 = _npacked_kernel(bits)
    pass2 = _awq_direct_repack_kernel(bits, ktpt, DIRECT_THREADS, True, True, nfast)
    pass1[npacked_grid(size_k, size_n, bits, 1), NPACK_THREADS, stream](src, temp, size_n)
    pass2[awq_grid(size_k, size_n, bits, 1, ktpt, DIRECT_THREADS, nfast), DIRECT_THREADS, stream](temp, perm, out,
                                                                                                    size_n)
    return temp


# Marlin -> AWQ: a thread's two AWQ words of a row (c0, c0 + 1, c0 even) are adjacent; written by two store
# instructions, each covering every other word (8-byte stride), every sector of a store instruction is half
# written. ``wide_stores`` writes them as one 8-byte store into the output viewed as uint64 [E, K, N/pf/2]: a warp
# store instruction then covers 64 contiguous bytes of each of its 4 rows (4-bit; 8-bit: 128 bytes of each of 2
# rows), full sectors, half the store instructions. Measured faster for both widths, most for 8-bit
# (docs/performance.md, "Repack kernels").
# Why a stack of small experts (64 x 2048 x 1408) ran near a copy's rate and the 70B layers well below it with the
# same kernel, bytes and instructions: the grid order. With blockIdx.x (fastest) over k-tiles, the ~2000 blocks
# resident at a time covered every k-tile of only ~4 n-blocks: reads of a ~16 KiB piece of each of the 512 Marlin
# rows and writes of a ~1 KiB-wide column strip of each of the 8192 AWQ rows (row pitch 14 KiB). In the stack a whole
# expert (128 k-tiles x 3 n-blocks, rows of 704 bytes) is one contiguous 1.4 MB block of output, so the resident
# blocks stream through memory. With awq_unpack_n_fastest the grid is (n-blocks, k-tiles, E): the resident blocks
# cover ~40 whole Marlin rows and ~600 whole AWQ rows, both contiguous, as in the stack.
# Compute: building each AWQ word from 8 (u4) / 4 (u8) single-field extracts (shift, mask, shift, or per field)
# costs 64 / 32 extracts per thread. The fields a thread moves form an 8 x 8 nibble (u4) or two 4 x 4 byte (u8)
# matrices: AWQ word p, field f = Marlin word col(f), field p. With the Marlin words loaded in field order
# f, a 3-stage (2-stage) mask-and-shift transpose (the one of pass 1) gives all AWQ words: 4 ops per pair and stage.
# The only form kept: it timed the same as the per-field extracts (docs/performance.md, "Repack kernels").


@cuda.jit(device=True, inline=True)
def transpose_fields(m, base, pf, stages_dist, stages_shift, stages_mask):
    """In-place transpose of the pf x pf field matrix in m[base .. base + pf - 1] (word = row, field = column):
    stage (d, shift, mask) swaps field f + d of word i with field f of word i + d for every i, f with bit d clear."""
    for st in range(len(stages_dist)):
        d = stages_dist[st]
        for i in range(pf):
            if (i & d) == 0:
                t = uint32(uint32(m[base + i] >> uint32(stages_shift[st])) ^ m[base + i + d]) & uint32(stages_mask[st])
                m[base + i + d] = m[base + i + d] ^ t
                m[base + i] = m[base + i] ^ uint32(t << uint32(stages_shift[st]))


def transpose_stages(bits: int):
    """(distances, shifts, masks) of the field transpose network for bits = 4 (8 x 8 nibbles) or 8 (4 x 4 bytes)."""
    stages = ((4, 16, 0x0000FFFF), (2, 8, 0x00FF00FF), (1, 4, 0x0F0F0F0F)) if bits == 4 else (
        (2, 16, 0x0000FFFF), (1, 8, 0x00FF00FF))
    return tuple(d for d, _, _ in stages), tuple(sh for _, sh, _ in stages), tuple(m for _, _, m in stages)


def awq_direct_unpack_kernel_source(bits: int, wide_stores: bool | None = None, n_fastest: bool | None = None):
    """Marlin [E, K/16, N*16/pf] -> AWQ words [E, K, N/pf] (``wide_stores``: out is that array viewed as uint64
    [E, K, N/pf/2]): the direct AWQ repack backwards, one k-tile a thread, the fields moved by the transpose network;
    ``n_fastest``: grid (n-blocks, K/16, E) instead of (K/16, n-blocks, E). The defaults are the module switches."""
    wide = _policy.awq_unpack_wide_stores if wide_stores is None else wide_stores
    nfast = _policy.awq_unpack_n_fastest if n_fastest is None else n_fastest
    four_bit, tiles_per_block, lane_shift, wpt = awq_layout(bits, DIRECT_THREADS)
    col_shift = 4 if four_bit else 5
    t_dist, t_shift, t_mask = transpose_stages(bits)

    def unpack_awq(marlin, out, size_n):
        """Grid awq_grid(K, N, bits, E, 1, DIRECT_THREADS, n_fastest), DIRECT_THREADS threads."""
        n_block, kt = block_indices(nfast)
        e = cuda.blockIdx.z
        nt, lane = tile_and_lane(n_block, tiles_per_block, lane_shift)
        if nt < (size_n >> 6):
            base = nt * wpt + lane
            row2, c0 = awq_thread_rows_words(nt, lane, four_bit)
            # unsigned indices: Numba adds a negative-index wraparound (compare + select, 64-bit) per signed index
            # and dimension; these are never negative (about a fifth of the SASS of this kernel)
            ue = uint64(e)
            ukt = uint64(kt)
            mw = cuda.local.array(8, dtype=uint32)
            for col in range(8):
                # AWQ field of column col: u4 (col >> 1) + 4*(col & 1); u8 word col >> 2, field as u4 in 2 bits
                if four_bit:
                    slot = (col >> 1) + 4 * (col & 1)
                else:
                    slot = 4 * (col >> 2) + ((col & 3) >> 1) + 2 * (col & 1)
                mw[slot] = marlin[ue, ukt, uint64(base + (col << col_shift))]  # Marlin word 16*col (32*col) + lane
            # now mw[p] (u4) / mw[4h + p] (u8) = the AWQ word whose fields come from Marlin field p
            if four_bit:
                transpose_fields(mw, 0, 8, t_dist, t_shift, t_mask)
            else:
                transpose_fields(mw, 0, 4, t_dist, t_shift, t_mask)
                transpose_fields(mw, 4, 4, t_dist, t_shift, t_mask)
            k0 = kt * 16 + (row2 << 1)
            pair = cuda.local.array(2, dtype=uint32)  # AWQ words c0, c0 + 1 of one row
            for dr in range(4):  # rows k0, k0+1, k0+8, k0+9
                k = k0 + (dr & 1) + ((dr >> 1) << 3)
                for h in range(2):
                    if four_bit:
                        pos = (dr >> 1) + (h << 1) + ((dr & 1) << 2)  # nibble of the Marlin word (see the repack)
                    else:
                        pos = (dr >> 1) + ((dr & 1) << 1)  # byte: rows k0, k0+8, k0+1, k0+9
                    pair[h] = mw[pos] if four_bit else mw[4 * h + pos]
                if wide:
                    out[ue, uint64(k), uint64(c0 >> 1)] = uint64(pair[0]) | (uint64(pair[1]) << uint64(32))
                else:
                    out[e, k, c0] = pair[0]
                    out[e, k, c0 + 1] = pair[1]

    return unpack_awq


# Row-major FP8 [N, K] <-> Marlin: a block owns one n-tile (64 rows of the source) × TRANSPOSE_K_TILES k-tiles,
# i.e. 64 rows of 4*TRANSPOSE_K_TILES words. It moves them through shared memory with whole-row accesses (a warp
# reads or writes one row's 128 contiguous bytes), and the pack itself is the direct 8-bit one, reading the 4 words
# of column n straight from the staged row. Rows are padded by one word so the column reads hit distinct banks.
TRANSPOSE_K_TILES = 8
TRANSPOSE_ROW_WORDS = 4 * TRANSPOSE_K_TILES  # 32 words = 128 bytes of one source row
TRANSPOSE_ROW_STRIDE = TRANSPOSE_ROW_WORDS + 1  # padding: a module constant (shared shapes must be constants)
TRANSPOSE_STAGE_WORDS = TILE_N * TRANSPOSE_ROW_STRIDE
TRANSPOSE_THREADS = 128  # 2 groups of 64 lanes, each group 4 of the block's 8 k-tiles
TRANSPOSE_LOADS_PER_THREAD = TILE_N * TRANSPOSE_ROW_WORDS // TRANSPOSE_THREADS  # 16: warp i reads rows i, i+4, ..
# The inverse (Marlin -> row-major) turns the tile around: the block's 8 k-tiles x 256 Marlin words (8 contiguous
# KiB runs of 1 KiB) are copied raw into shared memory with 16 fully coalesced loads per thread (a warp reads one
# 128-byte line per instruction, no arithmetic between the loads and the shared stores, which ptxas keeps as 16
# loads then 16 stores), barrier, then each thread builds its 16 row-major words from 2 staged Marlin words each
# and stores them row-contiguously (a warp writes one row's 128 bytes). Every global access is a whole line.
MARLIN_TILE_STRIDE = 257  # staged words per k-tile (256 + 1 pad: the 8 k-tiles of a row's words hit 8 banks)


def transpose_repack_kernel_source(inverse: bool = False):
    """Row-major words [E, N, K/4] -> Marlin W8 [E, K/16, 4N] (``inverse``: the reverse)."""
    groups = TRANSPOSE_THREADS // 64
    per_group = TRANSPOSE_K_TILES // groups

    def transpose_repack(src, out, size_n):
        """Grid (ceil(K/16 / TRANSPOSE_K_TILES), N/64, E), TRANSPOSE_THREADS threads."""
        stage = cuda.shared.array(TRANSPOSE_STAGE_WORDS, dtype=uint32)  # [64 rows][ROW_STRIDE]
        e = cuda.blockIdx.z
        nt = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        kt0 = cuda.blockIdx.x * TRANSPOSE_K_TILES
        if inverse:
            k_tiles = src.shape[1]
        else:
            k_tiles = out.shape[1]
        row_words = min(TRANSPOSE_ROW_WORDS, 4 * (k_tiles - kt0))  # words of each row this block owns
        lane = tid & 63
        group = tid >> 6
        col = lane >> 3
        slot = lane & 7
        n_local = ((slot >> 1) << 4) + col + ((slot & 1) << 3)
        o = nt * 256 + (col << 5) + slot
        if not inverse:
            # all 16 loads first (registers), then the shared stores: a fixed trip count so the loop unrolls and
            # the loads are in flight together
            held = cuda.local.array(TRANSPOSE_LOADS_PER_THREAD, dtype=uint32)
            w = tid & (TRANSPOSE_ROW_WORDS - 1)
            for it in range(TRANSPOSE_LOADS_PER_THREAD):
                r = (tid >> 5) + it * (TRANSPOSE_THREADS >> 5)
                if w < row_words:
                    held[it] = src[e, (nt << 6) + r, 4 * kt0 + w]
            for it in range(TRANSPOSE_LOADS_PER_THREAD):
                r = (tid >> 5) + it * (TRANSPOSE_THREADS >> 5)
                if w < row_words:
                    stage[r * TRANSPOSE_ROW_STRIDE + w] = held[it]
            cuda.syncthreads()
            for j in range(per_group):
                ktl = group + groups * j
                if kt0 + ktl < k_tiles:
                    s = n_local * TRANSPOSE_ROW_STRIDE + 4 * ktl
                    p0 = stage[s]
                    p1 = stage[s + 1]
                    p2 = stage[s + 2]
                    p3 = stage[s + 3]
                    out[e, kt0 + ktl, o] = marlin_words_8bit(p0, p2, 0)
                    out[e, kt0 + ktl, o + 8] = marlin_words_8bit(p0, p2, 1)
                    out[e, kt0 + ktl, o + 16] = marlin_words_8bit(p1, p3, 2)
                    out[e, kt0 + ktl, o + 24] = marlin_words_8bit(p1, p3, 3)
        else:
            # raw copy: flat word i = j*256 + m of the block's k-tile j, Marlin word m of tile nt; a k-tile past K
            # reloads the last one (no branch; its row words are never stored)
            held = cuda.local.array(TRANSPOSE_LOADS_PER_THREAD, dtype=uint32)
            halves = 256 // TRANSPOSE_THREADS  # load instructions per k-tile and thread
            for j in range(TRANSPOSE_K_TILES):
                ktc = min(kt0 + j, k_tiles - 1)
                for hh in range(halves):
                    held[halves * j + hh] = src[uint64(e), uint64(ktc), uint64((nt << 8) + hh * TRANSPOSE_THREADS + tid)]
            # a barrier here keeps ptxas from pulling shared stores (each waiting on its load) between the loads:
            # all 16 are in flight before the first wait (without it the SASS interleaves 7 loads, a store, 3 ...)
            cuda.syncthreads()
            for j in range(TRANSPOSE_K_TILES):
                for hh in range(halves):
                    stage[uint64(j * MARLIN_TILE_STRIDE + hh * TRANSPOSE_THREADS + tid)] = held[halves * j + hh]
            cuda.syncthreads()
            # row-major word w of row r = GPTQ-form word q = w & 3 of k-tile w >> 2, column r; it takes its bytes
            # from the column's Marlin words row2 = 2*(q & 1) and +1 (see gptq_word_from_marlin_8bit)
            w = tid & (TRANSPOSE_ROW_WORDS - 1)
            q = w & 3
            s0 = (w >> 2) * MARLIN_TILE_STRIDE + ((q & 1) << 4)
            for it in range(TRANSPOSE_LOADS_PER_THREAD):
                r = (tid >> 5) + it * (TRANSPOSE_THREADS >> 5)
                # Marlin word 32*col + slot + 8*row2 of column r (inverse of n_local above)
                m = s0 + ((r & 7) << 5) + ((r >> 4) << 1) + ((r >> 3) & 1)
                held[it] = gptq_half_from_marlin_8bit(stage[uint64(m)], q >> 1) | uint32(
                    gptq_half_from_marlin_8bit(stage[uint64(m + 8)], q >> 1) << uint32(16))
            for it in range(TRANSPOSE_LOADS_PER_THREAD):
                r = (tid >> 5) + it * (TRANSPOSE_THREADS >> 5)
                if w < row_words:  # unsigned indices: no wraparound code (see awq_direct_unpack_kernel_source)
                    out[uint64(e), uint64((nt << 6) + r), uint64(4 * kt0 + w)] = held[it]

    return transpose_repack


@functools.lru_cache(maxsize=None)
def _perm_repack_kernel(bits: int, k_tiles_per_thread: int | None = None, threads: int = DIRECT_THREADS):
    return jit(perm_repack_kernel_source(bits, k_tiles_per_thread, threads))


@functools.lru_cache(maxsize=None)
def _awq_direct_repack_kernel(bits: int, k_tiles_per_thread: int | None = None, threads: int = DIRECT_THREADS,
                              natural_order: bool = False, gathered: bool = False, n_fastest: bool = False):
    return jit(awq_direct_repack_kernel_source(bits, k_tiles_per_thread, threads, natural_order, gathered,
                                                    n_fastest))


def _awq_direct_unpack_kernel(bits: int, wide_stores: bool | None = None, n_fastest: bool | None = None):
    # None means the module switch; resolved here so the cache key names the kernel actually built
    wide = _policy.awq_unpack_wide_stores if wide_stores is None else wide_stores
    nfast = _policy.awq_unpack_n_fastest if n_fastest is None else n_fastest
    return _awq_direct_unpack_kernel_built(bits, wide, nfast)


@functools.lru_cache(maxsize=None)
def _awq_direct_unpack_kernel_built(bits: int, wide: bool, nfast: bool):
    return jit(awq_direct_unpack_kernel_source(bits, wide, nfast))


@functools.lru_cache(maxsize=None)
def _transpose_repack_kernel(inverse: bool = False):
    return jit(transpose_repack_kernel_source(inverse))


def perm_grid(size_k, size_n, bits, experts, k_tiles_per_thread=None, threads=DIRECT_THREADS):
    return direct_grid(size_k, size_n, bits, experts, k_tiles_per_thread or _policy.per_bits("perm_k_tiles_per_thread", bits), threads)


def awq_grid(size_k, size_n, bits, experts, k_tiles_per_thread=None, threads=DIRECT_THREADS, n_fastest=False):
    """Launch grid of the direct AWQ repack (the unpack: k_tiles_per_thread = 1, DIRECT_THREADS): (k-blocks,
    n-blocks, E), or (n-blocks, k-blocks, E) for the kernels built with n_fastest (check grid_n_fastest_fits)."""
    tiles_per_block = threads // (16 if bits == 4 else 32)
    ktpt = k_tiles_per_thread or _policy.per_bits("awq_k_tiles_per_thread", bits)
    k_blocks = -(-(size_k // TILE_K) // ktpt)
    n_blocks = -(-(size_n // TILE_N) // tiles_per_block)
    return (n_blocks, k_blocks, experts) if n_fastest else (k_blocks, n_blocks, experts)


MAX_GRID_Y = 65535  # CUDA's limit on gridDim.y (x allows 2**31 - 1)


def grid_n_fastest_fits(size_k: int, k_tiles_per_thread: int = 1) -> bool:
    """Whether the k-blocks fit in gridDim.y (K up to ~1M rows); the wrappers fall back to the k-fastest grid."""
    return -(-(size_k // TILE_K) // k_tiles_per_thread) <= MAX_GRID_Y


def transpose_grid(size_k, size_n, experts):
    return (-(-(size_k // TILE_K) // TRANSPOSE_K_TILES), size_n // TILE_N, experts)

# ---------------------------------------------------------------------------------------------------------------
# Kernels (built per (bits, source) so pack factors and branches are compile-time constants)
# ---------------------------------------------------------------------------------------------------------------


def gather_rows_kernel_source(bits: int):
    """GPTQ rows in Marlin row order -> checkpoint row order: out row k = in row inverse_perm[k] (act-order inverse)."""
    c = _consts(bits)
    pf, log_pf, mask = c["pf"], c["log_pf"], c["mask"]

    def gather_rows(src, inverse_perm, out):
        """src, out uint32 [E, K/pf, N]; inverse_perm int32 [E, K]. Grid-stride over out's words."""
        start = cuda.grid(1)
        stride = cuda.gridsize(1)
        rows = out.shape[1]
        size_n = out.shape[2]
        for t in range(start, out.size, stride):
            e = t // (rows * size_n)
            rest = t - e * rows * size_n
            r = rest // size_n
            n = rest - r * size_n
            word = uint32(0)
            for f in range(pf):
                k_src = perm_row(inverse_perm, e, r * pf + f)
                w = src[e, k_src >> log_pf, n]
                code = uint32(w >> uint32((k_src & (pf - 1)) * bits)) & uint32(mask)
                word = word | uint32(code << uint32(f * bits))
            out[e, r, n] = word

    return gather_rows


def invert_perm_kernel_source():
    def invert_perm(perm, inverse_perm):
        """inverse_perm[e, perm[e, k]] = k; perm int32 [E, K]. A value outside [0, K) writes nothing."""
        start = cuda.grid(1)
        stride = cuda.gridsize(1)
        size_k = perm.shape[1]
        for t in range(start, perm.size, stride):
            e = t // size_k
            k = t - e * size_k
            v = perm[e, k]
            if v >= 0 and v < size_k:
                inverse_perm[e, v] = k

    return invert_perm


# Checking a device perm without copying it back: one thread per entry counts its value into ``seen`` (an atomic
# add returns the old count, so the second thread to arrive at a value knows it is a repeat). K in-range values
# without a repeat are a permutation of range(K). The host reads only the 32-byte verdict.
PERM_OK = np.iinfo(np.int64).max  # "nothing wrong seen" in the atomic-min slots of the verdict


def check_perm_kernel_source():
    def check_perm(perm, seen, verdict):
        """perm int32 [E, K]; seen int32 [E, K], zeroed; verdict int64[4] = (lowest flat index e*K + k of a value
        outside [0, K), their count, lowest e*K + v of a value seen twice, the number of repeats)."""
        start = cuda.grid(1)
        stride = cuda.gridsize(1)
        size_k = perm.shape[1]
        for t in range(start, perm.size, stride):
            e = t // size_k
            v = perm[e, t - e * size_k]
            if v < 0 or v >= size_k:
                cuda.atomic.min(verdict, 0, t)
                cuda.atomic.add(verdict, 1, 1)
            elif cuda.atomic.add(seen, (e, v), 1) != 0:
                cuda.atomic.min(verdict, 2, e * size_k + v)
                cuda.atomic.add(verdict, 3, 1)

    return check_perm


def zero_fill_kernel_source():
    def zero_fill(a):
        """a int32 [E, K] = 0 (device scratch without a host copy)."""
        start = cuda.grid(1)
        stride = cuda.gridsize(1)
        cols = a.shape[1]
        for t in range(start, a.size, stride):
            r = t // cols
            a[r, t - r * cols] = 0

    return zero_fill


@functools.lru_cache(maxsize=None)
def _gather_rows_kernel(bits: int):
    return jit(gather_rows_kernel_source(bits))


@functools.lru_cache(maxsize=None)
def _invert_perm_kernel():
    return jit(invert_perm_kernel_source())


@functools.lru_cache(maxsize=None)
def _check_perm_kernel():
    return jit(check_perm_kernel_source())


@functools.lru_cache(maxsize=None)
def _zero_fill_kernel():
    return jit(zero_fill_kernel_source())


def compile_targets():
    """(name, python function, argument types) of every kernel variant here, for the offline compile check."""
    from numba import types

    u32_3d = types.Array(types.uint32, 3, "C")
    i32_2d = types.Array(types.int32, 2, "C")
    u64_3d = types.Array(types.uint64, 3, "C")  # outputs written as 8-byte words (two packed words per store)
    for bits in (4, 8):
        yield f"gather_rows[{bits}-bit]", gather_rows_kernel_source(bits), (u32_3d, i32_2d, u32_3d)
        for source in ("gptq", "row_major_bytes"):
            if source == "row_major_bytes" and bits == 4:
                continue
            for ktpt in sorted({1, _policy.per_bits("direct_k_tiles_per_thread", bits)}):
                yield (f"direct_repack[{bits}-bit,{source},ktpt={ktpt}]", direct_repack_kernel_source(bits, source,
                                                                                                       ktpt),
                       (u32_3d, u32_3d, types.int64))
            yield (f"direct_unpack[{bits}-bit,{source}]", direct_unpack_kernel_source(bits, source),
                   (u32_3d, u32_3d, types.int64))
    yield "invert_perm", invert_perm_kernel_source(), (i32_2d, i32_2d)
    yield "check_perm", check_perm_kernel_source(), (i32_2d, i32_2d, types.Array(types.int64, 1, "C"))
    yield "zero_fill", zero_fill_kernel_source(), (i32_2d,)
    for bits in (4, 8):
        yield f"perm_gather[{bits}-bit]", perm_repack_kernel_source(bits), (u32_3d, i32_2d, u32_3d, types.int64)
        yield f"awq_direct_repack[{bits}-bit]", awq_direct_repack_kernel_source(bits), (u32_3d, u32_3d, types.int64)
        for wide, nfast in ((False, False), (True, False), (True, True)):
            yield (f"awq_direct_unpack[{bits}-bit,wide_stores={wide},n_fastest={nfast}]",
                   awq_direct_unpack_kernel_source(bits, wide, nfast),
                   (u32_3d, u64_3d if wide else u32_3d, types.int64))
        yield f"npacked[{bits}-bit]", gptq_to_npacked_kernel_source(bits), (u32_3d, u32_3d, types.int64)
        for nfast in (False, True):
            yield (f"awq_natural_gathered[{bits}-bit,n_fastest={nfast}]",
                   awq_direct_repack_kernel_source(bits, _policy.per_bits("act_order_pass2_k_tiles_per_thread", bits), natural_order=True,
                                                   gathered=True, n_fastest=nfast),
                   (u32_3d, i32_2d, u32_3d, types.int64))
        yield (f"awq_direct_repack[{bits}-bit,n_fastest=True]", awq_direct_repack_kernel_source(bits, n_fastest=True),
               (u32_3d, u32_3d, types.int64))
        yield (f"unpack_ktpt[{bits}-bit,gptq,ktpt=1]", direct_unpack_kernel_source(bits, "gptq", 1),
               (u32_3d, u32_3d, types.int64))
    for inverse in (False, True):
        yield f"transpose_tile[inverse={inverse}]", transpose_repack_kernel_source(inverse), (u32_3d, u32_3d,
                                                                                                types.int64)
    i32_1d = types.Array(types.int32, 1, "C")
    for bits, sources in ((4, ("gptq", "gptq_perm", "awq")), (8, ("gptq", "gptq_perm", "awq", "row_major_bytes"))):
        for source in sources:
            yield (f"edge_repack[{bits}-bit,{source}]", edge_repack_kernel_source(bits, source),
                   (u32_3d, i32_2d, i32_1d, u32_3d) + (types.int64,) * 4)
        for target in sources:
            if target != "gptq_perm":
                yield (f"edge_unpack[{bits}-bit,{target}]", edge_unpack_kernel_source(bits, target),
                       (u32_3d, i32_1d, u32_3d, types.int64, types.int64))
    for ktpt in sorted({1, 2, _policy.paired_unpack_k_tiles_per_thread}):
        yield f"paired_unpack_8bit[ktpt={ktpt}]", paired_unpack_8bit_kernel_source(ktpt), (u32_3d, u64_3d, types.int64)


# ---------------------------------------------------------------------------------------------------------------
# Host wrappers: check -> allocate -> launch
# ---------------------------------------------------------------------------------------------------------------
def _as_3d(d, name: str, rows: int, cols: int):
    """(R, C) or (E, R, C) device array -> (E, R, C) view, checking R and C (nothing reads out of bounds)."""
    shape = tuple(d.shape)
    if len(shape) == 2:
        shape = (1,) + shape
    if len(shape) != 3 or shape[1:] != (rows, cols):
        raise ValueError(f"{name} has shape {tuple(d.shape)}, expected ({rows}, {cols}) or (experts, {rows}, {cols})")
    return d.reshape(shape), len(d.shape) == 3


def _check_sizes(size_k: int, size_n: int, bits: int, source: str) -> tuple[int, int, int]:
    """The ops' own scalar checks (one rule, one message): -> (size_k, size_n, bits) as Python ints. Any positive
    sizes; the checkpoint form's rule: GPTQ rows and FP8 words fill whole words along K, AWQ along N."""
    size_k, size_n = check_weight_sizes(size_k, size_n)
    bits = check_bits(bits)
    pf = 32 // bits
    if source == "awq":
        require_pack_multiple(size_n, pf, "size_n", f"AWQ packs {pf} columns of {bits}-bit codes per word")
    elif source == "row_major_bytes":
        require_pack_multiple(size_k, 4, "size_k", "FP8 bytes are moved as K-major 32-bit words")
    else:
        require_pack_multiple(size_k, pf, "size_k", f"GPTQ packs {pf} rows of {bits}-bit codes per word")
    return size_k, size_n, bits


def uses_two_pass(source: str, experts: int, policy: RepackPolicy | None = None) -> bool:
    """Whether the act-order repack goes through the two-pass route (it needs an N-packed temporary [1, K, N/pf])."""
    return source == "gptq_perm" and (policy or _policy).act_order_two_pass and experts == 1


def weight_repack_launch(src, perm, out, bits: int, source: str, size_k: int, size_n: int, stream, temp=None,
                         policy: RepackPolicy | None = None):
    """The kernel and grid the wrappers use for one (stacked) weight repack, as a zero-argument launch, so that the
    benchmark times exactly what the wrappers run. GPTQ rows go through the direct kernel, act-order through the
    two-pass repack for one matrix (``temp``: see uses_two_pass) and the one-pass perm gather for stacked experts,
    AWQ through the direct AWQ kernel, row-major FP8 through the shared-memory transpose tile."""
    p = policy or _policy
    experts = src.shape[0]
    if source == "gptq":
        ktpt = p.per_bits("direct_k_tiles_per_thread", bits)
        grid = direct_grid(size_k, size_n, bits, experts, ktpt)
        kernel = _direct_repack_kernel(bits, source, ktpt)
        return lambda: kernel[grid, DIRECT_THREADS, stream](src, out, size_n)
    if uses_two_pass(source, experts, p):
        return lambda: launch_act_order_two_pass(src, perm, out, size_k, size_n, bits, stream, temp, policy=p)
    if source == "gptq_perm":
        ktpt = p.per_bits("perm_k_tiles_per_thread", bits)
        grid = perm_grid(size_k, size_n, bits, experts, ktpt)
        kernel = _perm_repack_kernel(bits, ktpt)
        return lambda: kernel[grid, DIRECT_THREADS, stream](src, perm, out, size_n)
    if source == "awq":
        ktpt = p.per_bits("awq_k_tiles_per_thread", bits)
        nfast = p.awq_repack_n_fastest and grid_n_fastest_fits(size_k, ktpt)
        grid = awq_grid(size_k, size_n, bits, experts, ktpt, n_fastest=nfast)
        kernel = _awq_direct_repack_kernel(bits, ktpt, n_fastest=nfast)
        return lambda: kernel[grid, DIRECT_THREADS, stream](src, out, size_n)
    grid = transpose_grid(size_k, size_n, experts)
    return lambda: _transpose_repack_kernel(False)[grid, TRANSPOSE_THREADS, stream](src, out, size_n)


def _whole_tile_rows(arrays: Arrays, d, perm, k_tiles: int):
    """(src-or-None, perm-or-None, marlin) triples whose Marlin array has exactly ``k_tiles`` rows: ``d`` itself
    when it has them, else C-contiguous views of its first k_tiles rows (one per expert: a device view keeps only a
    leading index and one final slice, so a stack with a partial k-tile row is done expert by expert)."""
    experts, rows, width = d.shape
    if rows == k_tiles:
        return [(None, perm, d)]
    views = []
    for e in range(experts):
        e_perm = None if perm is None else perm[e].reshape((1, perm.shape[1]))
        views.append((e, e_perm, d[e][:k_tiles].reshape((1, k_tiles, width))))
    return views


def _launch_repack(arrays: Arrays, src, perm, bits: int, source: str, size_k: int, size_n: int, stacked: bool,
                   policy: RepackPolicy | None = None):
    """The repack through weight_repack_launch's kernel (the one the benchmark times) on the whole tiles inside
    (K, N), and the edge kernel on the last k-tile row and n-tile column of a shape that is not tile multiples."""
    experts = src.shape[0]
    pf = 32 // bits
    out = arrays.empty((experts, padded_k(size_k) // TILE_K, padded_n(size_n) * TILE_K // pf), np.uint32)
    repack_into(arrays, src, perm, out, bits, source, size_k, size_n, policy)
    return arrays.give(out if stacked else out.reshape(out.shape[1:]), np.int32)


def repack_into(arrays: Arrays, src, perm, out, bits: int, source: str, size_k: int, size_n: int,
                policy: RepackPolicy | None = None) -> None:
    """Every word of ``out`` [E, K_pad/16, N_pad*16/pf]: the whole tiles through weight_repack_launch's kernel,
    the edge tiles through the edge kernel."""
    experts = src.shape[0]
    pf = 32 // bits
    k_full, n_full = size_k // TILE_K * TILE_K, size_n // TILE_N * TILE_N
    if k_full and n_full:
        if (k_full, n_full) == (size_k, size_n):
            temp = (arrays.empty((1, size_k, size_n // pf), np.uint32)
                    if uses_two_pass(source, experts, policy) else None)
            weight_repack_launch(src, perm, out, bits, source, size_k, size_n, arrays.stream, temp, policy)()
        else:  # the two-pass act-order route needs whole tiles: the one-pass gather reads any row through perm
            route = source
            for e, e_perm, view in _whole_tile_rows(arrays, out, perm, k_full // TILE_K):
                e_src = src if e is None else src[e].reshape((1,) + tuple(src.shape[1:]))
                p = policy or _policy
                if route == "gptq_perm":
                    p = dataclasses.replace(p, act_order_two_pass=False)
                weight_repack_launch(e_src, e_perm, view, bits, route, k_full, n_full, arrays.stream, None, p)()
    launch_edge_repack(arrays, src, perm, out, bits, source, size_k, size_n)


# ---------------------------------------------------------------------------------------------------------------
# Edge kernels: the tiles a shape that is not tile multiples leaves partial (and, backwards, the checkpoint words
# they hold), one Marlin or checkpoint word per thread through the tile map; every load predicated on (K, N)
# ---------------------------------------------------------------------------------------------------------------
EDGE_THREADS = 256


def edge_repack_kernel_source(bits: int, source: str):
    """source "gptq" ([E, K/pf, N] words), "gptq_perm" (the same, rows through perm [E, K]), "awq" ([E, K, N/pf])
    or "row_major_bytes" (8-bit, [E, N, K/4] words) -> the edge tiles of Marlin [E, K_pad/16, N_pad*16/pf]: the
    tiles of k-tile rows >= kt_full (every column) and of n-tile columns >= nt_full (rows < kt_full)."""
    pf = 32 // bits
    log_pf = 3 if bits == 4 else 2
    half_pf = pf // 2
    mask = (1 << bits) - 1
    wpt = TILE_K * TILE_N // pf
    gathered = source == "gptq_perm"
    from_awq = source == "awq"
    row_major = source == "row_major_bytes"

    def edge_repack(src, perm, tile_perm, out, size_k, size_n, kt_full, nt_full):
        """Grid (ceil(edge tiles * wpt / EDGE_THREADS), 1, E), EDGE_THREADS threads; tile_perm int32 [1024]:
        packed position w*pf + f of a tile -> its element dk*64 + dn (marlin_tile.tile_permutation)."""
        e = cuda.blockIdx.z
        t = cuda.blockIdx.x * EDGE_THREADS + cuda.threadIdx.x
        kt_pad = out.shape[1]
        nt_pad = out.shape[2] // wpt
        row_words = (kt_pad - kt_full) * nt_pad * wpt  # words of the k-edge rows, every column
        total = row_words + kt_full * (nt_pad - nt_full) * wpt  # and of the n-edge column above them
        if t >= total:
            return
        if t < row_words:
            tile = t // wpt
            kt = kt_full + tile // nt_pad
            nt = tile - (tile // nt_pad) * nt_pad
        else:
            tile = (t - row_words) // wpt
            kt = tile // (nt_pad - nt_full)
            nt = nt_full + tile - kt * (nt_pad - nt_full)
        w = t & (wpt - 1)
        word = uint32(0)
        for f in range(pf):
            el = tile_perm[w * pf + f]
            k = kt * TILE_K + (el >> 6)
            n = nt * TILE_N + (el & 63)
            if k < size_k and n < size_n:  # the padding is zero codes, read from nowhere
                if gathered:
                    k = perm_row(perm, e, k)
                if from_awq:
                    i = n & (pf - 1)
                    code = uint32(src[e, k, n >> log_pf] >> uint32(((i >> 1) + half_pf * (i & 1)) * bits))
                elif row_major:
                    code = uint32(src[e, n, k >> 2] >> uint32((k & 3) << 3))
                else:
                    code = uint32(src[e, k >> log_pf, n] >> uint32((k & (pf - 1)) * bits))
                word = word | uint32((code & uint32(mask)) << uint32(f * bits))
        out[e, kt, nt * wpt + w] = word

    return edge_repack


def edge_unpack_kernel_source(bits: int, target: str):
    """Marlin [E, K_pad/16, N_pad*16/pf] -> the words of target "gptq" ([E, K/pf, N]), "awq" ([E, K, N/pf]) or
    "row_major_bytes" ([E, N, K/4]) outside its whole-tile part (rows < r_int and columns < c_int)."""
    pf = 32 // bits
    log_pf = 3 if bits == 4 else 2
    half_pf = pf // 2
    mask = (1 << bits) - 1
    wpt = TILE_K * TILE_N // pf
    to_awq = target == "awq"
    row_major = target == "row_major_bytes"
    per_word = 4 if row_major else pf

    def edge_unpack(marlin, tile_inverse, out, r_int, c_int):
        """Grid-stride over E * (R*C - r_int*c_int) target words; tile_inverse int32 [1024]: element dk*64 + dn ->
        packed position of a tile."""
        rows = out.shape[1]
        cols = out.shape[2]
        edge = rows * cols - r_int * c_int
        row_part = (rows - r_int) * cols  # the rows below the whole-tile part, every column
        start = cuda.grid(1)
        stride = cuda.gridsize(1)
        for t in range(start, out.shape[0] * edge, stride):
            e = t // edge
            i = t - e * edge
            if i < row_part:
                r = r_int + i // cols
                c = i - (i // cols) * cols
            else:
                j = i - row_part
                r = j // (cols - c_int)
                c = c_int + j - r * (cols - c_int)
            word = uint32(0)
            for f in range(per_word):
                if to_awq:
                    k = r
                    n = (c << log_pf) + ((f & (half_pf - 1)) << 1) + (f >> (log_pf - 1))  # c*pf + AWQ_ORDER[f]
                elif row_major:
                    k = 4 * c + f
                    n = r
                else:
                    k = r * pf + f
                    n = c
                p = tile_inverse[((k & 15) << 6) + (n & 63)]
                mw = marlin[e, k >> 4, (n >> 6) * wpt + (p >> log_pf)]
                code = uint32(mw >> uint32((p & (pf - 1)) * bits)) & uint32(mask)
                word = word | uint32(code << uint32(f * bits))
            out[e, r, c] = word

    return edge_unpack


@functools.lru_cache(maxsize=None)
def _edge_repack_kernel(bits: int, source: str):
    return jit(edge_repack_kernel_source(bits, source))


@functools.lru_cache(maxsize=None)
def _edge_unpack_kernel(bits: int, target: str):
    return jit(edge_unpack_kernel_source(bits, target))


def _tile_map(arrays: Arrays, bits: int, inverse: bool):
    perm = tile_permutation(bits)
    table = np.argsort(perm) if inverse else perm
    return arrays.take(np.ascontiguousarray(table, dtype=np.int32), "tile_map")


def launch_edge_repack(arrays: Arrays, src, perm, out, bits: int, source: str, size_k: int, size_n: int) -> None:
    """The edge tiles of ``out`` (nothing when K and N are whole tiles)."""
    kt_full, nt_full = size_k // TILE_K, size_n // TILE_N
    kt_pad, nt_pad = padded_k(size_k) // TILE_K, padded_n(size_n) // TILE_N
    tiles = kt_pad * nt_pad - kt_full * nt_full
    if not tiles:
        return
    wpt = TILE_K * TILE_N * bits // 32
    no_perm = perm if perm is not None else _tile_map(arrays, bits, False).reshape((1, TILE_K * TILE_N))
    grid = (-(-tiles * wpt // EDGE_THREADS), 1, src.shape[0])
    _edge_repack_kernel(bits, source)[grid, EDGE_THREADS, arrays.stream](src, no_perm, _tile_map(arrays, bits, False),
                                                                        out, size_k, size_n, kt_full, nt_full)


def whole_tile_target(target: str, size_k: int, size_n: int, bits: int) -> tuple[int, int]:
    """(rows, columns) of the part of a checkpoint target array the whole-tile kernels write."""
    k_full, n_full = size_k // TILE_K * TILE_K, size_n // TILE_N * TILE_N
    pf = 32 // bits
    if target == "gptq":
        return k_full // pf, n_full
    if target == "awq":
        return k_full, n_full // pf
    return n_full, k_full // 4


def launch_edge_unpack(arrays: Arrays, marlin, out, bits: int, target: str, size_k: int, size_n: int) -> None:
    """The words of ``out`` outside its whole-tile part (nothing when K and N are whole tiles)."""
    r_int, c_int = whole_tile_target(target, size_k, size_n, bits)
    edge = out.shape[1] * out.shape[2] - r_int * c_int
    if not edge:
        return
    _edge_unpack_kernel(bits, target)[_grid_stride(out.shape[0] * edge), THREADS, arrays.stream](
        marlin, _tile_map(arrays, bits, True), out, r_int, c_int)


def _perm_name(e: int, experts: int) -> str:
    return f"perm[{e}]" if experts > 1 else "perm"


def _take_perm(arrays: Arrays, perm, size_k: int, experts: int):
    """None / empty -> (None, no-op). Else (int32 device array [E, K], verdict): ``verdict()`` raises ValueError
    unless every row is a permutation of range(K), with the message of the host check.

    A host perm is checked here, on its own values (any integer width, before the cast to int32, so nothing can
    wrap into range). A device perm is checked on the device (check_perm_kernel_source): nothing K-sized comes
    back; the wrapper calls ``verdict()`` after its launches and before it returns the result. The kernels read
    rows through perm_row, so even an unchecked perm cannot make them read out of bounds.
    """
    if perm is None or int(np.prod(perm.shape)) == 0:
        return None, lambda: None
    require_native_byte_order(perm, "perm")
    on_device = is_device_array(perm)
    if np.dtype(perm.dtype).kind not in "iu" or (on_device and np.dtype(perm.dtype) != np.dtype(np.int32)):
        raise TypeError(f"perm must have dtype int32, got {perm.dtype}")
    shape = tuple(perm.shape)
    if shape == (size_k,) and experts == 1:
        shape = (1, size_k)
    if shape != (experts, size_k):
        raise ValueError(f"perm has shape {tuple(perm.shape)}, expected ({size_k},) for one matrix or "
                         f"({experts}, {size_k}) for {experts} stacked experts")
    if not on_device:
        values = np.asarray(perm).reshape(shape)
        for e in range(experts):
            check_permutation_values(values[e], size_k, _perm_name(e, experts))
        return arrays.take(values.astype(np.int32), "perm"), lambda: None
    perm_d = arrays.take(perm, "perm").reshape(shape)
    seen = arrays.empty(shape, np.int32)
    blocks = _grid_stride(experts * size_k)
    _zero_fill_kernel()[blocks, THREADS, arrays.stream](seen)
    verdict = arrays.take(np.array([PERM_OK, 0, PERM_OK, 0], np.int64), "verdict")
    _check_perm_kernel()[blocks, THREADS, arrays.stream](perm_d, seen, verdict)

    def raise_if_not_a_permutation():
        host = copy_to_host_checked(verdict, arrays.stream)
        if host[0] != PERM_OK:
            e, k = divmod(int(host[0]), size_k)
            value = int(copy_to_host_checked(perm_d[e, k:k + 1], arrays.stream)[0])
            name = _perm_name(e, experts)
            raise ValueError(permutation_message(name, size_k, f"{name}[{k}] = {value} is outside [0, {size_k})"))
        if host[2] != PERM_OK:
            e, v = divmod(int(host[2]), size_k)
            count = int(copy_to_host_checked(seen[e, v:v + 1], arrays.stream)[0])
            raise ValueError(permutation_message(_perm_name(e, experts), size_k, f"{v} appears {count} times"))

    return perm_d, raise_if_not_a_permutation


def gptq_marlin_repack(b_q_weight, perm, size_k: int, size_n: int, num_bits: int, *, stream=None,
                       policy: RepackPolicy | None = None):
    """GPTQ qweight int32 [K/pf, N] (or [E, K/pf, N]) -> Marlin int32 [K/16, N*16/pf] (or [E, ...]).

    ``perm`` (int32 [K] or [E, K], or None/empty): Marlin row k takes checkpoint row perm[k] (act-order). With a
    perm, one matrix is repacked in two passes through a temporary N-packed copy of the layer (K*N/pf words, the
    size of ``b_q_weight``, freed on return); stacked experts [E, ...] use the one-pass gather kernel (one launch,
    no temporary), so peak extra device memory stays below one expert's input there.
    """
    size_k, size_n, num_bits = _check_sizes(size_k, size_n, num_bits, "gptq")
    pf = 32 // num_bits
    arrays = Arrays(stream)
    src, stacked = _as_3d(arrays.take(b_q_weight, "b_q_weight", np.uint32), "b_q_weight", size_k // pf, size_n)
    perm_d, verdict = _take_perm(arrays, perm, size_k, src.shape[0])
    has_perm = perm_d is not None
    result = _launch_repack(arrays, src, perm_d, num_bits, "gptq_perm" if has_perm else "gptq", size_k, size_n,
                            stacked, policy)
    verdict()
    return result


def awq_marlin_repack(b_q_weight, size_k: int, size_n: int, num_bits: int, *, stream=None,
                      policy: RepackPolicy | None = None):
    """AWQ qweight int32 [K, N/pf] (or [E, K, N/pf]) -> Marlin int32 [K/16, N*16/pf] (or [E, ...])."""
    size_k, size_n, num_bits = _check_sizes(size_k, size_n, num_bits, "awq")
    pf = 32 // num_bits
    arrays = Arrays(stream)
    src, stacked = _as_3d(arrays.take(b_q_weight, "b_q_weight", np.uint32), "b_q_weight", size_k, size_n // pf)
    return _launch_repack(arrays, src, None, num_bits, "awq", size_k, size_n, stacked, policy)


def fp8_marlin_repack_raw_bits(raw_bits_k_major, size_k: int, size_n: int, *, stream=None):
    """E4M3 bytes packed K-major, int32/uint32 [K/4, N] (or [E, K/4, N]) -> Marlin W8 int32 [K/16, 4N]."""
    size_k, size_n, _ = _check_sizes(size_k, size_n, 8, "gptq")
    arrays = Arrays(stream)
    src, stacked = _as_3d(arrays.take(raw_bits_k_major, "raw_bits_k_major", np.uint32), "raw_bits_k_major",
                          size_k // 4, size_n)
    return _launch_repack(arrays, src, None, 8, "gptq", size_k, size_n, stacked)


def block_fp8_group128_repack(row_major, size_k: int, size_n: int, *, stream=None):
    """Row-major E4M3 bytes uint8 [N, K] (or [E, N, K]) -> Marlin W8 int32 [K/16, 4N], transpose fused."""
    size_k, size_n, _ = _check_sizes(size_k, size_n, 8, "row_major_bytes")
    arrays = Arrays(stream)
    if not is_device_array(row_major) and np.dtype(row_major.dtype) == np.dtype(E4M3):
        row_major = np.asarray(row_major).view(np.uint8)  # the same bytes, in a dtype the device copy keeps
    d = arrays.take(row_major, "row_major", None)
    if np.dtype(d.dtype).itemsize != 1:
        raise TypeError(f"row_major must hold raw E4M3 bytes (uint8 or float8_e4m3fn), got {d.dtype}")
    d = d.view(np.uint8)
    shape = tuple(d.shape)
    if shape[-2:] != (size_n, size_k) or len(shape) not in (2, 3):
        raise ValueError(f"row_major has shape {shape}, expected ({size_n}, {size_k}) = (size_n, size_k)"
                         f" or (experts, {size_n}, {size_k})")
    stacked = len(shape) == 3
    words = d.reshape((shape[0] if stacked else 1, size_n, size_k)).view(np.uint32)  # [E, N, K/4]
    return _launch_repack(arrays, words, None, 8, "row_major_bytes", size_k, size_n, stacked)


def _grid_stride(total: int) -> int:
    return max(1, min(132 * 16, -(-total // THREADS)))


def unpack_shape(target: str, size_k: int, size_n: int, bits: int, experts: int) -> tuple:
    """Shape of the uint32 output [E, ...] of the inverse repack to ``target`` (row-major FP8: [E, N, K/4] words)."""
    pf = 32 // bits
    if target == "gptq":
        return (experts, size_k // pf, size_n)
    if target == "awq":
        return (experts, size_k, size_n // pf)
    if target == "row_major_bytes":
        return (experts, size_n, size_k // 4)
    raise ValueError(f"unpack target {target!r} is not one of 'gptq', 'awq', 'row_major_bytes'")


def weight_unpack_launch(src, out, bits: int, target: str, size_k: int, size_n: int, stream,
                         policy: RepackPolicy | None = None):
    """The kernel and grid the wrappers use for one (stacked) inverse repack Marlin [E, K/16, N*16/pf] -> ``out``
    (uint32, unpack_shape), as a zero-argument launch, so that the benchmark times exactly what the wrappers run.
    AWQ goes through the direct AWQ unpack (8-byte stores, transpose, n-fastest grid where it fits), row-major FP8
    through the inverse transpose tile, 8-bit GPTQ / FP8 raw bits through the paired kernel, 4-bit GPTQ through the
    direct unpack. Rows come out in Marlin order (an act-order perm is undone by the caller)."""
    p = policy or _policy
    experts = src.shape[0]
    if target == "awq":
        nfast = p.awq_unpack_n_fastest and grid_n_fastest_fits(size_k)
        grid = awq_grid(size_k, size_n, bits, experts, 1, DIRECT_THREADS, nfast)
        kernel = _awq_direct_unpack_kernel(bits, p.awq_unpack_wide_stores, nfast)
        target_words = out.view(np.uint64) if p.awq_unpack_wide_stores else out  # N/pf is even (N % 64 == 0)
        return lambda: kernel[grid, DIRECT_THREADS, stream](src, target_words, size_n)
    if target == "row_major_bytes":
        kernel = _transpose_repack_kernel(True)
        grid = transpose_grid(size_k, size_n, experts)
        return lambda: kernel[grid, TRANSPOSE_THREADS, stream](src, out, size_n)
    if bits == 8 and p.paired_unpack_8bit:
        ktpt = p.paired_unpack_k_tiles_per_thread
        kernel = _paired_unpack_8bit_kernel(ktpt)
        grid = paired_unpack_grid(size_k, size_n, experts, ktpt)
        out64 = out.view(np.uint64)  # two GPTQ columns per 8-byte store
        return lambda: kernel[grid, DIRECT_THREADS, stream](src, out64, size_n)
    ktpt = p.per_bits("direct_unpack_k_tiles_per_thread", bits)
    kernel = _direct_unpack_kernel(bits, target, ktpt)
    grid = direct_grid(size_k, size_n, bits, experts, ktpt)
    return lambda: kernel[grid, DIRECT_THREADS, stream](src, out, size_n)


def _launch_unpack(qweight, size_k: int, size_n: int, bits: int, target: str, stream, perm=None,
                   policy: RepackPolicy | None = None):
    size_k, size_n, bits = _check_sizes(size_k, size_n, bits, target)
    pf = 32 // bits
    arrays = Arrays(stream)
    src, stacked = _as_3d(arrays.take(qweight, "qweight", np.uint32), "qweight", padded_k(size_k) // TILE_K,
                          padded_n(size_n) * TILE_K // pf)
    experts = src.shape[0]
    shape = unpack_shape(target, size_k, size_n, bits, experts)
    perm_d, verdict = _take_perm(arrays, perm, size_k, experts) if target == "gptq" else (None, lambda: None)
    out = arrays.empty(shape, np.uint32)
    k_full, n_full = size_k // TILE_K * TILE_K, size_n // TILE_N * TILE_N
    if (k_full, n_full) == (size_k, size_n):
        weight_unpack_launch(src, out, bits, target, size_k, size_n, arrays.stream, policy)()
    elif k_full and n_full:
        # whole tiles by the kernels above (8-byte stores only where the row holds whole 8-byte words), the rest
        # by the edge kernel
        p = policy or _policy
        if shape[2] % 2:
            p = dataclasses.replace(p, paired_unpack_8bit=False, awq_unpack_wide_stores=False)
        for e, _, view in _whole_tile_rows(arrays, src, None, k_full // TILE_K):
            e_out = out if e is None else out[e].reshape((1,) + shape[1:])
            weight_unpack_launch(view, e_out, bits, target, k_full, n_full, arrays.stream, p)()
    launch_edge_unpack(arrays, src, out, bits, target, size_k, size_n)
    if perm_d is not None:  # rows come out in Marlin order; put row perm[k] back at checkpoint row perm[k]
        inverse_perm = arrays.empty(perm_d.shape, np.int32)
        _invert_perm_kernel()[_grid_stride(experts * size_k), THREADS, arrays.stream](perm_d, inverse_perm)
        ordered = arrays.empty(shape, np.uint32)
        _gather_rows_kernel(bits)[_grid_stride(int(np.prod(shape))), THREADS, arrays.stream](out, inverse_perm,
                                                                                              ordered)
        out = ordered
    if target == "row_major_bytes":
        out = out.view(np.uint8)
        return arrays.give(out if stacked else out.reshape((size_n, size_k)))
    result = arrays.give(out if stacked else out.reshape(shape[1:]), np.int32)
    verdict()
    return result


def marlin_to_gptq_qweight(qweight, perm, size_k: int, size_n: int, num_bits: int, *, stream=None,
                           policy: RepackPolicy | None = None):
    """Inverse of gptq_marlin_repack: Marlin int32 [K/16, N*16/pf] -> GPTQ int32 [K/pf, N] (perm undone if given)."""
    return _launch_unpack(qweight, size_k, size_n, num_bits, "gptq", stream, perm, policy)


def marlin_to_awq_qweight(qweight, size_k: int, size_n: int, num_bits: int, *, stream=None,
                          policy: RepackPolicy | None = None):
    """Inverse of awq_marlin_repack: Marlin int32 [K/16, N*16/pf] -> AWQ int32 [K, N/pf]."""
    return _launch_unpack(qweight, size_k, size_n, num_bits, "awq", stream, policy=policy)


def marlin_to_fp8_raw_bits(qweight, size_k: int, size_n: int, *, stream=None, policy: RepackPolicy | None = None):
    """Inverse of fp8_marlin_repack_raw_bits: Marlin int32 [K/16, 4N] -> K-major words int32 [K/4, N]."""
    return _launch_unpack(qweight, size_k, size_n, 8, "gptq", stream, policy=policy)


def marlin_to_block_fp8_row_major(qweight, size_k: int, size_n: int, *, stream=None,
                                  policy: RepackPolicy | None = None):
    """Inverse of block_fp8_group128_repack: Marlin int32 [K/16, 4N] -> row-major bytes uint8 [N, K]."""
    return _launch_unpack(qweight, size_k, size_n, 8, "row_major_bytes", stream, policy=policy)


install_deprecated_globals(__name__, REPACK_GLOBALS, "workbench.policy.DEFAULT_REPACK_POLICY", "_policy")
