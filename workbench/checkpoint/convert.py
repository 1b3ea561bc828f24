"""One layer, source layout <-> Marlin layout, through ``workbench.ops``.

``to_marlin`` reads a layer's source tensors (one expert at a time for stacks) and returns the Marlin tensors;
``compare_with_source`` goes the other way for ``verify``: it takes Marlin tensors back to the source layout with the
inverse ops and compares them bit for bit with what the checkpoint holds, naming the first differing element. On the
host, ``to_marlin`` runs the forward ops' compiled loops (``workbench.host_repack``, the ops' ``"cpu"`` backend);
``compare_with_source`` always runs the NumPy reference inverses, so ``verify`` checks those loops independently.

Per source format (codes are the unsigned stored values; b = bits, pf = 32 / b):

| format | weight route | zero points |
|---|---|---|
| GPTQ v1 / v2 | ``qweight`` -> ``gptq_marlin_repack`` (with ``perm`` for act-order) | v1 stores ``zero - 1``: symmetric = every field 2^(b-1) - 1; asymmetric -> +1 -> ``marlin_zero_points`` (an all-ones field is an error); v2 stores the zero |
| AWQ | ``qweight`` -> ``awq_marlin_repack`` | ``awq_to_marlin_zero_points`` |
| compressed-tensors | ``weight_packed`` [N, K/pf] is GPTQ's [K/pf, N] transposed (same field order; code = q + 2^(b-1) = u4b8/u8b128 code) -> ``gptq_marlin_repack`` | ``weight_zero_point`` [N/pf, ng] packed along N with the same offset -> codes -> ``marlin_zero_points`` |
| block-FP8 | E4M3 bytes [N, K] -> ``block_fp8_group128_repack`` | none; ``block_fp8_group128_scales`` folds 2^8 into fp16 scales |
| NVFP4, MXFP4, MXFP8 | ``workbench/checkpoint/microscale.py`` | none |
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from workbench import ops
from workbench.checkpoint import microscale
from workbench.checkpoint.layers import LayerSpec, Part
from workbench.checkpoint.safetensors_io import CheckpointError
from workbench.checkpoint.settings import AWQ, CT, FP8, GPTQ, GPTQ_V2
from workbench.checkpoint.source import SourceCheckpoint
from workbench.formats import packing
from workbench.formats._checks import padded_k, padded_n, require_dtype
from workbench.formats.gptq import sort_g_idx
from workbench.formats.marlin_tile import describe_position, marlin_unpack_padded_codes, nonzero_padding
from workbench.formats.scales import marlin_zero_points_to_padded_codes

NO_PERM = np.empty(0, dtype=np.int32)  # vLLM passes an empty tensor for "no act-order"


@dataclass
class MarlinTensors:
    """One layer (or one expert of a stack) in Marlin layout."""

    qweight: np.ndarray  # (K_pad/16, N_pad*16/pf) int32 (docs/formats.md, "Shapes that are not tile multiples")
    scales: np.ndarray  # (ng, N_pad) act_dtype, permuted
    zeros: np.ndarray | None  # (ng, N_pad/pf) int32
    g_idx: np.ndarray | None  # (K,) int32, sorted
    perm: np.ndarray | None  # (K,) int32
    extra: dict = field(default_factory=dict)  # suffix -> tensor of the layer's extra_marlin_tensors (global_scale)


# ---------------------------------------------------------------------------------------------------------------
# checks on source values (the shapes were checked by layers.discover)
# ---------------------------------------------------------------------------------------------------------------
def _read_g_idx(src: SourceCheckpoint, spec: LayerSpec, part: Part, role: str) -> np.ndarray | None:
    """The act-order g_idx (validated), or None; without act-order a stored g_idx must be the trivial k // G."""
    name = part.tensors.get(role)
    if name is None:
        return None
    g_idx = src.read(name).astype(np.int64)
    ng, k = part.num_groups, part.size_k
    if not spec.act_order:
        trivial = np.zeros(k, np.int64) if spec.group_size == -1 else np.arange(k) // spec.group_size
        bad = np.flatnonzero(g_idx != trivial)
        if bad.size:
            i = int(bad[0])
            raise CheckpointError(f"{src.describe(name)}: g_idx[{i}] = {g_idx[i]} but act-order is off, so it should"
                                  f" be {trivial[i]} (k // group_size); the settings contradict the tensor")
        return None
    if g_idx.min() < 0 or g_idx.max() >= ng:
        raise CheckpointError(f"{src.describe(name)}: values in [{g_idx.min()}, {g_idx.max()}] outside the"
                              f" {ng} groups [0, {ng})")
    counts = np.bincount(g_idx, minlength=ng)
    expected = np.minimum(spec.group_size, k - spec.group_size * np.arange(ng))  # the last group may be partial
    if np.any(counts != expected):
        g = int(np.flatnonzero(counts != expected)[0])
        raise CheckpointError(f"{src.describe(name)}: group {g} has {counts[g]} rows, expected {expected[g]}"
                              f" (every act-order group holds group_size = {spec.group_size} rows, the last one the"
                              " rest of K)")
    return g_idx.astype(np.int32)


