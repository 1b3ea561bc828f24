"""The ``config.json`` of a checkpoint written by ``workbench repack``.

Its tensors are Marlin tiles in this workbench's layout, so its ``quantization_config`` must not say ``gptq`` (a
loader would unpack the tiles as GPTQ words) nor ``marlin`` (vLLM and transformers read that as IST-DASLab's legacy
Marlin checkpoint, a different tensor layout with other names). It says ``quant_method: marlin-workbench``, which
loaders that do not know it refuse instead of misreading; the source's quantization settings are kept under
``source_quantization_config``. ``workbench.load(path)`` reads such a checkpoint (through ``marlin_checkpoint.json``,
the manifest); the layout is described in docs/checkpoints.md.

The source's separate quantization files (AutoGPTQ's ``quantize_config.json``, AutoAWQ's ``quant_config.json``)
are not copied: tools read them on their own and would take the directory for a GPTQ or AWQ checkpoint. Their
settings are the ones kept under ``source_quantization_config``.
"""
from __future__ import annotations

import json
import os

import workbench

QUANT_METHOD = "marlin-workbench"
SOURCE_KEY = "source_quantization_config"


def marlin_quantization_config(source_quant_config: dict, source_file: str, source_format: str) -> dict:
    """The ``quantization_config`` entry of a repacked checkpoint."""
    return {
        "quant_method": QUANT_METHOD,
        "format_version": workbench.FORMAT_VERSION,
        "workbench_version": workbench.__version__,
        "layout": "Marlin tiles as written by `workbench repack` (not the legacy IST-DASLab 'marlin' layout);"
                  " every layer is listed in marlin_checkpoint.json",
        "load_with": "workbench.load(path)",
        "source_format": source_format,
        SOURCE_KEY: source_quant_config,
        "source_quantization_config_file": source_file,
    }


def write_config(out_dir: str, source_config: dict, source_quant_config: dict, quant_config_origin: str,
                 source_format: str) -> dict:
    """Write ``out_dir/config.json``: the source's config.json (or an empty one) with the quantization config
    replaced. ``quant_config_origin`` is where the source settings came from, as ``SourceCheckpoint`` names it."""
    config = dict(source_config)
    source_file = os.path.basename(quant_config_origin.split(" (")[0]) if quant_config_origin else ""
    config["quantization_config"] = marlin_quantization_config(source_quant_config, source_file, source_format)
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    return config


def is_repacked_config(config: dict) -> bool:
    """True when a config.json (as a dict) says this workbench's Marlin layout."""
    qc = config.get("quantization_config")
    return isinstance(qc, dict) and qc.get("quant_method") == QUANT_METHOD
