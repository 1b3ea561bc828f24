"""Microscaled checkpoints (NVFP4, MXFP4, MXFP8): what each producer writes, and the route to Marlin and back.

Tensors of a quantized prefix P (K = input features, N = output features; every weight is row-major ``[N, K]``):

| source | tensors | value of element (n, k) |
|---|---|---|
| compressed-tensors ``nvfp4-pack-quantized`` | ``P.weight_packed`` U8 [N, K/2], ``P.weight_scale`` F8_E4M3 [N, K/16], ``P.weight_global_scale`` F32 [1] | ``e2m1 · scale / global`` |
| compressed-tensors ``mxfp4-pack-quantized`` | ``P.weight_packed`` U8 [N, K/2], ``P.weight_scale`` U8 [N, K/32] (E8M0 codes) | ``e2m1 · 2^(code - 127)`` |
| compressed-tensors ``mxfp8-quantized`` | ``P.weight`` F8_E4M3 [N, K], ``P.weight_scale`` U8 [N, K/32] | ``e4m3 · 2^(code - 127)`` |
| ModelOpt NVFP4 | ``P.weight`` U8 [N, K/2], ``P.weight_scale`` F8_E4M3 [N, K/16], ``P.weight_scale_2`` F32 [] or [1], ``P.input_scale`` F32 (carried over) | ``e2m1 · scale · scale_2`` |
| gpt-oss (``quant_method = "mxfp4"``) | ``S_blocks`` U8 [E, N, K/32, 16], ``S_scales`` U8 [E, N, K/32], ``S_bias`` BF16 [E, N] (carried over) for ``S`` = ``<base>.experts.gate_up_proj`` and ``<base>.experts.down_proj`` | as MXFP4 |

FP4 bytes hold element 2j in the low nibble. compressed-tensors' global scale is the reciprocal of ModelOpt's
``weight_scale_2``: the Marlin kernel multiplies by ``fp32(1 / weight_global_scale)``. gpt-oss's ``gate_up_proj``
interleaves its rows (gate of column i at row 2i, up at 2i + 1); the Marlin layer keeps that order and the
manifest says so, with the clamped SwiGLU its experts use (``workbench.formats.gpt_oss``).

The Marlin layer: ``qweight`` (the 4- or 8-bit tiles), ``scales`` U8 ``[K/G, N_pad]`` (NVFP4: S0E5M3 bytes, MX: E8M0
codes, both permuted and shuffled; docs/formats.md, "Microscaling in Marlin"), and for NVFP4 ``global_scale`` F32
``[1]`` = ``global · 2^7`` (fp16) or ``· 2^119 / scale_factor`` (bf16). Gate and up fused along N (or an expert
stack) share one scale factor, and fused projections must share one global scale: differing ones are refused.

Shapes (docs/formats.md, "Shapes that are not tile multiples"): N is any size, the Marlin tensors N_pad =
ceil(N / 64) * 64 wide with zero codes and zero scale bytes in the padded columns (verify checks they are); K is a
whole number of the format's groups (the format's own rule), so it is never padded. The manifest keeps the true
sizes.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from workbench import ops
from workbench.checkpoint.files import CheckpointError
from workbench.checkpoint.settings import CT_FP4, CT_MXFP8, GPT_OSS_MXFP4, MODELOPT_NVFP4, Settings, WeightArgs
from workbench.formats import fp4_marlin, microscale as ms
from workbench.formats._checks import padded_n
from workbench.formats.marlin_tile import describe_position, marlin_unpack_padded_codes, nonzero_padding
from workbench.formats.scales import unpermute_scales
from workbench.weight import MarlinWeight

WEIGHT_ROLE = {CT_FP4: "weight_packed", CT_MXFP8: "weight", MODELOPT_NVFP4: "weight", GPT_OSS_MXFP4: "blocks"}
SCALE_ROLE = {CT_FP4: "weight_scale", CT_MXFP8: "weight_scale", MODELOPT_NVFP4: "weight_scale",
              GPT_OSS_MXFP4: "scales"}
GLOBAL_ROLE = {CT_FP4: "weight_global_scale", MODELOPT_NVFP4: "weight_scale_2"}
SCALE_TAGS = {"nvfp4": "F8_E4M3", "mxfp4": "U8", "mxfp8": "U8"}
GPT_OSS_STACKS = ("gate_up_proj", "down_proj")
# gpt-oss's clamped SwiGLU (transformers' GptOssExperts: alpha 1.702; the limit comes from config.json)
GPT_OSS_ALPHA = 1.702
GPT_OSS_DEFAULT_LIMIT = 7.0
COLUMN_BLOCK = 1024  # columns converted per op call (a multiple of 64), as convert.COLUMN_BLOCK


def _require(cond: bool, src, name: str, message: str) -> None:
    if not cond:
        raise CheckpointError(f"{src.describe(name)}: {message}")


def _need(src, part, role: str, fmt: str) -> str:
    if role not in part.tensors:
        have = ", ".join(sorted(part.tensors.values()))
        raise CheckpointError(f"{part.prefix}: the {role} tensor is missing ({fmt} layer {part.prefix!r} has {have} in"
                              f" {src.root}): missing tensor")
    return part.tensors[role]


def _dtype(src, name: str, allowed: tuple[str, ...], what: str) -> str:
    tag = src.info(name).dtype
    _require(tag in allowed, src, name, f"dtype {tag} is not {' or '.join(allowed)} ({what})")
    return tag


# ---------------------------------------------------------------------------------------------------------------
# discovery (headers only)
# ---------------------------------------------------------------------------------------------------------------
def gpt_oss_parts(src, names: set[str]) -> dict:
    """gpt-oss's stacked expert tensors -> one Part per stack (the layer builder makes one slice per expert)."""
    from workbench.checkpoint.layers import Part

    parts = {}
    for name in sorted(names):
        prefix, _, suffix = name.rpartition(".")
        for stack in GPT_OSS_STACKS:
            if suffix == f"{stack}_blocks":
                if not prefix.endswith(".experts"):
                    raise CheckpointError(f"{src.describe(name)}: gpt-oss MXFP4 blocks outside an experts module")
                base = f"{prefix}.{stack}"
                tensors = {"blocks": name}
                if f"{base}_scales" in names:
                    tensors["scales"] = f"{base}_scales"
                parts[base] = Part(base, tensors)
    return parts