def _zero_codes(src: SourceCheckpoint, spec: LayerSpec, part: Part) -> np.ndarray | None:
    """Actual zero points [ng, N] uint8 of a GPTQ / compressed-tensors part, or None when symmetric."""
    bits, fmt = spec.bits, spec.source_format
    if fmt in (GPTQ, GPTQ_V2):
        name = part.tensors["qzeros"]
        stored = packing.unpack_cols(src.read(name), bits)  # (ng, N)
        if fmt == GPTQ:
            top = (1 << bits) - 1
            bad = np.argwhere(stored == top)
            if bad.size and spec.weight_type.has_zero_points:
                g, n = (int(v) for v in bad[0])
                raise CheckpointError(
                    f"{src.describe(name)}: group {g}, column {n} (word {n // (32 // bits)}, field {n % (32 // bits)})"
                    f" stores {top}; GPTQ v1 stores zero - 1, so the zero point would be {top + 1}, outside"
                    f" {bits} bits ({len(bad)} such fields)"
                )
            zeros = stored + np.uint8(1) if spec.weight_type.has_zero_points else stored
            sym_stored = (1 << (bits - 1)) - 1
        else:
            zeros, sym_stored = stored, 1 << (bits - 1)
        if spec.weight_type.has_zero_points:
            return zeros
        bad = np.argwhere(stored != sym_stored)
        if bad.size:
            g, n = (int(v) for v in bad[0])
            raise CheckpointError(
                f"{src.describe(name)}: group {g}, column {n} stores {stored[g, n]}, but sym = true needs every"
                f" stored zero = {sym_stored} ({fmt}: {'zero - 1' if fmt == GPTQ else 'zero'} with zero"
                f" {1 << (bits - 1)}); set sym = false or fix the checkpoint"
            )
        return None
    if fmt == CT and spec.weight_type.has_zero_points:
        packed = src.read(part.tensors["weight_zero_point"])  # (ceil(N/pf), ng), packed along N
        return np.ascontiguousarray(packing.unpack_rows(packed, bits)[: part.size_n].T)  # (ng, N)
    return None


WEIGHT_ROLE = {GPTQ: "qweight", GPTQ_V2: "qweight", AWQ: "qweight", CT: "weight_packed", FP8: "weight"}
SCALE_ROLE = {GPTQ: "scales", GPTQ_V2: "scales", AWQ: "scales", CT: "weight_scale", FP8: "weight_scale_inv"}


def nonfinite_scales(src: SourceCheckpoint, spec: LayerSpec) -> list[str]:
    """A warning when a layer's scales hold NaN or Inf (the ops take any float, but such a scale turns a whole group
    of outputs into NaN): one line per layer however many experts, naming the first such scale and the count.
    Microscaled scales are codes: the conversion refuses a NaN code by position instead."""
    if spec.microscale:
        return []
    found, first = 0, None
    for segs in spec.parts:
        for part in segs:
            name = part.tensors[SCALE_ROLE[spec.source_format]]
            scales = src.read(name).astype(np.float32)
            bad = ~np.isfinite(scales)
            count = int(np.count_nonzero(bad))
            if count:
                found += count
                if first is None:
                    index = tuple(int(v) for v in np.unravel_index(int(np.argmax(bad)), bad.shape))
                    first = f"{src.describe(name)}: scale{list(index)} = {scales[index]}"
    if not found:
        return []
    return [f"{first}; {found} NaN/Inf scale(s) in layer {spec.name!r}: the outputs of those groups will be NaN/Inf"]


def _codes_of(fmt: str, stored, bits: int, size_k: int) -> np.ndarray:
    """(K, w) uint8 codes of a weight tensor (or a column block of it) as the checkpoint stores it (FP8: bytes)."""
    if fmt in (GPTQ, GPTQ_V2):
        return packing.unpack_rows(stored, bits)
    if fmt == AWQ:
        return packing.awq_unpack(stored, bits)
    if fmt == CT:
        return packing.unpack_rows(np.ascontiguousarray(stored.T), bits)[:size_k]
    return np.ascontiguousarray(stored.view(np.uint8).T)


def _source_codes(src: SourceCheckpoint, spec: LayerSpec, part: Part) -> np.ndarray:
    """(K, N) uint8 codes of a part in checkpoint row order (FP8: raw bytes)."""
    return _codes_of(spec.source_format, src.read(part.tensors[WEIGHT_ROLE[spec.source_format]]), spec.bits,
                     part.size_k)


