"""Reading a Marlin checkpoint written by ``repack``: the manifest, the tensors, ``MarlinWeight`` objects."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np

import workbench
from workbench.checkpoint.convert import MarlinTensors
from workbench.checkpoint.repack import FORMAT_NAME, MANIFEST
from workbench.checkpoint.safetensors_io import DTYPES, CheckpointError
from workbench.checkpoint.source import SourceCheckpoint, open_source
from workbench.scalar_types import ScalarType
from workbench.weight import MarlinWeight


@dataclass
class MarlinCheckpoint:
    root: str
    manifest: dict
    files: SourceCheckpoint  # the safetensors files, opened like any checkpoint

    @property
    def layers(self) -> dict[str, dict]:
        return self.manifest["layers"]

    def tensors(self, name: str, expert: int | None = None) -> MarlinTensors:
        rec = self.layers[name]
        index = expert if rec["num_experts"] else None
        read = (lambda suffix: self.files.read(f"{name}.{suffix}", index)
                if f"{name}.{suffix}" in self.files.where else None)
        return MarlinTensors(read("qweight"), read("scales"), read("zeros"), read("g_idx"), read("perm"))

    def weight(self, name: str) -> MarlinWeight:
        rec = self.layers[name]
        read = (lambda suffix: self.files.read(f"{name}.{suffix}") if f"{name}.{suffix}" in self.files.where
                else None)
        return MarlinWeight(read("qweight"), read("scales"), read("zeros"), read("g_idx"), read("perm"),
                            rec["size_k"], rec["size_n"], rec["group_size"], ScalarType.parse(rec["weight_type"]),
                            np.dtype(read("scales").dtype), True, rec["num_experts"] or None)


def is_marlin_checkpoint(path) -> bool:
    return os.path.isfile(os.path.join(os.fspath(path), MANIFEST))


def open_marlin(path) -> MarlinCheckpoint:
    path = os.fspath(path)
    manifest_path = os.path.join(path, MANIFEST)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: no such directory")
    if not os.path.isfile(manifest_path):
        raise CheckpointError(f"{path}: no {MANIFEST}, so this is not a complete Marlin checkpoint (an interrupted"
                              " repack leaves only a .partial- directory)")
    with open(manifest_path, encoding="utf-8") as f:
        try:
            manifest = json.load(f)
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{manifest_path}: not valid JSON ({exc})") from None
    if manifest.get("workbench_format") != FORMAT_NAME:
        raise CheckpointError(f"{manifest_path}: workbench_format = {manifest.get('workbench_format')!r}, expected"
                              f" {FORMAT_NAME!r}")
    if manifest.get("format_version") != workbench.FORMAT_VERSION:
        raise CheckpointError(f"{manifest_path}: format_version = {manifest.get('format_version')!r}; this workbench"
                              f" reads version {workbench.FORMAT_VERSION!r}")
    files = open_source(path)
    expected = set(manifest["weight_map"])
    missing = sorted(expected - set(files.where))
    if missing:
        raise CheckpointError(f"{path}: tensor {missing[0]!r} listed in {MANIFEST} is in no file ({len(missing)}"
                              " missing): missing tensor")
    extra = sorted(set(files.where) - expected)
    if extra:
        raise CheckpointError(f"{files.describe(extra[0])} is not listed in {MANIFEST}: extra tensor")
    for name, rec in manifest["layers"].items():
        for tname in rec["tensors"]:
            info = files.info(tname)
            if info.dtype not in DTYPES:
                raise CheckpointError(f"{files.describe(tname)}: unexpected dtype")
    return MarlinCheckpoint(path, manifest, files)
