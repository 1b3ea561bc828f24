"""Real checkpoints: read (GPTQ, AWQ, compressed-tensors pack-quantized, block-FP8, MoE expert stacks), inspect,
repack into Marlin layout, verify bit for bit, and load as ``MarlinWeight`` objects.

    >>> from workbench.checkpoint import inspect, repack, verify, load
    >>> plan = inspect("ckpt/")                       # layers, shapes, Marlin compatibility (nothing read but headers)
    >>> repack("ckpt/", "ckpt-marlin/")               # streamed, atomic
    >>> verify("ckpt-marlin/", against="ckpt/").ok    # exact
    >>> weights = load("ckpt-marlin/")                # {layer name: MarlinWeight}
"""
from __future__ import annotations

import os

from workbench.checkpoint.layers import LayerSpec, Plan, discover
from workbench.checkpoint.repack import repack
from workbench.checkpoint.safetensors_io import CheckpointError
from workbench.checkpoint.source import open_source
from workbench.checkpoint.verify import VerifyReport, verify

__all__ = ["CheckpointError", "LayerSpec", "Plan", "VerifyReport", "inspect", "load", "repack", "verify"]


def inspect(path) -> Plan:
    """The quantized layers of a source checkpoint (reads headers, configs and the tiny weight_shape tensors only)."""
    return discover(open_source(path))


def load(path, *, layers=None, backend: str = "auto") -> dict:
    """``{layer name: MarlinWeight}`` from a Marlin checkpoint (written by ``repack``) or, converted in memory, from a
    source checkpoint. ``layers`` limits the result to those names."""
    from workbench.checkpoint.marlin_ckpt import is_marlin_checkpoint, open_marlin

    wanted = None if layers is None else set(layers)
    if os.path.isdir(os.fspath(path)) and is_marlin_checkpoint(path):
        ckpt = open_marlin(path)
        names = list(ckpt.layers)
        _check_wanted(wanted, names, path)
        return {name: ckpt.weight(name) for name in names if wanted is None or name in wanted}
    return _load_source(path, wanted, backend)


def _check_wanted(wanted, names, path) -> None:
    if wanted is not None and not wanted <= set(names):
        missing = sorted(wanted - set(names))
        raise CheckpointError(f"{path}: no quantized layer named {missing[0]!r} ({len(names)} layers, e.g."
                              f" {names[:3]})")


def _load_source(path, wanted, backend: str) -> dict:
    import numpy as np

    from workbench.checkpoint import microscale
    from workbench.checkpoint.repack import check_repackable, choose_backend, convert_layer
    from workbench.weight import MarlinWeight

    src = open_source(path)
    plan = discover(src)
    _check_wanted(wanted, [s.name for s in plan.layers], path)
    plan.layers = [s for s in plan.layers if wanted is None or s.name in wanted]
    check_repackable(plan, src.root)
    ops_backend, _ = choose_backend(backend)
    result = {}
    for spec in plan.layers:
        parts = [convert_layer(src, spec, e, ops_backend) for e in range(max(spec.num_experts, 1))]
        stack = (lambda attr: None if getattr(parts[0], attr) is None else
                 (np.stack([getattr(p, attr) for p in parts]) if spec.num_experts else getattr(parts[0], attr)))
        if spec.microscale:
            extra = [p.extra.get("global_scale") for p in parts]
            g = None if extra[0] is None else (np.stack(extra) if spec.num_experts else extra[0])
            result[spec.name] = microscale.marlin_weight(stack("qweight"), stack("scales"), g, spec.size_k,
                                                         spec.size_n, spec.group_size, spec.weight_type,
                                                         spec.act_dtype, spec.num_experts or None,
                                                         spec.manifest_extras)
            continue
        result[spec.name] = MarlinWeight(stack("qweight"), stack("scales"), stack("zeros"), stack("g_idx"),
                                         stack("perm"), spec.size_k, spec.size_n, spec.group_size, spec.weight_type,
                                         np.dtype(spec.act_dtype), True, spec.num_experts or None)
    return result