def shape_part(src, part, fmt: str, args: WeightArgs) -> None:
    """Fill size_k / size_n / num_groups of a microscaled part from its tensors, checking each against the format."""
    f = ms.FORMATS[args.microscale]
    w_name = _need(src, part, WEIGHT_ROLE[fmt], fmt)
    s_name = _need(src, part, SCALE_ROLE[fmt], fmt)
    wshape, sshape = src.info(w_name).shape, src.info(s_name).shape
    if fmt == GPT_OSS_MXFP4:
        _dtype(src, w_name, ("U8",), "two E2M1 codes a byte")
        _require(len(wshape) == 4 and wshape[3] == 16, src, w_name, "expected [experts, N, K/32, 16] (16 bytes = one"
                 " group of 32 E2M1 codes)")
        part.size_n, part.size_k = wshape[1], wshape[2] * 32
        expect_scales = tuple(wshape[:3])
    else:
        _dtype(src, w_name, ("U8",) if f.element_bits == 4 else ("F8_E4M3",), f"{f.name} elements")
        _require(len(wshape) == 2, src, w_name, "expected [N, K/2]" if f.element_bits == 4 else "expected [N, K]")
        part.size_n = wshape[0]
        part.size_k = wshape[1] * (2 if f.element_bits == 4 else 1)
        expect_scales = (part.size_n, part.size_k // f.group_size)
    part.scale_dtype = _dtype(src, s_name, (SCALE_TAGS[f.name],), f"{f.name} scales")
    _require(part.size_k % f.group_size == 0, src, w_name, f"K = {part.size_k} is not a multiple of {f.name}'s group"
             f" size {f.group_size}")
    _require(tuple(sshape) == expect_scales, src, s_name, f"expected {list(expect_scales)} for K = {part.size_k},"
             f" N = {part.size_n} ({f.name}: one scale per {f.group_size} elements along K)")
    part.num_groups = part.size_k // f.group_size
    if f.has_global_scale:
        g_name = _need(src, part, GLOBAL_ROLE[fmt], fmt)
        _dtype(src, g_name, ("F32",), "the per-tensor global scale")
        _require(src.info(g_name).shape in ((), (1,)), src, g_name, "expected one value ([] or [1])")


def gpt_oss_layer(src, settings: Settings, part, make_layer):
    """The Marlin expert stack of one gpt-oss stack tensor (one Part per expert, each a slice of the stack)."""
    experts = src.info(part.tensors["blocks"]).shape[0]
    if experts == 0:
        raise CheckpointError(f"{src.describe(part.tensors['blocks'])}: a stack of 0 experts")
    slices = [[dataclasses.replace(part, index=e)] for e in range(experts)]
    spec = make_layer(src, settings, part.prefix, slices, experts)
    bias = f"{part.prefix}_bias"
    spec.extra_record["bias"] = bias if bias in src.where else None
    if part.prefix.endswith("gate_up_proj"):
        limit = src.config.get("swiglu_limit", GPT_OSS_DEFAULT_LIMIT)
        spec.extra_record.update({"gate_up": "interleaved", "activation": {
            "name": "swiglu_oai", "alpha": GPT_OSS_ALPHA, "limit": float(limit)}})
    return spec


def act_dtype_for(src, args: WeightArgs) -> np.dtype:
    """MX formats run in bf16 (E8M0 needs bf16's range); NVFP4 in the model's dtype (config.json torch_dtype)."""
    f = ms.FORMATS[args.microscale]
    if len(f.act_dtypes) == 1:
        return f.act_dtypes[0]
    return ms.F16 if str(src.config.get("torch_dtype", "bfloat16")) in ("float16", "torch.float16") else ms.BF16


def problems(spec) -> list[str]:
    """What keeps a microscaled layer from Marlin, beyond the tile rules every layer has."""
    f = ms.FORMATS[spec.microscale]
    out = []
    if spec.group_size != f.group_size:
        out.append(f"group size {spec.group_size} is not {f.name}'s {f.group_size}")
    return out


def record(spec) -> dict:
    """What the manifest says about a microscaled layer beyond the common keys."""
    scales = "s0e5m3" if spec.microscale == "nvfp4" else "e8m0"
    return {"microscale": spec.microscale, "scale_encoding": scales, **spec.extra_record}


# ---------------------------------------------------------------------------------------------------------------
# reading one part's tensors
# ---------------------------------------------------------------------------------------------------------------
def _read(src, part, role: str) -> np.ndarray:
    return src.read(part.tensors[role], part.index)


def _weight_bytes(src, spec, part) -> np.ndarray:
    """[N, K/2] E2M1 bytes or [N, K] E4M3 bytes of a part, as uint8."""
    raw = _read(src, part, WEIGHT_ROLE[spec.source_format])
    return np.ascontiguousarray(raw.reshape(part.size_n, -1).view(np.uint8))


def _scale_codes(src, spec, part) -> np.ndarray:
    return np.ascontiguousarray(_read(src, part, SCALE_ROLE[spec.source_format]).view(np.uint8))


def kernel_global_scale(src, spec, part) -> np.float32:
    """The global scale the kernel multiplies by (ModelOpt's weight_scale_2; compressed-tensors' reciprocal)."""
    name = part.tensors[GLOBAL_ROLE[spec.source_format]]
    g = src.read(name).reshape(-1)[0].astype(np.float32)
    if not (np.isfinite(g) and g > 0):
        raise CheckpointError(f"{src.describe(name)}: global scale = {float(g)!r}; it must be finite and positive")
    return np.float32(1) / g if spec.source_format == CT_FP4 else g


def _expert_global_scale(src, spec, expert: int) -> np.float32:
    """One global scale for the fused segments of one expert (or the dense layer); differing ones are refused."""
    segments = spec.parts[expert]
    values = [kernel_global_scale(src, spec, p) for p in segments]
    for part, g in zip(segments[1:], values[1:]):
        if g.view(np.uint32) != values[0].view(np.uint32):
            first = segments[0].tensors[GLOBAL_ROLE[spec.source_format]]
            raise CheckpointError(f"{spec.name}: {part.tensors[GLOBAL_ROLE[spec.source_format]]} gives the global scale"
                                  f" {float(g)!r} but {first} gives {float(values[0])!r}; projections fused into one"
                                  " Marlin layer share one global scale (quantize them with a shared one)")
    return values[0]


def layer_scale_factor(src, spec) -> float:
    """vLLM's bf16 rescale of an NVFP4 layer, over every expert and segment (one factor per Marlin layer)."""
    if spec.microscale != "nvfp4":
        return 1.0
    if "scale_factor" not in spec.cache:
        names = dict.fromkeys(p.tensors["weight_scale"] for segs in spec.parts for p in segs)
        smallest = None
        for name in names:
            v = src.read(name).view(np.uint8)
            v = v[((v & 0x7F) != 0) & ((v & 0x7F) != 0x7F)]  # non-zero, not NaN: vLLM's min over positive scales
            if v.size:
                low = np.uint8((v & 0x7F).min())  # E4M3 magnitudes order as their bytes do
                smallest = low if smallest is None else min(smallest, low)
        probe = np.array([[0 if smallest is None else smallest]], np.uint8)
        spec.cache["scale_factor"] = ops.nvfp4_scale_factor(probe, spec.act_dtype)
    return spec.cache["scale_factor"]


# ---------------------------------------------------------------------------------------------------------------
# source -> Marlin
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class MicroscaleTensors:
    """One microscaled part in Marlin layout."""

    qweight: np.ndarray  # (K/16, N_pad*16/pf) int32
    scales: np.ndarray  # (K/G, N_pad) uint8: S0E5M3 bytes (NVFP4) or E8M0 codes (MX), permuted and shuffled


def part_to_marlin(src, spec, part, backend: str, column_block: int | None = None) -> MicroscaleTensors:
    k, n, f = part.size_k, part.size_n, ms.FORMATS[spec.microscale]
    pf = 32 // f.element_bits
    block = column_block or COLUMN_BLOCK
    if block % 64:
        raise ValueError(f"column_block = {block} is not a multiple of 64 (Marlin tile width)")
    weight, codes = _weight_bytes(src, spec, part), _scale_codes(src, spec, part)
    sf = layer_scale_factor(src, spec)
    # a block of w source rows fills padded_n(w) Marlin columns (only the last block can be short)
    qweight = np.empty((k // 16, padded_n(n) * 16 // pf), np.int32)
    scales = np.empty((part.num_groups, padded_n(n)), np.uint8)
    repack = ops.fp4_marlin_repack if f.element_bits == 4 else ops.mxfp8_marlin_repack
    for n0 in range(0, n, block):
        n1 = min(n, n0 + block)
        w, e1 = n1 - n0, n0 + padded_n(n1 - n0)
        qweight[:, n0 * 16 // pf: e1 * 16 // pf] = repack(np.ascontiguousarray(weight[n0:n1]), k, w, backend=backend)
        rows = np.ascontiguousarray(codes[n0:n1])
        if f.name == "nvfp4":
            scales[:, n0:e1] = ops.nvfp4_marlin_scales(rows, k, w, spec.act_dtype, sf, backend=backend)[0]
        else:
            scales[:, n0:e1] = ops.mx_marlin_scales(rows, k, w, f.name, backend=backend)
    return MicroscaleTensors(qweight, scales)


def to_marlin(src, spec, expert: int, backend: str, column_block: int | None = None):
    """Marlin tensors of a microscaled dense layer (expert = 0) or one expert; segments fused along N."""
    from workbench.checkpoint.convert import MarlinTensors

    pieces = [part_to_marlin(src, spec, part, backend, column_block) for part in spec.parts[expert]]
    qweight = np.concatenate([p.qweight for p in pieces], axis=1) if len(pieces) > 1 else pieces[0].qweight
    scales = np.concatenate([p.scales for p in pieces], axis=1) if len(pieces) > 1 else pieces[0].scales
    extra = {}
    if spec.microscale == "nvfp4":
        g = _expert_global_scale(src, spec, expert)
        extra["global_scale"] = np.array([ops.nvfp4_marlin_global_scale(g, spec.act_dtype,
                                                                         layer_scale_factor(src, spec))], np.float32)
    return MarlinTensors(qweight, scales, None, None, None, extra=extra)


# ---------------------------------------------------------------------------------------------------------------
# Marlin -> source, exact compare (verify)
# ---------------------------------------------------------------------------------------------------------------
def compare_with_source(src, spec, expert: int, m, column_block: int | None = None) -> tuple[list[str], int]:
    """(every way the Marlin tensors fail to give back the source tensors, differing elements); [] = bit-exact."""
    f = ms.FORMATS[spec.microscale]
    pf = 32 // f.element_bits
    k = spec.size_k
    where = spec.name + (f" expert {expert}" if spec.num_experts else "")
    problems, differing = [], 0
    for attr in ("zeros", "g_idx", "perm"):
        if getattr(m, attr) is not None:
            problems.append(f"{where}: a {spec.microscale} layer carries {attr}")
    if m.scales.dtype != np.uint8:
        encoding = record(spec)["scale_encoding"]
        return problems + [f"{where}: scales are {m.scales.dtype}, expected uint8 ({encoding})"], 0
    sf = layer_scale_factor(src, spec)
    block = column_block or COLUMN_BLOCK
    inverse = ops.marlin_to_fp4 if f.element_bits == 4 else ops.marlin_to_mxfp8
    n0 = 0
    for part in spec.parts[expert]:
        weight, codes = _weight_bytes(src, spec, part), _scale_codes(src, spec, part)
        if f.name == "nvfp4":
            codes = np.where(codes == 0x80, np.uint8(0), codes)  # -0 and +0 scale alike; the byte keeps +0
        w_bad = s_bad = 0
        w_first = s_first = ""
        for b0 in range(0, part.size_n, block):
            b1 = min(part.size_n, b0 + block)
            w, c0 = b1 - b0, n0 + b0
            c1 = c0 + padded_n(w)  # the Marlin columns of the block, a last partial tile's padding included
            q_block = np.ascontiguousarray(m.qweight[:, c0 * 16 // pf: c1 * 16 // pf])
            pad = _padding_problem(spec, part, where, q_block, np.ascontiguousarray(m.scales[:, c0:c1]), k, w, c0)
            if pad:
                problems.append(pad[1])
                differing += pad[0]
            rebuilt = inverse(q_block, k, w)
            bad = rebuilt != weight[b0:b1]
            if bad.any():
                w_bad += int(np.count_nonzero(bad))
                w_first = w_first or _weight_mismatch(spec, part, where, rebuilt, weight[b0:b1], bad, c0, b0)
            raw = np.ascontiguousarray(m.scales[:, c0:c1])
            if f.name == "nvfp4":
                back = ops.marlin_to_nvfp4_scales(raw, k, w, sf)
            else:
                back = ops.marlin_to_mx_scales(raw, k, w, f.name)
            bad = back != codes[b0:b1]
            if bad.any():
                s_bad += int(np.count_nonzero(bad))
                if not s_first:
                    nn, g = (int(v) for v in np.unravel_index(int(np.argmax(bad)), bad.shape))
                    why = " (negative in the source: the S0E5M3 byte keeps the magnitude)" if (
                        f.name == "nvfp4" and codes[b0 + nn, g] & 0x80) else ""
                    s_first = (f"{where}: {part.tensors[SCALE_ROLE[spec.source_format]]}[{b0 + nn}, {g}] is"
                               f" {int(codes[b0 + nn, g]):#04x} in the source, {int(back[nn, g]):#04x} from the Marlin"
                               f" scales{why}")
        if w_bad:
            problems.append(f"{w_first} ({w_bad} differing bytes of {part.tensors[WEIGHT_ROLE[spec.source_format]]})")
        if s_bad:
            problems.append(f"{s_first} ({s_bad} differing scales)")
        differing += w_bad + s_bad
        n0 += part.size_n
    if spec.microscale == "nvfp4":
        want = np.float32(ops.nvfp4_marlin_global_scale(_expert_global_scale(src, spec, expert), spec.act_dtype, sf))
        got = m.extra.get("global_scale")
        if got is None or got.size != 1 or got.dtype != np.float32 or got.reshape(-1)[0].view(np.uint32) != \
                want.view(np.uint32):
            problems.append(f"{where}: global_scale = {None if got is None else got.reshape(-1).tolist()}, expected"
                            f" [{float(want)!r}] (the source's global scale · 2^bias / scale_factor {sf:g})")
            differing += 1
    return problems, differing


def _padding_problem(spec, part, where: str, q_block, s_block, k: int, w: int, c0: int) -> tuple[int, str] | None:
    """(count, message) of nonzero padding in a column block's Marlin tensors (None when there is none or the block is
    whole tiles): every padded column must be zero codes and zero scale bytes, so a kernel reading the padded tile
    adds nothing. The scale bytes are checked as stored (before any decoding, which could map a stray byte to 0)."""
    if padded_n(w) == w:
        return None
    f = ms.FORMATS[spec.microscale]
    count, first = 0, ""
    n_bad, at = nonzero_padding(marlin_unpack_padded_codes(q_block, k, w, spec.bits), k, w)
    if n_bad:
        count, first = n_bad, f"qweight code (k={at[0]}, n={c0 + at[1]} of the Marlin columns)"
    logical = unpermute_scales(fp4_marlin.shuffle_scales(s_block), k, padded_n(w), f.group_size)  # [ng, N_pad] bytes
    bad = logical[:, w:] != 0
    if bad.any():
        count += int(bad.sum())
        g, n = (int(v) for v in np.argwhere(bad)[0])
        first = first or f"scale byte {int(logical[g, w + n]):#04x} (group {g}, n={c0 + w + n} of the Marlin columns)"
    if not count:
        return None
    return count, (f"{where}: {part.prefix}: the padding past N = {spec.size_n} must be zero bytes; the first nonzero"
                   f" element is the {first} ({count} nonzero padded elements)")


def _weight_mismatch(spec, part, where: str, rebuilt, source, bad, column0: int, b0: int) -> str:
    """The first differing weight byte, named by the Marlin coordinates of its element."""
    n, j = (int(v) for v in np.unravel_index(int(np.argmax(bad)), bad.shape))
    per_byte = 2 if spec.bits == 4 else 1
    k = j * per_byte
    if per_byte == 2 and (rebuilt[n, j] & 0xF) == (source[n, j] & 0xF):
        k += 1  # the low nibble agrees: the high one differs
    pos = describe_position(k, column0 + n, spec.size_n, spec.bits)
    return (f"{where}: {part.prefix} byte [{b0 + n}, {j}] (element k={k}) is {int(rebuilt[n, j]):#04x} from Marlin,"
            f" {int(source[n, j]):#04x} in the source; Marlin tile {pos['tile']} (k_tile {pos['k_tile']}, n_tile"
            f" {pos['n_tile']}), sub-block {pos['subblock']}, lane {pos['lane']}, word {pos['word']}"
            f" (qweight[{pos['row']}, {pos['column']}]), field {pos['field']}")


# ---------------------------------------------------------------------------------------------------------------
# the layer object workbench.load returns
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class MicroscaleMarlinWeight(MarlinWeight):
    """A microscaled Marlin layer: ``scales`` are uint8 (S0E5M3 bytes for NVFP4, E8M0 codes for MX) and NVFP4
    carries ``global_scale`` ([E,] 1) float32, the factor the kernel applies once."""

    microscale: str = ""
    global_scale: np.ndarray | None = None
    gate_up: str = ""  # "interleaved" for gpt-oss's gate_up_proj (gate at even rows, up at odd)

    def expert(self, e: int) -> "MicroscaleMarlinWeight":
        one = MarlinWeight.expert(self, e)
        return dataclasses.replace(one, global_scale=None if self.global_scale is None else self.global_scale[e])


def marlin_weight(qweight, scales, global_scale, size_k: int, size_n: int, group_size: int, weight_type, act_dtype,
                  num_experts, rec: dict) -> MicroscaleMarlinWeight:
    return MicroscaleMarlinWeight(qweight, scales, None, None, None, size_k, size_n, group_size, weight_type,
                                  np.dtype(act_dtype), True, num_experts, microscale=rec["microscale"],
                                  global_scale=global_scale, gate_up=rec.get("gate_up", ""))
