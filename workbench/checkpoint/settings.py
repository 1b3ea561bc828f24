"""Quantization settings as the producing tools write them, normalised to one record.

| tool | where | keys read |
|---|---|---|
| AutoGPTQ / GPTQModel / Optimum | ``quantize_config.json`` or ``config.json["quantization_config"]`` | ``quant_method="gptq"``, ``bits``, ``group_size``, ``desc_act``, ``sym``, ``checkpoint_format`` (``gptq`` = v1, zeros stored minus one; ``gptq_v2``) |
| AutoAWQ | ``config.json["quantization_config"]`` or ``quant_config.json`` | ``quant_method="awq"``, ``bits``/``w_bit``, ``group_size``/``q_group_size``, ``zero_point``, ``version`` (``gemm``) |
| llm-compressor | ``config.json["quantization_config"]`` | ``quant_method="compressed-tensors"``, ``format="pack-quantized"``, ``config_groups.*.{targets, weights: {num_bits, type, symmetric, strategy, group_size, actorder}}``, ``ignore`` |
| DeepSeek-V3 style | ``config.json["quantization_config"]`` | ``quant_method="fp8"``, ``fmt="e4m3"``, ``weight_block_size=[128, 128]`` |
| llm-compressor / compressed-tensors, microscaled | ``config.json["quantization_config"]`` | ``quant_method="compressed-tensors"``, ``format`` = ``nvfp4-pack-quantized``, ``mxfp4-pack-quantized`` or ``mxfp8-quantized`` (per group or global), ``weights: {num_bits, type="float", strategy, group_size}`` |
| NVIDIA ModelOpt NVFP4 | ``config.json["quantization_config"]`` or ``hf_quant_config.json["quantization"]`` | ``quant_method="modelopt"`` (or the file), ``quant_algo="NVFP4"``, ``group_size=16``, ``exclude_modules`` |
| gpt-oss (OpenAI, transformers) | ``config.json["quantization_config"]`` | ``quant_method="mxfp4"``, ``modules_to_not_convert`` |
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from workbench.checkpoint.files import CheckpointError, short_repr

GPTQ, GPTQ_V2, AWQ, CT, FP8 = "gptq", "gptq_v2", "awq", "compressed-tensors", "block-fp8"
# microscaled sources (workbench/checkpoint/microscale.py): one checkpoint holds one of them
CT_FP4, CT_MXFP8 = "compressed-tensors-fp4", "compressed-tensors-mxfp8"
MODELOPT_NVFP4, GPT_OSS_MXFP4 = "modelopt-nvfp4", "gpt-oss-mxfp4"
MICROSCALE_SOURCES = (CT_FP4, CT_MXFP8, MODELOPT_NVFP4, GPT_OSS_MXFP4)
SUPPORTED_BITS = (4, 8)
# compressed-tensors format -> (microscaled format, source format, num_bits, group size)
CT_MICROSCALE = {"nvfp4-pack-quantized": ("nvfp4", CT_FP4, 4, 16), "mxfp4-pack-quantized": ("mxfp4", CT_FP4, 4, 32),
                 "mxfp8-quantized": ("mxfp8", CT_MXFP8, 8, 32)}


@dataclass(frozen=True)
class WeightArgs:
    """How one family of layers is quantized."""

    bits: int
    group_size: int  # -1 = one group over K (channelwise)
    symmetric: bool
    act_order: bool  # desc_act / actorder="group": a g_idx tensor decides the groups
    block: tuple[int, int] | None = None  # block-FP8 (block_n, block_k)
    microscale: str | None = None  # "nvfp4", "mxfp4" or "mxfp8" (workbench.formats.microscale)


@dataclass(frozen=True)
class Settings:
    source_format: str  # one of GPTQ, GPTQ_V2, AWQ, CT, FP8
    origin: str  # file the settings came from (for messages)
    default: WeightArgs | None  # GPTQ / AWQ / FP8: one setting for every layer
    groups: tuple[tuple[tuple[str, ...], WeightArgs], ...] = ()  # compressed-tensors: (targets, args) in order
    ignore: tuple[str, ...] = ()

    def args_for(self, prefix: str) -> WeightArgs:
        if self.source_format not in (CT, CT_FP4, CT_MXFP8):
            return self.default
        for targets, args in self.groups:
            if any(_target_matches(t, prefix) for t in targets):
                return args
        raise CheckpointError(
            f"{self.origin}: layer {prefix!r} holds weight_packed but no config_groups target matches it"
            f" (targets: {[list(t) for t, _ in self.groups]})"
        )


def _target_matches(target: str, prefix: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], prefix) is not None
    # class names ("Linear") match every quantized module we can see; other strings are module names
    return target == "Linear" or target == prefix or prefix.endswith("." + target)


def _bits(value, origin: str, key: str) -> int:
    if type(value) is not int or value not in SUPPORTED_BITS:
        raise CheckpointError(f"{origin}: {key} = {value!r} is unsupported (Marlin formats hold 4- or 8-bit codes)")
    return int(value)


def _group(value, origin: str, key: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or (value != -1 and value <= 0):
        raise CheckpointError(f"{origin}: {key} = {value!r} is not -1 or a positive integer")
    return int(value)


def _flag(value, default: bool, origin: str, key: str) -> bool:
    """A JSON boolean (absent or null: the tool's default); the string "false" is refused, not read as true."""
    if value is None:
        return default
    if not isinstance(value, bool):
        raise CheckpointError(f"{origin}: {key} = {value!r} is not true or false")
    return value


def _object(value, origin: str, key: str) -> dict:
    if not isinstance(value, dict):
        raise CheckpointError(f"{origin}: {key} is a {type(value).__name__} ({short_repr(value)}), expected an object")
    return value


def _strings(value, origin: str, key: str) -> tuple[str, ...]:
    """A list of strings (absent or null: empty)."""
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise CheckpointError(f"{origin}: {key} = {short_repr(value)} is not a list of strings")
    return tuple(value)


def parse_settings(quant_config: dict, origin: str) -> Settings | None:
    """The settings of a quantized checkpoint, or None when there are none (an unquantized checkpoint)."""
    if not quant_config:
        return None
    qc = quant_config
    method = str(qc.get("quant_method", "")).lower()
    if not method:  # AutoGPTQ's quantize_config.json and AutoAWQ's quant_config.json name no method
        if "w_bit" in qc or "version" in qc or "zero_point" in qc:
            method = "awq"
        elif "bits" in qc:
            method = "gptq"
        elif "weight_block_size" in qc:
            method = "fp8"
    if method == "gptq":
        fmt = str(qc.get("checkpoint_format", qc.get("format", "gptq"))).lower()
        if fmt not in (GPTQ, GPTQ_V2):
            raise CheckpointError(f"{origin}: checkpoint_format = {fmt!r} is not 'gptq' or 'gptq_v2'")
        group = _group(qc.get("group_size", -1), origin, "group_size")
        args = WeightArgs(_bits(qc.get("bits"), origin, "bits"), group, _flag(qc.get("sym"), True, origin, "sym"),
                          _flag(qc.get("desc_act"), False, origin, "desc_act") and group != -1)
        return Settings(fmt, origin, args)
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise CheckpointError(f"{origin}: AWQ version = {version!r} is unsupported (only the GEMM layout)")
        if not _flag(qc.get("zero_point"), True, origin, "zero_point"):
            raise CheckpointError(f"{origin}: AWQ zero_point = false is unsupported (AutoAWQ GEMM stores zeros)")
        bits = _bits(qc.get("bits", qc.get("w_bit")), origin, "bits")
        group = _group(qc.get("group_size", qc.get("q_group_size", -1)), origin, "group_size")
        return Settings(AWQ, origin, WeightArgs(bits, group, False, False))
    if method == "compressed-tensors":
        return _parse_compressed_tensors(qc, origin)
    if method == "modelopt":
        return _parse_modelopt(qc, origin)
    if method == "mxfp4":  # gpt-oss: MXFP4 experts, every other layer unquantized
        _strings(qc.get("modules_to_not_convert"), origin, "modules_to_not_convert")
        return Settings(GPT_OSS_MXFP4, origin, WeightArgs(4, 32, True, False, microscale="mxfp4"))
    if method == "fp8":
        block = qc.get("weight_block_size")
        if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
            raise CheckpointError(f"{origin}: fp8 weight_block_size = {block!r} is not [block_n, block_k]"
                                  " (only block-FP8 checkpoints are supported)")
        fmt = str(qc.get("fmt", "e4m3")).lower()
        if fmt != "e4m3":
            raise CheckpointError(f"{origin}: fp8 fmt = {fmt!r} is unsupported (Marlin FP8 is E4M3)")
        return Settings(FP8, origin, WeightArgs(8, block[1], True, False, (block[0], block[1])))
    raise CheckpointError(f"{origin}: quant_method = {qc.get('quant_method')!r} is not gptq, awq,"
                          " compressed-tensors, fp8, modelopt or mxfp4")


def _parse_modelopt(qc: dict, origin: str) -> Settings:
    """ModelOpt's settings, from config.json (flat) or hf_quant_config.json (under "quantization")."""
    algo = qc.get("quant_algo")
    if str(algo).upper() != "NVFP4":
        raise CheckpointError(f"{origin}: ModelOpt quant_algo = {algo!r} is unsupported (only NVFP4 weights)")
    group = qc.get("group_size", 16)
    if group != 16 or isinstance(group, bool):
        raise CheckpointError(f"{origin}: ModelOpt NVFP4 group_size = {group!r}; NVFP4 groups are 16")
    ignore = _strings(qc.get("exclude_modules", qc.get("ignore")), origin, "exclude_modules")
    return Settings(MODELOPT_NVFP4, origin, WeightArgs(4, 16, True, False, microscale="nvfp4"), ignore=ignore)


def _ct_microscale_group(gname: str, fmt: str, weights: dict, origin: str) -> WeightArgs:
    """A compressed-tensors config group in one of the microscaled formats; its weights must say the same."""
    name, _, bits, group = CT_MICROSCALE[fmt]
    key = f"config_groups.{gname}.weights"
    if str(weights.get("type")).lower() != "float":
        raise CheckpointError(f"{origin}: {key}.type = {weights.get('type')!r}, but format {fmt!r} holds floats")
    if weights.get("num_bits") != bits:
        raise CheckpointError(f"{origin}: {key}.num_bits = {weights.get('num_bits')!r}, but format {fmt!r} holds"
                              f" {bits}-bit elements")
    if weights.get("group_size") != group:
        raise CheckpointError(f"{origin}: {key}.group_size = {weights.get('group_size')!r}, but {name} groups are"
                              f" {group}")
    if not _flag(weights.get("symmetric"), True, origin, f"{key}.symmetric"):
        raise CheckpointError(f"{origin}: {key}.symmetric = false; {name} has no zero points")
    return WeightArgs(bits, group, True, False, microscale=name)


def _parse_compressed_tensors(qc: dict, origin: str) -> Settings:
    groups = []
    global_format = qc.get("format")
    config_groups = qc.get("config_groups")
    kinds = set()  # source format of each group: one checkpoint holds one
    for gname, entry in ({} if config_groups is None else _object(config_groups, origin, "config_groups")).items():
        entry = _object(entry, origin, f"config_groups.{gname}")
        fmt = entry.get("format") or global_format  # a group's null format defers to the checkpoint's
        weights = entry.get("weights")
        if not weights:
            continue
        weights = _object(weights, origin, f"config_groups.{gname}.weights")
        if fmt in CT_MICROSCALE:
            kinds.add(CT_MICROSCALE[fmt][1])
            groups.append((_targets(entry, gname, origin), _ct_microscale_group(gname, fmt, weights, origin)))
            continue
        kinds.add(CT)
        if fmt != "pack-quantized":
            raise CheckpointError(f"{origin}: config_groups.{gname} has format {fmt!r}; only 'pack-quantized',"
                                  f" {', '.join(map(repr, CT_MICROSCALE))} are supported")
        if str(weights.get("type", "int")).lower() != "int":
            raise CheckpointError(f"{origin}: config_groups.{gname}.weights.type = {weights.get('type')!r}"
                                  " (pack-quantized holds int codes)")
        strategy = str(weights.get("strategy", "group")).lower()
        if strategy == "group":
            group = _group(weights.get("group_size"), origin, f"config_groups.{gname}.weights.group_size")
        elif strategy == "channel":
            group = -1
        else:
            raise CheckpointError(f"{origin}: config_groups.{gname}.weights.strategy = {strategy!r} is unsupported"
                                  " (group or channel)")
        actorder = weights.get("actorder")
        key = f"config_groups.{gname}.weights"
        args = WeightArgs(_bits(weights.get("num_bits"), origin, f"{key}.num_bits"), group,
                          _flag(weights.get("symmetric"), True, origin, f"{key}.symmetric"),
                          actorder == "group" and group != -1)
        groups.append((_targets(entry, gname, origin), args))
    if not groups:
        raise CheckpointError(f"{origin}: compressed-tensors config has no config_groups with weights")
    if len(kinds) > 1:
        raise CheckpointError(f"{origin}: config_groups mix {sorted(kinds)} layers; one checkpoint of one kind is"
                              " supported")
    return Settings(kinds.pop(), origin, None, tuple(groups), _strings(qc.get("ignore"), origin, "ignore"))


def _targets(entry: dict, gname: str, origin: str) -> tuple[str, ...]:
    targets = _strings(entry.get("targets"), origin, f"config_groups.{gname}.targets")
    for target in targets:
        if target.startswith("re:"):
            try:
                re.compile(target[3:])
            except re.error as exc:
                raise CheckpointError(f"{origin}: config_groups.{gname}.targets: {target!r} is not a regular"
                                      f" expression ({exc})") from None
    return targets
