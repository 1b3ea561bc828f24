"""Which tensors of a checkpoint form which quantized layer, with shapes checked against the settings.

A *part* is one source projection (``...q_proj``, or one expert's ``gate_proj``); a *layer* is what the Marlin
checkpoint stores under one name: a dense projection (one part), or an expert stack (``...experts.gate_up_proj``
= every expert's gate and up fused along N, ``...experts.down_proj``).

Tensor names and shapes by source format (K = input features, N = output features, pf = 32 / bits,
ng = number of groups):

| format | tensors of prefix P |
|---|---|
| GPTQ (AutoGPTQ, GPTQModel, Optimum) | ``P.qweight`` I32 [K/pf, N] (packed along K), ``P.qzeros`` I32 [ng, N/pf], ``P.scales`` F16/BF16 [ng, N], ``P.g_idx`` I32 [K] |
| AWQ (AutoAWQ GEMM) | ``P.qweight`` I32 [K, N/pf] (along N, interleaved), ``P.qzeros`` I32 [ng, N/pf], ``P.scales`` [ng, N] |
| compressed-tensors pack-quantized | ``P.weight_packed`` I32 [N, K/pf] (along K, code = q + 2^(b-1)), ``P.weight_scale`` [N, ng], ``P.weight_shape`` I32/I64 [2] = (N, K), ``P.weight_zero_point`` I32 [N/pf, ng] (asymmetric only; packed along N, same offset), ``P.weight_g_idx`` I32 [K] (actorder="group") |
| block-FP8 (DeepSeek-V3) | ``P.weight`` F8_E4M3 [N, K], ``P.weight_scale_inv`` F32/BF16 [ceil(N/bn), ceil(K/bk)] |
| microscaled (NVFP4, MXFP4, MXFP8) | ``workbench/checkpoint/microscale.py`` |

``P.bias`` and every other tensor are carried over untouched.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np

from workbench.checkpoint import microscale
from workbench.checkpoint.safetensors_io import CheckpointError, dtype_tag
from workbench.checkpoint.settings import (AWQ, CT, CT_FP4, CT_MXFP8, FP8, GPT_OSS_MXFP4, GPTQ, GPTQ_V2,
                                           MICROSCALE_SOURCES, MODELOPT_NVFP4, Settings, WeightArgs, parse_settings)
from workbench.checkpoint.source import SourceCheckpoint
from workbench.scalar_types import SUPPORTED_GROUP_SIZES, ScalarType

# role -> tensor suffix, per format; the first role is the anchor that makes a prefix a quantized part
ROLES = {
    GPTQ: {"qweight": "qweight", "scales": "scales", "qzeros": "qzeros", "g_idx": "g_idx"},
    AWQ: {"qweight": "qweight", "scales": "scales", "qzeros": "qzeros"},
    CT: {"weight_packed": "weight_packed", "weight_scale": "weight_scale", "weight_shape": "weight_shape",
         "weight_zero_point": "weight_zero_point", "weight_g_idx": "weight_g_idx"},
    FP8: {"weight_scale_inv": "weight_scale_inv", "weight": "weight"},
    CT_FP4: {"weight_packed": "weight_packed", "weight_scale": "weight_scale",
             "weight_global_scale": "weight_global_scale"},
    CT_MXFP8: {"weight_scale": "weight_scale", "weight": "weight"},
    MODELOPT_NVFP4: {"weight_scale_2": "weight_scale_2", "weight": "weight", "weight_scale": "weight_scale"},
    GPT_OSS_MXFP4: {"blocks": "_blocks", "scales": "_scales"},  # stacked tensors <stack>_blocks, <stack>_scales
}
ROLES[GPTQ_V2] = ROLES[GPTQ]
ANCHORS = {"qweight": (GPTQ, GPTQ_V2, AWQ), "weight_packed": (CT, CT_FP4), "weight_scale_inv": (FP8,),
           "weight_scale": (CT_MXFP8, CT, CT_FP4, MODELOPT_NVFP4), "weight_scale_2": (MODELOPT_NVFP4,),
           "gate_up_proj_blocks": (GPT_OSS_MXFP4,), "down_proj_blocks": (GPT_OSS_MXFP4,)}
# the tensors a Marlin layer may hold (global_scale: NVFP4's, one fp32 per layer or expert)
MARLIN_SUFFIXES = ("qweight", "scales", "zeros", "g_idx", "perm", "global_scale")
FORMAT_FAMILY = {GPTQ: "GPTQ/AWQ", GPTQ_V2: "GPTQ/AWQ", AWQ: "GPTQ/AWQ", CT: "compressed-tensors", FP8: "block-FP8",
                 CT_FP4: "compressed-tensors FP4", CT_MXFP8: "compressed-tensors MXFP8",
                 MODELOPT_NVFP4: "ModelOpt NVFP4", GPT_OSS_MXFP4: "gpt-oss MXFP4"}
# tensors of a quantized prefix that are carried over untouched: the bias, and the activation-quantization scales of
# W4A4 / W8A8 checkpoints (a W4A16 / W8A16 Marlin layer reads activations as they are)
PASSTHROUGH_SUFFIXES = ("bias", "input_scale", "input_global_scale")

# expert projections: ...experts.<e>.<proj>; Mixtral names w1 (gate), w3 (up), w2 (down)
EXPERT_RE = re.compile(r"^(?P<base>.+)\.experts\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|gate_up_proj|w1|w2|w3)$")
EXPERT_ROLE = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down",
               "gate_up_proj": "gate_up"}

MAX_EXPERT_DIGITS = 9  # expert indices are small; a longer number in a name is refused before int() or range() see it
MARLIN_TILE_N = 64  # Marlin tile width
SCALE_DTYPES = ("F16", "BF16")
ACT_DTYPES = {"F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16)}


@dataclass
class Part:
    """One source projection: its tensors (role -> name) and its logical K x N."""

    prefix: str
    tensors: dict[str, str]
    size_k: int = 0
    size_n: int = 0
    num_groups: int = 0
    scale_dtype: str = ""
    index: int | None = None  # stacked source tensors (gpt-oss): this part is slice [index] of each


@dataclass
class LayerSpec:
    name: str  # output prefix in the Marlin checkpoint
    source_format: str
    weight_type: ScalarType
    group_size: int
    act_order: bool
    size_k: int
    size_n: int  # all N segments together (gate + up for a fused expert stack)
    num_experts: int  # 0 = dense layer
    parts: list[list[Part]]  # [expert or the one dense slot][N segment]
    act_dtype: np.dtype
    problems: list[str] = field(default_factory=list)
    microscale: str | None = None  # "nvfp4", "mxfp4", "mxfp8" (workbench.formats.microscale)
    extra_record: dict = field(default_factory=dict)  # what the manifest says beyond the common keys
    cache: dict = field(default_factory=dict)  # values read once per layer (NVFP4's shared scale factor)

    @property
    def bits(self) -> int:
        return self.weight_type.bits

    @property
    def compatible(self) -> bool:
        return not self.problems

    @property
    def source_tensors(self) -> list[str]:
        return list(dict.fromkeys(name for segs in self.parts for p in segs for name in p.tensors.values()))

    @property
    def marlin_scales_tag(self) -> str:
        """safetensors dtype of the Marlin scales: the activation dtype, or raw bytes for the microscaled formats."""
        return "U8" if self.microscale else dtype_tag(self.act_dtype)

    @property
    def manifest_extras(self) -> dict:
        """What the manifest records about this layer beyond the common keys (microscaled layers only)."""
        return microscale.record(self) if self.microscale else {}

    @property
    def extra_marlin_tensors(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """(suffix, dtype tag, shape without the expert axis) of the Marlin tensors beyond the common ones."""
        return [("global_scale", "F32", (1,))] if self.microscale == "nvfp4" else []


@dataclass
class Plan:
    settings: Settings | None
    layers: list[LayerSpec]
    passthrough: list[str]  # tensors carried over untouched


def _natural_key(name: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def discover(src: SourceCheckpoint) -> Plan:
    """Group the checkpoint's tensors into quantized layers; raise CheckpointError on anything inconsistent."""
    settings = parse_settings(src.quant_config, src.quant_config_source or src.root)
    names = set(src.names)
    anchors: dict[str, list[str]] = {}  # anchor suffix -> prefixes, in name order (messages must not depend on
    for name in sorted(names):  # the process's string hash seed)
        prefix, _, suffix = name.rpartition(".")
        if suffix in ANCHORS and prefix:
            anchors.setdefault(suffix, []).append(prefix)
    if settings is None:
        if anchors:
            suffix, prefixes = next(iter(anchors.items()))
            raise CheckpointError(
                f"{src.describe(prefixes[0] + '.' + suffix)} looks quantized, but {src.root} has no quantization"
                " settings (config.json quantization_config, quantize_config.json or quant_config.json)"
            )
        _check_no_stray_fp8(src, names, set())
        return Plan(None, [], sorted(names, key=_natural_key))
    fmt = settings.source_format
    for suffix, prefixes in sorted(anchors.items()):
        if fmt not in ANCHORS[suffix]:
            bad = sorted(prefixes)[0] + "." + suffix
            raise CheckpointError(
                f"mixed formats: {settings.origin} says {fmt}, but {src.describe(bad)} is a"
                f" {FORMAT_FAMILY[ANCHORS[suffix][0]]} tensor"
            )
    anchor = next(iter(ROLES[fmt]))
    roles = ROLES[fmt]
    parts: dict[str, Part] = {}
    if fmt == GPT_OSS_MXFP4:
        parts = microscale.gpt_oss_parts(src, names)
    for prefix in [] if fmt == GPT_OSS_MXFP4 else sorted(anchors.get(anchor, []), key=_natural_key):
        tensors = {role: f"{prefix}.{suffix}" for role, suffix in roles.items() if f"{prefix}.{suffix}" in names}
        parts[prefix] = Part(prefix, tensors)
    used = {n for p in parts.values() for n in p.tensors.values()}
    # a quantization tensor whose prefix has no anchor is an orphan (e.g. qzeros without qweight)
    quant_suffixes = {s for s in roles.values() if s != "weight"} if fmt != GPT_OSS_MXFP4 else set(ANCHORS)
    for name in sorted(names - used):
        prefix, _, suffix = name.rpartition(".")
        if suffix in quant_suffixes or (fmt == GPT_OSS_MXFP4 and suffix.endswith(("_blocks", "_scales"))):
            raise CheckpointError(f"{src.describe(name)} has no matching {prefix}.{anchor}: extra tensor")
        if prefix in parts and suffix not in PASSTHROUGH_SUFFIXES:
            raise CheckpointError(f"{src.describe(name)} is not a {fmt} tensor of quantized layer {prefix!r}:"
                                  " extra tensor")
    if fmt != FP8:
        _check_no_stray_fp8(src, names, used)
    for part in parts.values():
        args = settings.args_for(part.prefix)
        if fmt in MICROSCALE_SOURCES:
            microscale.shape_part(src, part, fmt, args)
        else:
            _shape_part(src, part, fmt, args)
    if fmt == GPT_OSS_MXFP4:
        layers = [microscale.gpt_oss_layer(src, settings, part, _make_layer) for part in parts.values()]
    else:
        layers = _group_layers(src, settings, parts)
    passthrough = sorted(names - used, key=_natural_key)
    reserved = {f"{spec.name}.{suffix}": spec.name for spec in layers for suffix in MARLIN_SUFFIXES}
    for name in passthrough:
        if name in reserved:
            raise CheckpointError(f"{src.describe(name)}: its name is the Marlin tensor {name.rpartition('.')[2]!r} of"
                                  f" output layer {reserved[name]!r}, so a reader would take it for part of that layer:"
                                  " name collision")
    if fmt == FP8:
        for name in passthrough:
            if src.info(name).dtype.startswith("F8_"):
                raise CheckpointError(f"{src.describe(name)} is FP8 but has no {name.rpartition('.')[0]}"
                                      ".weight_scale_inv: missing tensor")
    return Plan(settings, layers, passthrough)


