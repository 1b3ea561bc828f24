"""Quantization settings as the producing tools write them, normalised to one record.

| tool | where | keys read |
|---|---|---|
| AutoGPTQ / GPTQModel / Optimum | ``quantize_config.json`` or ``config.json["quantization_config"]`` | ``quant_method="gptq"``, ``bits``, ``group_size``, ``desc_act``, ``sym``, ``checkpoint_format`` (``gptq`` = v1, zeros stored minus one; ``gptq_v2``) |
| AutoAWQ | ``config.json["quantization_config"]`` or ``quant_config.json`` | ``quant_method="awq"``, ``bits``/``w_bit``, ``group_size``/``q_group_size``, ``zero_point``, ``version`` (``gemm``) |
| llm-compressor | ``config.json["quantization_config"]`` | ``quant_method="compressed-tensors"``, ``format="pack-quantized"``, ``config_groups.*.{targets, weights: {num_bits, type, symmetric, strategy, group_size, actorder}}``, ``ignore`` |
| DeepSeek-V3 style | ``config.json["quantization_config"]`` | ``quant_method="fp8"``, ``fmt="e4m3"``, ``weight_block_size=[128, 128]`` |
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from workbench.checkpoint.files import CheckpointError, short_repr

GPTQ, GPTQ_V2, AWQ, CT, FP8 = "gptq", "gptq_v2", "awq", "compressed-tensors", "block-fp8"
SUPPORTED_BITS = (4, 8)


@dataclass(frozen=True)
class WeightArgs:
    """How one family of layers is quantized."""

    bits: int
    group_size: int  # -1 = one group over K (channelwise)
    symmetric: bool
    act_order: bool  # desc_act / actorder="group": a g_idx tensor decides the groups
    block: tuple[int, int] | None = None  # block-FP8 (block_n, block_k)


@dataclass(frozen=True)
class Settings:
    source_format: str  # one of GPTQ, GPTQ_V2, AWQ, CT, FP8
    origin: str  # file the settings came from (for messages)
    default: WeightArgs | None  # GPTQ / AWQ / FP8: one setting for every layer
    groups: tuple[tuple[tuple[str, ...], WeightArgs], ...] = ()  # compressed-tensors: (targets, args) in order
    ignore: tuple[str, ...] = ()

    def args_for(self, prefix: str) -> WeightArgs:
        if self.source_format != CT:
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
                          " compressed-tensors or fp8")


def _parse_compressed_tensors(qc: dict, origin: str) -> Settings:
    groups = []
    global_format = qc.get("format")
    config_groups = qc.get("config_groups")
    for gname, entry in ({} if config_groups is None else _object(config_groups, origin, "config_groups")).items():
        entry = _object(entry, origin, f"config_groups.{gname}")
        fmt = entry.get("format", global_format)
        weights = entry.get("weights")
        if not weights:
            continue
        weights = _object(weights, origin, f"config_groups.{gname}.weights")
        if fmt != "pack-quantized":
            raise CheckpointError(f"{origin}: config_groups.{gname} has format {fmt!r}; only 'pack-quantized' is"
                                  " supported")
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
        targets = _strings(entry.get("targets"), origin, f"config_groups.{gname}.targets")
        for target in targets:
            if target.startswith("re:"):
                try:
                    re.compile(target[3:])
                except re.error as exc:
                    raise CheckpointError(f"{origin}: config_groups.{gname}.targets: {target!r} is not a regular"
                                          f" expression ({exc})") from None
        groups.append((targets, args))
    if not groups:
        raise CheckpointError(f"{origin}: compressed-tensors config has no config_groups with weights")
    return Settings(CT, origin, None, tuple(groups), _strings(qc.get("ignore"), origin, "ignore"))