# ---------------------------------------------------------------------------------------------------------------
# source -> Marlin
# ---------------------------------------------------------------------------------------------------------------
# Columns converted per op call. Marlin row r holds k-tile r's N/64 tiles in column order and the scale / zero-point
# permutations act within 64-column chunks, so a block of columns (a multiple of 64, and of 128 for block-FP8 scale
# rows) converts independently into the matching column block of every Marlin tensor. Converting in blocks bounds the
# ops' temporaries (the NumPy references expand codes to uint32 fields, 8x a 4-bit qweight) by the block size instead
# of the layer size, so peak memory stays near source tensor + output tensor.
COLUMN_BLOCK = 1024


def _part_to_marlin(src: SourceCheckpoint, spec: LayerSpec, part: Part, perm, backend: str,
                    column_block: int | None = None, stream=None):
    k, n, g, bits, fmt = part.size_k, part.size_n, spec.group_size, spec.bits, spec.source_format
    pf = 32 // bits
    p = NO_PERM if perm is None else perm
    block = column_block or COLUMN_BLOCK
    if block % 64:
        raise ValueError(f"column_block = {block} is not a multiple of 64 (Marlin tile width)")
    if fmt == FP8:
        block = -(-block // 128) * 128  # block-FP8 scale rows cover 128 columns each
    t = part.tensors
    if fmt == FP8:
        row_major = src.read(t["weight"]).view(np.uint8)  # (N, K) E4M3 bytes
        inv = src.read(t["weight_scale_inv"])  # (ceil(N/128), K/128)
    elif fmt == AWQ:
        awq_q, awq_z = src.read(t["qweight"]), src.read(t["qzeros"])  # (K, N/pf), (ng, N/pf)
        scales_src = src.read(t["scales"])
    else:
        if fmt == CT:
            packed_nk = src.read(t["weight_packed"])  # (N, K/pf): GPTQ's layout transposed
            scales_src = np.ascontiguousarray(src.read(t["weight_scale"]).T)  # (ng, N)
        else:
            gptq_q = src.read(t["qweight"])  # (K/pf, N)
            scales_src = src.read(t["scales"])
        zero_codes = _zero_codes(src, spec, part)  # (ng, N) or None
    # padded Marlin tensors; a block of w source columns fills padded_n(w) Marlin columns (only the last is short)
    qweight = np.empty((padded_k(k) // 16, padded_n(n) * 16 // pf), np.int32)  # (K_pad/16, N_pad*16/pf)
    scales = np.empty((part.num_groups, padded_n(n)), spec.act_dtype)  # (ng, N_pad)
    zeros = np.empty((part.num_groups, padded_n(n) // pf), np.int32) if spec.weight_type.has_zero_points else None
    for n0 in range(0, n, block):
        n1 = min(n, n0 + block)
        w, e1 = n1 - n0, n0 + padded_n(n1 - n0)
        q_cols, z_cols, m_cols, mz_cols = (slice(n0 * 16 // pf, e1 * 16 // pf), slice(n0 // pf, n1 // pf),
                                           slice(n0, e1), slice(n0 // pf, e1 // pf))
        if fmt == FP8:
            qweight[:, q_cols] = ops.block_fp8_group128_repack(np.ascontiguousarray(row_major[n0:n1]), k, w,
                                                               backend=backend, stream=stream)
            inv_rows = np.ascontiguousarray(inv[n0 // 128: -(-n1 // 128)])
            scales[:, m_cols] = ops.block_fp8_group128_scales(inv_rows, k, w, spec.act_dtype, backend=backend,
                                                              stream=stream)
            continue
        scales[:, m_cols] = ops.marlin_permute_scales(np.ascontiguousarray(scales_src[:, n0:n1]), k, w, g,
                                                     backend=backend, stream=stream)
        if fmt == AWQ:
            qweight[:, q_cols] = ops.awq_marlin_repack(np.ascontiguousarray(awq_q[:, z_cols]), k, w, bits,
                                                       backend=backend, stream=stream)
            zeros[:, mz_cols] = ops.awq_to_marlin_zero_points(np.ascontiguousarray(awq_z[:, z_cols]), k, w, bits,
                                                              backend=backend, stream=stream)
            continue
        cols = np.ascontiguousarray(packed_nk[n0:n1].T if fmt == CT else gptq_q[:, n0:n1])  # (K/pf, w)
        qweight[:, q_cols] = ops.gptq_marlin_repack(cols, p, k, w, bits, backend=backend, stream=stream)
        if zeros is not None:
            zeros[:, mz_cols] = ops.marlin_zero_points(np.ascontiguousarray(zero_codes[:, n0:n1]), k, w, bits,
                                                       backend=backend, stream=stream)
    return qweight, scales, zeros


# The host conversion (backend "cpu", the CPU path's default) runs the ops' "cpu" loops (workbench.host_repack):
# bit for bit the NumPy reference (tests/cpu/test_host_repack.py), one pass over each source tensor, written
# straight into the layer's Marlin tensors (each segment into its columns: no per-block results, no concatenation),
# reading transposed sources (compressed-tensors, block-FP8) through views. ``verify`` still takes the result back
# with the reference inverses. Backend "numpy" runs the reference ops themselves, column block by column block.
# (host_repack is imported on first use: it loads Numba and its compiled loops, which a command that converts
# nothing should not pay for; the pipeline's forkserver preloads it for its workers.)
HOST_BACKENDS = ("cpu",)


def _marlin_tensors_host(src: SourceCheckpoint, spec: LayerSpec, segments: list[Part], perm):
    """(qweight, scales, zeros) of a layer's segments fused along N, each converted into its column range."""
    bits, pf = spec.bits, 32 // spec.bits
    k, ng = segments[0].size_k, segments[0].num_groups
    ends = np.cumsum([0] + [padded_n(part.size_n) for part in segments])  # Marlin columns of each segment
    qweight = np.empty((padded_k(k) // 16, int(ends[-1]) * 16 // pf), np.int32)  # (K_pad/16, N_pad*16/pf)
    scales = np.empty((ng, int(ends[-1])), spec.act_dtype)  # (ng, N_pad)
    zeros = np.empty((ng, int(ends[-1]) // pf), np.int32) if spec.weight_type.has_zero_points else None
    for part, c0, c1 in zip(segments, ends[:-1], ends[1:]):
        z = None if zeros is None else zeros[:, c0 // pf: c1 // pf]
        _part_to_marlin_host(src, spec, part, perm, qweight[:, c0 * 16 // pf: c1 * 16 // pf], scales[:, c0:c1], z)
    return qweight, scales, zeros


def _part_to_marlin_host(src: SourceCheckpoint, spec: LayerSpec, part: Part, perm, q_out, s_out, z_out) -> None:
    from workbench import host_repack

    k, n, g, bits, fmt, t = part.size_k, part.size_n, spec.group_size, spec.bits, spec.source_format, part.tensors
    if fmt == FP8:
        host_repack.block_fp8_group128_repack(src.read(t["weight"]), k, n, out=q_out)  # (N, K) E4M3 bytes
        host_repack.block_fp8_group128_scales(src.read(t["weight_scale_inv"]), k, n, spec.act_dtype, out=s_out)
        return
    if fmt == AWQ:
        host_repack.awq_marlin_repack(src.read(t["qweight"]), k, n, bits, out=q_out)  # (K, N/pf)
        host_repack.awq_to_marlin_zero_points(src.read(t["qzeros"]), k, n, bits, out=z_out)  # (ng, N/pf)
        scales_src = src.read(t["scales"])  # (ng, N)
    elif fmt == CT:
        host_repack.gptq_marlin_repack(src.read(t["weight_packed"]).T, perm, k, n, bits, out=q_out)  # (N, K/pf).T
        scales_src = src.read(t["weight_scale"]).T  # (N, ng).T
    else:
        host_repack.gptq_marlin_repack(src.read(t["qweight"]), perm, k, n, bits, out=q_out)  # (K/pf, N)
        scales_src = src.read(t["scales"])  # (ng, N)
    if fmt != AWQ:
        zero_codes = _zero_codes(src, spec, part)  # (ng, N) or None; checks the stored zeros either way
        if zero_codes is not None:
            host_repack.marlin_zero_points(zero_codes, k, n, bits, out=z_out)
    require_dtype(scales_src, ops.SCALE_DTYPES, t[SCALE_ROLE[fmt]])
    # the reference permutes the stored dtype and rounds into act_dtype on assignment: rounding first is the same
    host_repack.marlin_permute_scales(scales_src.astype(spec.act_dtype, copy=False), k, n, g, out=s_out)


def _layer_g_idx(src: SourceCheckpoint, spec: LayerSpec, segments: list[Part]) -> np.ndarray | None:
    """The act-order g_idx shared by all N segments (gate and up must agree to share one perm)."""
    role = "weight_g_idx" if spec.source_format == CT else "g_idx"
    first = None
    for part in segments:
        g_idx = _read_g_idx(src, spec, part, role)
        if first is None:
            first = (part, g_idx)
        elif g_idx is not None and not np.array_equal(g_idx, first[1]):
            i = int(np.flatnonzero(g_idx != first[1])[0])
            raise CheckpointError(
                f"{spec.name}: {part.tensors[role]}[{i}] = {g_idx[i]} but {first[0].tensors[role]}[{i}] ="
                f" {first[1][i]}; fused projections need one act-order permutation"
            )
    return None if first is None else first[1]


def to_marlin(src: SourceCheckpoint, spec: LayerSpec, expert: int, backend: str,
              column_block: int | None = None, stream=None) -> MarlinTensors:
    """Marlin tensors of dense layer ``spec`` (expert = 0) or of one expert of a stack; segments fused along N.
    On the host (``HOST_BACKENDS``) through the ops' compiled "cpu" loops, whole tensors at a time (``column_block``
    is for the other backends). ``stream``: where the ops' copies and kernels go (backend numba; None = the current
    stream), so that two converter threads with a stream each overlap. (The microscaled formats take the current
    stream.)"""
    if spec.microscale:
        return microscale.to_marlin(src, spec, expert, backend, column_block)
    segments = spec.parts[expert]
    g_idx_ckpt = _layer_g_idx(src, spec, segments) if spec.source_format != FP8 else None
    g_idx = perm = None
    if spec.act_order:
        g_idx, perm = sort_g_idx(g_idx_ckpt)
    if backend in HOST_BACKENDS:
        return MarlinTensors(*_marlin_tensors_host(src, spec, segments, perm), g_idx, perm)
    pieces = [_part_to_marlin(src, spec, part, perm, backend, column_block, stream) for part in segments]
    if len(pieces) == 1:
        qweight, scales, zeros = pieces[0]
    else:
        # Marlin row r holds k-tile r's N/64 tiles in column order, scales/zero points permute within 64-column
        # chunks: so fusing along N is a concatenation of each Marlin tensor's columns.
        qweight = np.concatenate([q for q, _, _ in pieces], axis=1)
        scales = np.concatenate([s for _, s, _ in pieces], axis=1)
        zeros = None if pieces[0][2] is None else np.concatenate([z for _, _, z in pieces], axis=1)
    return MarlinTensors(qweight, scales, zeros, g_idx, perm)


class NotOnDevice(Exception):
    """``to_marlin_device`` does not convert this layer (the caller takes ``to_marlin``)."""


def device_conversion(spec: LayerSpec) -> bool:
    """Whether ``to_marlin_device`` converts this layer: block-FP8 and GPTQ (v1 / v2) without act-order, the
    checkpoints the GPU path meets most (DeepSeek-V3's experts, GPTQ models); the other formats take ``to_marlin``."""
    return not spec.microscale and (spec.source_format == FP8 or
                                    spec.source_format in (GPTQ, GPTQ_V2) and not spec.act_order)


def to_marlin_device(src: SourceCheckpoint, spec: LayerSpec, expert: int, upload, stream,
                     backend: str = "numba") -> MarlinTensors:
    """``to_marlin`` with the Marlin tensors left on the device (CuPy arrays, raw words: the 16-bit scales as
    their bits): the caller copies them into page-locked memory and writes them from there, so the results never
    take the pageable copy back, nor the copy into the layer's host array. ``upload(host array)`` puts a source
    tensor on the device (on ``stream``, from the page-locked staging). The values checked on the host by
    ``to_marlin`` (g_idx, zero points) are checked here the same way, with the same messages."""
    if not device_conversion(spec):
        raise NotOnDevice(f"{spec.name}: {spec.source_format} is not converted on the device by to_marlin_device")
    segments = spec.parts[expert]
    fmt, bits, g = spec.source_format, spec.bits, spec.group_size
    if fmt != FP8:
        _layer_g_idx(src, spec, segments)  # without act-order a stored g_idx must be the trivial k // G
    pieces = []
    for part in segments:
        k, n, t = part.size_k, part.size_n, part.tensors
        if fmt == FP8:
            inv = src.read(t["weight_scale_inv"])
            inv = inv.view(np.uint16) if inv.dtype.itemsize == 2 else inv  # bf16 travels as its bits
            q = ops.block_fp8_group128_repack(upload(src.read(t["weight"]).view(np.uint8)), k, n, backend=backend,
                                              stream=stream)
            sc = ops.block_fp8_group128_scales(upload(inv), k, n, spec.act_dtype, backend=backend, stream=stream)
            pieces.append((q, sc, None))
            continue
        if src.read(t["scales"]).dtype != np.dtype(spec.act_dtype):  # the host path rounds them into act_dtype
            raise NotOnDevice(f"{t['scales']}: {src.read(t['scales']).dtype} scales, {np.dtype(spec.act_dtype)} out")
        zero_codes = _zero_codes(src, spec, part)
        q = ops.gptq_marlin_repack(upload(src.read(t["qweight"])), None, k, n, bits, backend=backend, stream=stream)
        scales = src.read(t["scales"])
        sc = ops.marlin_permute_scales(upload(scales.view(np.uint16) if scales.dtype.itemsize == 2 and
                                              scales.dtype != np.float16 else scales), k, n, g, backend=backend,
                                       stream=stream)
        z = None
        if spec.weight_type.has_zero_points:
            z = ops.marlin_zero_points(upload(np.ascontiguousarray(zero_codes)), k, n, bits, backend=backend,
                                       stream=stream)
        pieces.append((q, sc, z))
    if len(pieces) == 1:
        q, sc, z = pieces[0]
    else:  # fused along N: each Marlin tensor's columns concatenated (as to_marlin does on the host)
        if isinstance(q, np.ndarray):  # (host arrays: the backend given, in a test)
            cp = np
        else:
            from workbench.cuda.arrays import cupy

            cp = cupy()
        q = cp.concatenate([p[0] for p in pieces], axis=1)
        sc = cp.concatenate([p[1] for p in pieces], axis=1)
        z = None if pieces[0][2] is None else cp.concatenate([p[2] for p in pieces], axis=1)
    return MarlinTensors(q, sc, z, None, None)


# ---------------------------------------------------------------------------------------------------------------
# Marlin -> source, exact compare (verify)
# ---------------------------------------------------------------------------------------------------------------
# Compared one column block at a time, like the conversion: the inverse ops' temporaries and the comparison masks are
# bounded by the block, not the layer, and a mismatch costs no more memory than a match (counts, first position).
def _bits_view(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view(f"u{a.dtype.itemsize}") if a.dtype.itemsize in (1, 2, 4, 8) else a


def _source_block(stored: dict[str, np.ndarray], fmt: str, bits: int, b0: int, b1: int) -> dict[str, np.ndarray]:
    """Columns [b0, b1) of a part's source tensors (role -> block), wherever each format keeps N."""
    pf = 32 // bits
    rows_along_n = {"weight_packed", "weight_scale", "weight"}  # these hold N in their rows
    out = {}
    for role, t in stored.items():
        if role in ("qweight", "scales", "qzeros"):
            per = pf if role == "qzeros" or (role == "qweight" and fmt == AWQ) else 1
            out[role] = t[:, b0 // per: b1 // per]
        elif role in rows_along_n:
            out[role] = t[b0:b1]
        elif role == "weight_zero_point":  # packed along N, N padded up to a whole word
            out[role] = t[b0 // pf: -(-b1 // pf)]
        elif role == "weight_scale_inv":  # one row per 128 output columns
            out[role] = t[b0 // 128: -(-b1 // 128)]
    return out


def _rebuild_like_source(spec: LayerSpec, part: Part, block: dict, codes, scales, zeros, w: int):
    """(role, tensor rebuilt from the Marlin block, stored block) for every source tensor of a part's column block."""
    fmt, bits = spec.source_format, spec.bits
    if fmt == FP8:
        bias = np.float32(256.0 if spec.act_dtype == np.float16 else 2.0 ** 120)
        inv = block["weight_scale_inv"].astype(np.float32)  # (ceil(w/128), K/128)
        # the forward transform rounds once: act_dtype(inv * 2^bias), each scale covering 128 columns of its group
        expected = (np.repeat(inv.T, 128, axis=1)[:, :w] * bias).astype(spec.act_dtype)
        return [("weight", np.ascontiguousarray(codes.T), block["weight"].view(np.uint8)),
                ("weight_scale_inv", scales, expected)]
    if fmt in (GPTQ, GPTQ_V2):
        out = [("qweight", packing.pack_rows(codes, bits), block["qweight"]), ("scales", scales, block["scales"])]
        if zeros is not None:
            # v1 stores zero - 1; a (corrupt) Marlin zero of 0 wraps to the all-ones field and then mismatches
            stored = ((zeros.astype(np.int16) - 1) & ((1 << bits) - 1)).astype(np.uint8) if fmt == GPTQ else zeros
            out.append(("qzeros", packing.pack_cols(stored, bits), block["qzeros"]))
        return out
    if fmt == AWQ:
        return [("qweight", packing.awq_pack(codes, bits), block["qweight"]), ("scales", scales, block["scales"]),
                ("qzeros", packing.awq_pack(zeros, bits), block["qzeros"])]
    out = [("weight_packed", np.ascontiguousarray(packing.pack_rows(codes, bits).T), block["weight_packed"]),
           ("weight_scale", np.ascontiguousarray(scales.T), block["weight_scale"])]
    if zeros is not None:
        pf = 32 // bits
        padded = np.zeros((-(-w // pf) * pf, zeros.shape[0]), np.uint8)  # CT pads N up to a whole word
        padded[:w] = zeros.T
        out.append(("weight_zero_point", packing.pack_rows(padded, bits), block["weight_zero_point"]))
    return out


@dataclass
class _Tally:
    """Differing elements of one source tensor over all column blocks: how many, and the first one described."""

    count: int = 0
    first: str = ""


def _check_act_order(src, spec: LayerSpec, segments: list[Part], m: MarlinTensors, where: str) -> tuple[list, object]:
    """(problems, perm or None); a perm that is no permutation ends the comparison (its problems say so)."""
    if not spec.act_order:
        if m.perm is not None or m.g_idx is not None:
            return [f"{where}: g_idx/perm present on a layer without act-order"], None
        return [], None
    k = spec.size_k
    g_idx_ckpt = _layer_g_idx(src, spec, segments)
    if m.perm is None or m.g_idx is None:
        return [f"{where}: act-order layer lacks g_idx/perm"], False
    perm = m.perm
    if perm.shape != (k,) or not np.array_equal(np.sort(perm), np.arange(k)):
        return [f"{where}: perm is not a permutation of range({k})"], False
    problems = []
    if m.g_idx.shape != (k,) or not np.array_equal(m.g_idx, g_idx_ckpt[perm]):
        if m.g_idx.shape != (k,):
            problems.append(f"{where}: g_idx has shape {list(m.g_idx.shape)}, expected [{k}]")
        else:
            i = int(np.flatnonzero(m.g_idx != g_idx_ckpt[perm])[0])
            problems.append(f"{where}: g_idx[{i}] = {m.g_idx[i]} but the source g_idx of row perm[{i}] = {perm[i]}"
                            f" is {g_idx_ckpt[perm[i]]}")
    elif np.any(np.diff(m.g_idx) < 0):
        problems.append(f"{where}: g_idx is not sorted")
    return problems, perm


def compare_with_source(src: SourceCheckpoint, spec: LayerSpec, expert: int, m: MarlinTensors,
                        column_block: int | None = None) -> tuple[list[str], int]:
    """(every way the Marlin tensors fail to unpack to the source tensors, number of differing elements); an empty
    list = bit-exact. Streamed in column blocks: memory is the source and Marlin tensors plus one block."""
    if spec.microscale:
        return microscale.compare_with_source(src, spec, expert, m, column_block)
    fmt, bits, k, g = spec.source_format, spec.bits, spec.size_k, spec.group_size
    pf = 32 // bits
    where = spec.name + (f" expert {expert}" if spec.num_experts else "")
    segments = spec.parts[expert]
    problems, perm = _check_act_order(src, spec, segments, m, where)
    if perm is False:
        return problems, 0
    if spec.weight_type.has_zero_points and m.zeros is None:
        return problems + [f"{where}: {spec.weight_type} layer has no zeros tensor"], 0
    if not spec.weight_type.has_zero_points and m.zeros is not None:
        problems.append(f"{where}: {spec.weight_type} layer carries a zeros tensor")
    inv_perm = None if perm is None else np.argsort(perm)
    group = 128 if fmt == FP8 else g
    block = column_block or COLUMN_BLOCK
    if fmt == FP8:
        block = -(-block // 128) * 128  # block-FP8 scale rows cover 128 columns each
    tallies: dict[str, _Tally] = {}
    n0 = 0  # first Marlin column of the segment
    for part in segments:
        stored = {role: src.read(name) for role, name in part.tensors.items()
                  if role not in ("g_idx", "weight_g_idx", "weight_shape")}
        for b0 in range(0, part.size_n, block):
            b1 = min(part.size_n, b0 + block)
            w, c0 = b1 - b0, n0 + b0
            c1 = c0 + padded_n(w)  # the Marlin columns of the block, a last partial block's padding included
            q_block = np.ascontiguousarray(m.qweight[:, c0 * 16 // pf: c1 * 16 // pf])
            codes = ops.marlin_to_codes(q_block, k, w, bits, perm)  # (K, w) checkpoint row order
            scales = ops.marlin_unpermute_scales(np.ascontiguousarray(m.scales[:, c0:c1]), k, w, group)  # (ng, w)
            zeros = None
            if spec.weight_type.has_zero_points:
                zeros = ops.marlin_zero_points_to_codes(np.ascontiguousarray(m.zeros[:, c0 // pf: c1 // pf]), k, w,
                                                        bits)  # (ng, w)
            pad = _padding_problem(spec, part, where, q_block, m, zeros is not None, k, w, c0, c1, group)
            if pad:
                tally = tallies.setdefault(f"{part.prefix} padding", _Tally())
                tally.count += pad[0]
                tally.first = tally.first or pad[1]
            src_block = _source_block(stored, fmt, bits, b0, b1)
            for role, rebuilt, want in _rebuild_like_source(spec, part, src_block, codes, scales, zeros, w):
                name = part.tensors[role]
                tally = tallies.setdefault(name, _Tally())
                if rebuilt.shape != want.shape or rebuilt.dtype != want.dtype:
                    tally.count += want.size
                    tally.first = tally.first or (f"{where}: {name}: rebuilt {rebuilt.dtype} {list(rebuilt.shape)} vs"
                                                  f" source {want.dtype} {list(want.shape)} (columns {b0}..{b1})")
                    continue
                differ = _bits_view(rebuilt) != _bits_view(want)
                count = int(np.count_nonzero(differ))
                if not count:
                    continue
                if role in ("qweight", "weight_packed", "weight"):
                    source = _codes_of(fmt, src_block[role], bits, k)
                    bad = source != codes
                    tally.count += int(np.count_nonzero(bad))
                    if not tally.first:
                        tally.first = _weight_mismatch(spec, part, where, codes, source, bad, n0, b0, inv_perm)
                    continue
                tally.count += count
                if not tally.first:
                    at = tuple(int(v) for v in np.unravel_index(int(np.argmax(differ)), differ.shape))
                    tally.first = f"{where}: " + _field_mismatch(name, role, at, rebuilt, want, b0, bits)
        n0 += part.size_n
    for name, tally in tallies.items():
        if tally.count:
            problems.append(f"{tally.first} ({tally.count} differing elements of {name})")
    return problems, sum(t.count for t in tallies.values())


def _padding_problem(spec: LayerSpec, part: Part, where: str, q_block, m: MarlinTensors, has_zeros: bool, k: int,
                     w: int, c0: int, c1: int, group: int) -> tuple[int, str] | None:
    """(count, first) of nonzero padding in a column block's Marlin tensors: the rule keeps every element past
    (K, N) zero bytes (codes, scales, zero points), so a kernel reading a padded tile adds nothing."""
    if (padded_k(k), padded_n(w)) == (k, w):
        return None
    bits, count, first = spec.bits, 0, None
    n_bad, at = nonzero_padding(marlin_unpack_padded_codes(q_block, k, w, bits), k, w)
    if n_bad:
        count, first = n_bad, f"qweight code (k={at[0]}, n={c0 + at[1]} of the Marlin columns)"
    if padded_n(w) != w:
        full = ops.marlin_unpermute_scales(np.ascontiguousarray(m.scales[:, c0:c1]), k, padded_n(w), group)
        bad = _bits_view(full[:, w:]) != 0
        if bad.any():
            count += int(bad.sum())
            g, n = (int(v) for v in np.argwhere(bad)[0])
            first = first or f"scale (group {g}, n={c0 + w + n} of the Marlin columns)"
        if has_zeros:
            pf = 32 // bits
            z = marlin_zero_points_to_padded_codes(np.ascontiguousarray(m.zeros[:, c0 // pf: c1 // pf]), w, bits)
            bad = z[:, w:] != 0
            if bad.any():
                count += int(bad.sum())
                g, n = (int(v) for v in np.argwhere(bad)[0])
                first = first or f"zero point (group {g}, n={c0 + w + n} of the Marlin columns)"
    if not count:
        return None
    return count, (f"{where}: {part.prefix}: the padding past K x N = {k} x {spec.size_n} must be zero bytes; the first"
                   f" nonzero element is the {first}")


def _field_mismatch(name: str, role: str, at: tuple, rebuilt, want, b0: int, bits: int) -> str:
    """The first differing scale or zero-point element, in the source tensor's own coordinates."""
    if role == "weight_scale_inv":  # compared as unpermuted scales [group, column]
        gk, nn = at
        return (f"scales[group {gk}, column {b0 + nn}] (unpermuted) = {rebuilt[at]!r}, but {name}[{(b0 + nn) // 128},"
                f" {gk}] gives {want[at]!r} after the x2^bias fold")
    axis, per = {"scales": (1, 1), "qzeros": (1, 32 // bits), "weight_scale": (0, 1),
                 "weight_zero_point": (0, 32 // bits)}[role]  # where each tensor keeps N, and how packed
    index = list(at)
    index[axis] += b0 // per
    return f"{name}{index}: Marlin gives {rebuilt[at]!r}, source holds {want[at]!r}"


def _weight_mismatch(spec: LayerSpec, part: Part, where: str, codes, source, bad, n0: int, b0: int, inv_perm) -> str:
    """Name the first differing weight element by its Marlin coordinates."""
    if not bad.any():
        return f"{where}: {part.prefix}: packed words differ although every code matches (padding bits?)"
    k, n = (int(v) for v in np.unravel_index(int(np.argmax(bad)), bad.shape))
    k_marlin = k if inv_perm is None else int(inv_perm[k])
    column = n0 + b0 + n
    pos = describe_position(k_marlin, column, spec.size_n, spec.bits)
    return (
        f"{where}: {part.prefix} element (k={k}, n={b0 + n}) is {codes[k, n]} in Marlin, {source[k, n]} in the source;"
        f" Marlin row {k_marlin}, column {column}: tile {pos['tile']}"
        f" (k_tile {pos['k_tile']}, n_tile {pos['n_tile']}), sub-block {pos['subblock']}, lane {pos['lane']},"
        f" word {pos['word']} (qweight[{pos['row']}, {pos['column']}]), field {pos['field']}"
    )