def _check_no_stray_fp8(src, names, used) -> None:
    for name in sorted(names - used):
        if src.info(name).dtype.startswith("F8_"):
            raise CheckpointError(f"mixed formats: {src.describe(name)} is FP8 in a checkpoint whose settings"
                                  f" ({src.quant_config_source or 'none'}) are not block-FP8")


def _require(cond: bool, src: SourceCheckpoint, name: str, message: str) -> None:
    if not cond:
        raise CheckpointError(f"{src.describe(name)}: {message}")


def _need(src: SourceCheckpoint, part: Part, role: str, fmt: str) -> str:
    if role not in part.tensors:
        have = ", ".join(sorted(part.tensors.values()))
        raise CheckpointError(f"{part.prefix}.{ROLES[fmt][role]} is missing ({fmt} layer {part.prefix!r} has {have}"
                              f" in {src.root}): missing tensor")
    return part.tensors[role]


def _dtype(src, name, allowed, what) -> str:
    tag = src.info(name).dtype
    _require(tag in allowed, src, name, f"dtype {tag} is not {' or '.join(allowed)} ({what})")
    return tag


def _groups_of(size_k: int, group_size: int) -> int:
    return 1 if group_size == -1 else -(-size_k // group_size)


def _shape_part(src: SourceCheckpoint, part: Part, fmt: str, args: WeightArgs) -> None:
    """Fill size_k / size_n / num_groups from the tensors and check every shape against the settings."""
    pf = 32 // args.bits
    if fmt in (GPTQ, GPTQ_V2, AWQ):
        qw = _need(src, part, "qweight", fmt)
        sc = _need(src, part, "scales", fmt)
        qz = _need(src, part, "qzeros", fmt)
        _dtype(src, qw, ("I32",), "packed codes")
        _dtype(src, qz, ("I32",), "packed zero points")
        part.scale_dtype = _dtype(src, sc, SCALE_DTYPES, "scales")
        qshape, sshape = src.info(qw).shape, src.info(sc).shape
        _require(len(qshape) == 2, src, qw, "expected 2 dimensions")
        _require(len(sshape) == 2, src, sc, "expected 2 dimensions")
        if fmt == AWQ:
            part.size_k, part.size_n = qshape[0], sshape[1]
            _require(qshape[1] * pf == part.size_n, src, qw,
                     f"{qshape[1]} packed columns x {pf} = {qshape[1] * pf} contradicts N = {part.size_n} from"
                     f" {part.tensors['scales']} ({args.bits}-bit AWQ packs {pf} columns per word)")
        else:
            part.size_k, part.size_n = qshape[0] * pf, qshape[1]
            _require(sshape[1] == part.size_n, src, sc, f"N = {sshape[1]} contradicts N = {part.size_n} of {qw}")
        part.num_groups = _groups_of(part.size_k, args.group_size)
        _require(sshape[0] == part.num_groups, src, sc,
                 f"{sshape[0]} groups, but K = {part.size_k} with group_size = {args.group_size} from"
                 f" {src.quant_config_source} gives {part.num_groups}")
        _require(src.info(qz).shape == (part.num_groups, part.size_n // pf), src, qz,
                 f"expected [{part.num_groups}, {part.size_n // pf}] (groups, N / {pf})")
        if "g_idx" in part.tensors:
            gi = part.tensors["g_idx"]
            _dtype(src, gi, ("I32", "I64"), "group index per input channel")
            _require(src.info(gi).shape == (part.size_k,), src, gi, f"expected [{part.size_k}] (K)")
        elif args.act_order:
            _need(src, part, "g_idx", fmt)
    elif fmt == CT:
        wp = _need(src, part, "weight_packed", fmt)
        ws = _need(src, part, "weight_scale", fmt)
        wshape = _need(src, part, "weight_shape", fmt)
        _dtype(src, wp, ("I32",), "packed codes")
        part.scale_dtype = _dtype(src, ws, SCALE_DTYPES, "scales")
        _dtype(src, wshape, ("I32", "I64"), "original weight shape")
        _require(src.info(wshape).shape == (2,), src, wshape, "expected 2 values (N, K)")
        n, k = (int(v) for v in src.read(wshape))
        part.size_k, part.size_n = k, n
        _require(src.info(wp).shape == (n, -(-k // pf)), src, wp,
                 f"expected [{n}, {-(-k // pf)}] for weight_shape (N, K) = ({n}, {k}) at {args.bits} bits")
        part.num_groups = _groups_of(k, args.group_size)
        _require(src.info(ws).shape == (n, part.num_groups), src, ws,
                 f"expected [{n}, {part.num_groups}] (N, groups) for K = {k}, group_size = {args.group_size}")
        if args.symmetric:
            zp = part.tensors.get("weight_zero_point")
            # older compressed-tensors releases also saved the (all-zero, unpacked int8) zero points of symmetric
            # layers; accept those, refuse anything that would change the values
            if zp is not None and not (src.info(zp).dtype == "I8" and not np.any(src.read(zp))):
                raise CheckpointError(f"{src.describe(zp)}: the config says symmetric, but the layer stores non-zero"
                                      " or packed zero points")
        else:
            zp = _need(src, part, "weight_zero_point", fmt)
            _dtype(src, zp, ("I32",), "packed zero points")
            _require(src.info(zp).shape == (-(-n // pf), part.num_groups), src, zp,
                     f"expected [{-(-n // pf)}, {part.num_groups}] (N / {pf}, groups), packed along N")
        if "weight_g_idx" in part.tensors:
            gi = part.tensors["weight_g_idx"]
            _dtype(src, gi, ("I32", "I64"), "group index per input channel")
            _require(src.info(gi).shape == (k,), src, gi, f"expected [{k}] (K)")
        elif args.act_order:
            _need(src, part, "weight_g_idx", fmt)
    else:  # FP8
        w = _need(src, part, "weight", fmt)
        si = _need(src, part, "weight_scale_inv", fmt)
        _dtype(src, w, ("F8_E4M3",), "E4M3 weight")
        part.scale_dtype = _dtype(src, si, ("F32", "BF16"), "inverse block scales")
        wshape = src.info(w).shape
        _require(len(wshape) == 2, src, w, "expected [N, K]")
        part.size_n, part.size_k = wshape
        bn, bk = args.block
        expect = (-(-part.size_n // bn), -(-part.size_k // bk))
        _require(src.info(si).shape == expect, src, si,
                 f"expected {list(expect)} = [ceil(N/{bn}), ceil(K/{bk})] for weight {list(wshape)}")
        part.num_groups = expect[1]


def _weight_type(fmt: str, args: WeightArgs) -> ScalarType:
    if args.microscale:
        return ScalarType.FE2M1F if args.bits == 4 else ScalarType.FE4M3FN
    if fmt == FP8:
        return ScalarType.FE4M3FN
    if args.symmetric and fmt != AWQ:
        return ScalarType.U4B8 if args.bits == 4 else ScalarType.U8B128
    return ScalarType.U4 if args.bits == 4 else ScalarType.U8


def _problems(spec: LayerSpec, args: WeightArgs) -> list[str]:
    out = []
    k, n, g = spec.size_k, spec.size_n, spec.group_size
    # Any K and N the source format holds: the Marlin tensors are those of the weight zero-padded to whole 16 x 64
    # tiles (docs/formats.md, "Shapes that are not tile multiples"). The microscaled formats' K is a whole number of
    # their groups (checked with the shapes, microscale.shape_part), so only their N is ever padded.
    if k == 0 or n == 0:
        out.append(f"K x N = {k} x {n} is empty (a Marlin layer holds at least one 16 x 64 tile)")
    segments = [p.size_n for p in spec.parts[0]] if spec.parts else []
    if len(segments) > 1 and any(s % MARLIN_TILE_N for s in segments[:-1]):
        out.append(f"fused segments of N = {segments}: every segment but the last must be a multiple of"
                   f" {MARLIN_TILE_N} (the segments' Marlin tiles are concatenated along N; only the last may end in"
                   " a padded tile)")
    if spec.source_format == CT and k % (32 // spec.bits):
        out.append(f"K = {k} is not a multiple of the pack factor {32 // spec.bits} (Marlin takes the codes as GPTQ"
                   " rows, whole words along K)")
    if spec.source_format == FP8 and k % 4:
        out.append(f"K = {k} is not a multiple of 4 (the FP8 Marlin path moves K-major 32-bit words)")
    if spec.microscale:
        out += microscale.problems(spec)
    elif spec.source_format == FP8:
        if args.block != (128, 128):
            out.append(f"weight_block_size = {list(args.block)} is not [128, 128] (Marlin block-FP8 groups)")
    elif g not in SUPPORTED_GROUP_SIZES:
        out.append(f"group size {g} is not one Marlin kernels are built for {SUPPORTED_GROUP_SIZES}")
    if spec.weight_type.has_zero_points and spec.act_order:
        out.append("act-order with zero points is not supported by Marlin kernels")
    return out


def _group_layers(src: SourceCheckpoint, settings: Settings, parts: dict[str, Part]) -> list[LayerSpec]:
    fmt = settings.source_format
    stacks: dict[str, dict[int, dict[str, Part]]] = {}
    spelled: dict[tuple[str, int], str] = {}  # (stack, expert number) -> the digits as written
    dense: list[Part] = []
    for prefix, part in parts.items():
        m = EXPERT_RE.match(prefix)
        if not m:
            dense.append(part)
            continue
        base, digits = m["base"], m["e"]
        if len(digits) > MAX_EXPERT_DIGITS:
            raise CheckpointError(f"{src.describe(part.tensors[next(iter(part.tensors))])}: expert number {digits[:20]}"
                                  f"{'...' if len(digits) > 20 else ''} ({len(digits)} digits) is not a plausible"
                                  " expert index")
        e = int(digits)
        if spelled.setdefault((base, e), digits) != digits:
            raise CheckpointError(f"{base}.experts.{spelled[base, e]} and {base}.experts.{digits} both name expert {e}"
                                  f" in {src.root}: ambiguous expert numbering")
        experts = stacks.setdefault(base, {})
        role = EXPERT_ROLE[m["proj"]]
        have = experts.setdefault(e, {})
        if role in have:
            raise CheckpointError(f"{base}.experts.{digits}: both {have[role].prefix} and {prefix} are its {role}"
                                  f" projection in {src.root} (Mixtral w1/w3/w2 and gate/up/down_proj names mixed)")
        have[role] = part
    layers = [_make_layer(src, settings, part.prefix, [[part]], 0) for part in dense]
    for base, experts in sorted(stacks.items()):
        ids = sorted(experts)
        if ids[-1] != len(ids) - 1:  # ids are distinct and sorted, so this is "not exactly 0 .. n-1"
            missing = _first_missing(ids, 8)
            raise CheckpointError(f"{base}.experts: experts {missing} are missing (found {len(ids)} experts up to"
                                  f" {ids[-1]} in {src.root}): missing tensor")
        roles0 = set(experts[0])
        for e in ids:
            if set(experts[e]) != roles0:
                raise CheckpointError(f"{base}.experts.{e} has projections {sorted(experts[e])}, expert 0 has"
                                      f" {sorted(roles0)} in {src.root}: missing or extra tensor")
        if "gate_up" in roles0 and ({"gate", "up"} & roles0):
            raise CheckpointError(f"{base}.experts: both fused gate_up_proj and separate gate/up projections in"
                                  f" {src.root}")
        if ("gate" in roles0) != ("up" in roles0):
            raise CheckpointError(f"{base}.experts: has {'gate' if 'gate' in roles0 else 'up'} projections without"
                                  f" {'up' if 'gate' in roles0 else 'gate'} in {src.root}: missing tensor")
        if {"gate", "up"} <= roles0 or "gate_up" in roles0:
            segs = ["gate", "up"] if "gate" in roles0 else ["gate_up"]
            layers.append(_make_layer(src, settings, f"{base}.experts.gate_up_proj",
                                      [[experts[e][r] for r in segs] for e in ids], len(ids)))
        if "down" in roles0:
            layers.append(_make_layer(src, settings, f"{base}.experts.down_proj",
                                      [[experts[e]["down"]] for e in ids], len(ids)))
    layers.sort(key=lambda spec: _natural_key(spec.name))
    for a, b in zip(layers, layers[1:]):
        if a.name == b.name:  # e.g. a dense prefix "...experts.gate_up_proj" beside a stack of that name
            raise CheckpointError(f"{a.name}: two quantized layers would be written under this name in {src.root}")
    return layers


def _first_missing(ids: list[int], count: int) -> list[int]:
    """The first ``count`` integers in [0, max(ids)] absent from sorted distinct ``ids``; O(len(ids) + count) whatever
    the values (a number written in a tensor name must not size a set)."""
    out, expected = [], 0
    for i in ids:
        while expected < i and len(out) < count:
            out.append(expected)
            expected += 1
        if len(out) == count:
            break
        expected = i + 1
    return out


def _make_layer(src, settings: Settings, name: str, parts: list[list[Part]], num_experts: int) -> LayerSpec:
    first = parts[0][0]
    args = settings.args_for(first.prefix)
    for segs in parts:
        for p in segs:
            pargs = settings.args_for(p.prefix)
            if (p.size_k, pargs, p.scale_dtype) != (first.size_k, args, first.scale_dtype) or (
                    [q.size_n for q in segs] != [q.size_n for q in parts[0]]):
                raise CheckpointError(
                    f"{name}: part {p.prefix} (K = {p.size_k}, N = {p.size_n}, scales {p.scale_dtype}, {pargs}) does"
                    f" not match {first.prefix} (K = {first.size_k}, N = {first.size_n}, scales {first.scale_dtype},"
                    f" {args}) in {src.root}; parts of one stack must agree"
                )
    fmt = settings.source_format
    if args.microscale:
        act_dtype = microscale.act_dtype_for(src, args)
    else:
        act_dtype = np.dtype(np.float16) if fmt == FP8 else ACT_DTYPES[first.scale_dtype]
    # one group over all of K needs no act-order: every row order gives the same groups (vLLM drops it too)
    act_order = args.act_order and first.num_groups > 1
    spec = LayerSpec(name, fmt, _weight_type(fmt, args), args.group_size, act_order, first.size_k,
                     sum(p.size_n for p in parts[0]), num_experts, parts, act_dtype, microscale=args.microscale)
    spec.problems = _problems(spec, args)
    return spec
