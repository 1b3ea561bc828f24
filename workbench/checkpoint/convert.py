"""One layer, source layout <-> Marlin layout, through ``workbench.ops``.

``to_marlin`` reads a layer's source tensors (one expert at a time for stacks) and returns the Marlin tensors;
``compare_with_source`` goes the other way for ``verify``: it takes Marlin tensors back to the source layout with the
inverse ops and compares them bit for bit with what the checkpoint holds, naming the first differing element.

Per source format (codes are the unsigned stored values; b = bits, pf = 32 / b):

| format | weight route | zero points |
|---|---|---|
| GPTQ v1 / v2 | ``qweight`` -> ``gptq_marlin_repack`` (with ``perm`` for act-order) | v1 stores ``zero - 1``: symmetric = every field 2^(b-1) - 1; asymmetric -> +1 -> ``marlin_zero_points`` (an all-ones field is an error); v2 stores the zero |
| AWQ | ``qweight`` -> ``awq_marlin_repack`` | ``awq_to_marlin_zero_points`` |
| compressed-tensors | ``weight_packed`` [N, K/pf] is GPTQ's [K/pf, N] transposed (same field order; code = q + 2^(b-1) = u4b8/u8b128 code) -> ``gptq_marlin_repack`` | ``weight_zero_point`` [N/pf, ng] packed along N with the same offset -> codes -> ``marlin_zero_points`` |
| block-FP8 | E4M3 bytes [N, K] -> ``block_fp8_group128_repack`` | none; ``block_fp8_group128_scales`` folds 2^8 into fp16 scales |
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from workbench import ops
from workbench.checkpoint.layers import LayerSpec, Part
from workbench.checkpoint.safetensors_io import CheckpointError
from workbench.checkpoint.settings import AWQ, CT, FP8, GPTQ, GPTQ_V2
from workbench.checkpoint.source import SourceCheckpoint
from workbench.formats import packing
from workbench.formats.gptq import sort_g_idx
from workbench.formats.marlin_tile import describe_position

NO_PERM = np.empty(0, dtype=np.int32)  # vLLM passes an empty tensor for "no act-order"


@dataclass
class MarlinTensors:
    """One layer (or one expert of a stack) in Marlin layout."""

    qweight: np.ndarray  # (K/16, N*16/pf) int32
    scales: np.ndarray  # (ng, N) act_dtype, permuted
    zeros: np.ndarray | None  # (ng, N/pf) int32
    g_idx: np.ndarray | None  # (K,) int32, sorted
    perm: np.ndarray | None  # (K,) int32


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
    if np.any(counts != spec.group_size):
        g = int(np.flatnonzero(counts != spec.group_size)[0])
        raise CheckpointError(f"{src.describe(name)}: group {g} has {counts[g]} rows, expected group_size ="
                              f" {spec.group_size} (every act-order group must hold group_size rows)")
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


def _source_codes(src: SourceCheckpoint, spec: LayerSpec, part: Part) -> np.ndarray:
    """(K, N) uint8 codes of a part in checkpoint row order (FP8: raw bytes), for mismatch reports."""
    fmt, bits = spec.source_format, spec.bits
    if fmt in (GPTQ, GPTQ_V2):
        return packing.unpack_rows(src.read(part.tensors["qweight"]), bits)
    if fmt == AWQ:
        return packing.awq_unpack(src.read(part.tensors["qweight"]), bits)
    if fmt == CT:
        return packing.unpack_rows(np.ascontiguousarray(src.read(part.tensors["weight_packed"]).T), bits)[: part.size_k]
    return np.ascontiguousarray(src.read(part.tensors["weight"]).view(np.uint8).T)


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
                    column_block: int | None = None):
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
    qweight = np.empty((k // 16, n * 16 // pf), np.int32)  # (K/16, N*16/pf)
    scales = np.empty((part.num_groups, n), spec.act_dtype)  # (ng, N)
    zeros = np.empty((part.num_groups, n // pf), np.int32) if spec.weight_type.has_zero_points else None
    for n0 in range(0, n, block):
        n1 = min(n, n0 + block)
        w, q_cols, z_cols = n1 - n0, slice(n0 * 16 // pf, n1 * 16 // pf), slice(n0 // pf, n1 // pf)
        if fmt == FP8:
            qweight[:, q_cols] = ops.block_fp8_group128_repack(np.ascontiguousarray(row_major[n0:n1]), k, w,
                                                               backend=backend)
            inv_rows = np.ascontiguousarray(inv[n0 // 128: -(-n1 // 128)])
            scales[:, n0:n1] = ops.block_fp8_group128_scales(inv_rows, k, w, spec.act_dtype, backend=backend)
            continue
        scales[:, n0:n1] = ops.marlin_permute_scales(np.ascontiguousarray(scales_src[:, n0:n1]), k, w, g,
                                                     backend=backend)
        if fmt == AWQ:
            qweight[:, q_cols] = ops.awq_marlin_repack(np.ascontiguousarray(awq_q[:, z_cols]), k, w, bits,
                                                       backend=backend)
            zeros[:, z_cols] = ops.awq_to_marlin_zero_points(np.ascontiguousarray(awq_z[:, z_cols]), k, w, bits,
                                                             backend=backend)
            continue
        cols = np.ascontiguousarray(packed_nk[n0:n1].T if fmt == CT else gptq_q[:, n0:n1])  # (K/pf, w)
        qweight[:, q_cols] = ops.gptq_marlin_repack(cols, p, k, w, bits, backend=backend)
        if zeros is not None:
            zeros[:, z_cols] = ops.marlin_zero_points(np.ascontiguousarray(zero_codes[:, n0:n1]), k, w, bits,
                                                      backend=backend)
    return qweight, scales, zeros


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
              column_block: int | None = None) -> MarlinTensors:
    """Marlin tensors of dense layer ``spec`` (expert = 0) or of one expert of a stack; segments fused along N."""
    segments = spec.parts[expert]
    g_idx_ckpt = _layer_g_idx(src, spec, segments) if spec.source_format != FP8 else None
    g_idx = perm = None
    if spec.act_order:
        g_idx, perm = sort_g_idx(g_idx_ckpt)
    pieces = [_part_to_marlin(src, spec, part, perm, backend, column_block) for part in segments]
    if len(pieces) == 1:
        qweight, scales, zeros = pieces[0]
    else:
        # Marlin row r holds k-tile r's N/64 tiles in column order, scales/zero points permute within 64-column
        # chunks: so fusing along N is a concatenation of each Marlin tensor's columns.
        qweight = np.concatenate([q for q, _, _ in pieces], axis=1)
        scales = np.concatenate([s for _, s, _ in pieces], axis=1)
        zeros = None if pieces[0][2] is None else np.concatenate([z for _, _, z in pieces], axis=1)
    return MarlinTensors(qweight, scales, zeros, g_idx, perm)


# ---------------------------------------------------------------------------------------------------------------
# Marlin -> source, exact compare (verify)
# ---------------------------------------------------------------------------------------------------------------
def _first_diff(a: np.ndarray, b: np.ndarray):
    """Index tuple of the first differing element (compared as raw bits), or None."""
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    if a.shape != b.shape:
        return ()
    ua = a.view(f"u{a.dtype.itemsize}") if a.dtype.itemsize in (1, 2, 4, 8) else a
    ub = b.view(f"u{b.dtype.itemsize}") if b.dtype.itemsize in (1, 2, 4, 8) else b
    if a.dtype != b.dtype:
        return ()
    bad = np.argwhere(ua != ub)
    return None if bad.size == 0 else tuple(int(v) for v in bad[0])


def compare_with_source(src: SourceCheckpoint, spec: LayerSpec, expert: int, m: MarlinTensors) -> list[str]:
    """Every way the Marlin tensors fail to unpack to the source tensors (empty list = bit-exact)."""
    fmt, bits, k, n_total, g = spec.source_format, spec.bits, spec.size_k, spec.size_n, spec.group_size
    where = spec.name + (f" expert {expert}" if spec.num_experts else "")
    problems: list[str] = []
    segments = spec.parts[expert]
    perm = None
    if spec.act_order:
        g_idx_ckpt = _layer_g_idx(src, spec, segments)
        if m.perm is None or m.g_idx is None:
            return [f"{where}: act-order layer lacks g_idx/perm"]
        perm = m.perm
        if not np.array_equal(np.sort(perm), np.arange(k)):
            return [f"{where}: perm is not a permutation of range({k})"]
        if not np.array_equal(m.g_idx, g_idx_ckpt[perm]):
            i = int(np.flatnonzero(m.g_idx != g_idx_ckpt[perm])[0])
            problems.append(f"{where}: g_idx[{i}] = {m.g_idx[i]} but the source g_idx of row perm[{i}] = {perm[i]}"
                            f" is {g_idx_ckpt[perm[i]]}")
        if np.any(np.diff(m.g_idx) < 0):
            problems.append(f"{where}: g_idx is not sorted")
    elif m.perm is not None or m.g_idx is not None:
        problems.append(f"{where}: g_idx/perm present on a layer without act-order")
    codes = ops.marlin_to_codes(m.qweight, k, n_total, bits, perm)  # (K, N) checkpoint row order
    group = 128 if fmt == FP8 else g
    scales = ops.marlin_unpermute_scales(m.scales, k, n_total, group)  # (ng, N)
    zero_codes = None
    if spec.weight_type.has_zero_points:
        if m.zeros is None:
            return problems + [f"{where}: {spec.weight_type} layer has no zeros tensor"]
        zero_codes = ops.marlin_zero_points_to_codes(m.zeros, k, n_total, bits)
    elif m.zeros is not None:
        problems.append(f"{where}: {spec.weight_type} layer carries a zeros tensor")
    inv_perm = None if perm is None else np.argsort(perm)
    n0 = 0
    for part in segments:
        n1 = n0 + part.size_n
        seg_codes, seg_scales = codes[:, n0:n1], scales[:, n0:n1]
        seg_zeros = None if zero_codes is None else zero_codes[:, n0:n1]
        checks = _encode_like_source(src, spec, part, seg_codes, seg_scales, seg_zeros)
        for tensor_name, rebuilt, what, reference in checks:
            stored = src.read(tensor_name) if reference is None else reference
            if what == "weight" and fmt == FP8:
                stored = stored.view(np.uint8)
            diff = _first_diff(rebuilt, stored)
            if diff is None:
                continue
            if diff == ():
                problems.append(f"{where}: {tensor_name}: rebuilt {rebuilt.dtype} {list(rebuilt.shape)} vs source"
                                f" {stored.dtype} {list(stored.shape)}")
            elif what == "weight":
                problems.append(_weight_mismatch(src, spec, part, where, seg_codes, n0, inv_perm))
            elif what == "fp8-scales":
                gk, nn = diff
                problems.append(f"{where}: scales[group {gk}, column {nn}] (unpermuted) = {rebuilt[diff]!r}, but"
                                f" {tensor_name}[{nn // 128}, {gk}] gives {stored[diff]!r} after the x2^bias fold")
            else:
                problems.append(f"{where}: {tensor_name}{list(diff)}: Marlin gives {rebuilt[diff]!r}, source holds"
                                f" {stored[diff]!r}")
        n0 = n1
    return problems


def _encode_like_source(src, spec: LayerSpec, part: Part, codes, scales, zeros):
    """(source tensor name, tensor rebuilt from Marlin, kind) for every source tensor of a part."""
    fmt, bits = spec.source_format, spec.bits
    t = part.tensors
    if fmt == FP8:
        bias = np.float32(256.0 if spec.act_dtype == np.float16 else 2.0 ** 120)
        inv = src.read(t["weight_scale_inv"]).astype(np.float32)  # (ceil(N/128), K/128)
        # the forward transform rounds once: act_dtype(inv * 2^bias), each scale covering 128 columns of its group
        expected = (np.repeat(inv.T, 128, axis=1)[:, : part.size_n] * bias).astype(spec.act_dtype)
        # the scale fold is lossy (float32 -> fp16), so the source is compared after the same single rounding
        return [(t["weight"], np.ascontiguousarray(codes.T), "weight", None),
                (t["weight_scale_inv"], scales, "fp8-scales", expected)]
    if fmt in (GPTQ, GPTQ_V2):
        out = [(t["qweight"], packing.pack_rows(codes, bits), "weight", None),
               (t["scales"], scales, "scales", None)]
        if zeros is not None:
            # v1 stores zero - 1; a (corrupt) Marlin zero of 0 wraps to the all-ones field and then mismatches
            stored = ((zeros.astype(np.int16) - 1) & ((1 << bits) - 1)).astype(np.uint8) if fmt == GPTQ else zeros
            out.append((t["qzeros"], packing.pack_cols(stored, bits), "zeros", None))
        return out
    if fmt == AWQ:
        return [(t["qweight"], packing.awq_pack(codes, bits), "weight", None), (t["scales"], scales, "scales", None),
                (t["qzeros"], packing.awq_pack(zeros, bits), "zeros", None)]
    out = [(t["weight_packed"], np.ascontiguousarray(packing.pack_rows(codes, bits).T), "weight", None),
           (t["weight_scale"], np.ascontiguousarray(scales.T), "scales", None)]
    if zeros is not None:
        pf = 32 // bits
        padded = np.zeros((-(-part.size_n // pf) * pf, zeros.shape[0]), np.uint8)  # CT pads N up to a whole word
        padded[: part.size_n] = zeros.T
        out.append((t["weight_zero_point"], packing.pack_rows(padded, bits), "zeros", None))
    return out


def _weight_mismatch(src, spec: LayerSpec, part: Part, where: str, codes, n0: int, inv_perm) -> str:
    """Name the first differing weight element by its Marlin coordinates."""
    source = _source_codes(src, spec, part)
    bad = np.argwhere(source != codes)
    if not bad.size:
        return f"{where}: {part.prefix}: packed words differ although every code matches (padding bits?)"
    k, n = (int(v) for v in bad[0])
    k_marlin = k if inv_perm is None else int(inv_perm[k])
    pos = describe_position(k_marlin, n0 + n, spec.size_n, spec.bits)
    return (
        f"{where}: {part.prefix} element (k={k}, n={n}) is {codes[k, n]} in Marlin, {source[k, n]} in the source"
        f" ({len(bad)} differing elements); Marlin row {k_marlin}, column {n0 + n}: tile {pos['tile']}"
        f" (k_tile {pos['k_tile']}, n_tile {pos['n_tile']}), sub-block {pos['subblock']}, lane {pos['lane']},"
        f" word {pos['word']} (qweight[{pos['row']}, {pos['column']}]), field {pos['field']}"
    )
