"""Reading a Marlin checkpoint written by ``repack``: the manifest, the tensors, ``MarlinWeight`` objects."""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

import workbench
from workbench.checkpoint import microscale
from workbench.checkpoint.convert import MarlinTensors
from workbench.checkpoint.files import CheckpointError, is_regular, read_json, short_repr
from workbench.checkpoint.layers import MARLIN_SUFFIXES
from workbench.checkpoint.output import read_marker, require_complete
from workbench.checkpoint.repack import FORMAT_NAME, MANIFEST
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

    def _read(self, name: str, suffix: str, index: int | None = None):
        """Tensor ``name.suffix`` when the manifest lists it for that layer (a pass-through tensor that merely has
        such a name is never taken for part of a layer), else None."""
        tname = f"{name}.{suffix}"
        return self.files.read(tname, index) if tname in self.layers[name]["tensors"] else None

    def tensors(self, name: str, expert: int | None = None) -> MarlinTensors:
        index = expert if self.layers[name]["num_experts"] else None
        extra = {s: t for s in ("global_scale",) if (t := self._read(name, s, index)) is not None}
        return MarlinTensors(*(self._read(name, s, index) for s in ("qweight", "scales", "zeros", "g_idx", "perm")),
                             extra=extra)

    def weight(self, name: str) -> MarlinWeight:
        rec = self.layers[name]
        qweight, scales, zeros, g_idx, perm = (self._read(name, s) for s in ("qweight", "scales", "zeros", "g_idx",
                                                                              "perm"))
        if "microscale" in rec:  # NVFP4 / MXFP4 / MXFP8: uint8 scales, NVFP4's global scale
            return microscale.marlin_weight(qweight, scales, self._read(name, "global_scale"), rec["size_k"],
                                            rec["size_n"], rec["group_size"], ScalarType.parse(rec["weight_type"]),
                                            rec["act_dtype"], rec["num_experts"] or None, rec)
        weight = MarlinWeight(qweight, scales, zeros, g_idx, perm, rec["size_k"], rec["size_n"], rec["group_size"],
                              ScalarType.parse(rec["weight_type"]), np.dtype(scales.dtype), True,
                              rec["num_experts"] or None)
        try:  # the manifest's true sizes and the padded tensors must agree before a kernel trusts them
            weight.require_padded_arrays()
        except ValueError as exc:
            raise CheckpointError(f"{self.root}: layer {name!r}: {exc}") from None
        return weight


def is_marlin_checkpoint(path) -> bool:
    """A directory ``repack`` wrote, finished or not (``open_marlin`` then refuses an unfinished one): it holds the
    manifest or this tool's marker, and is never to be read as a source checkpoint."""
    path = os.fspath(path)
    return is_regular(os.path.join(path, MANIFEST)) or read_marker(path) is not None


# manifest key -> (type, what) for the whole file and for each layer record; checked before any key is used
MANIFEST_KEYS = {"workbench_format": str, "format_version": (int, str), "source_format": str, "layers": dict,
                 "passthrough": list, "weight_map": dict}
LAYER_KEYS = {"source_format": str, "weight_type": str, "bits": int, "group_size": int, "act_order": bool,
              "size_k": int, "size_n": int, "num_experts": int, "act_dtype": str, "segments": list, "tensors": list}


def _check_manifest(manifest: dict, where: str) -> None:
    for key, kind in MANIFEST_KEYS.items():
        if not isinstance(manifest.get(key), kind):
            raise CheckpointError(f"{where}: {key} = {short_repr(manifest.get(key))} is missing or not a"
                                  f" {_kind_name(kind)}")
    if manifest["workbench_format"] != FORMAT_NAME:
        raise CheckpointError(f"{where}: workbench_format = {manifest['workbench_format']!r}, expected {FORMAT_NAME!r}")
    if manifest["format_version"] != workbench.FORMAT_VERSION:
        raise CheckpointError(f"{where}: format_version = {manifest['format_version']!r}; this workbench reads version"
                              f" {workbench.FORMAT_VERSION!r}")
    if not all(isinstance(n, str) for n in manifest["passthrough"]):
        raise CheckpointError(f"{where}: passthrough = {short_repr(manifest['passthrough'])} is not a list of names")
    if not all(isinstance(v, str) for v in manifest["weight_map"].values()):
        raise CheckpointError(f"{where}: weight_map values must be file names")
    for name, rec in manifest["layers"].items():
        if not isinstance(rec, dict):
            raise CheckpointError(f"{where}: layers[{name!r}] is a {type(rec).__name__}, expected an object")
        for key, kind in LAYER_KEYS.items():
            value = rec.get(key)
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise CheckpointError(f"{where}: layers[{name!r}].{key} = {short_repr(value)} is missing or not a"
                                      f" {_kind_name(kind)}")
        allowed = {f"{name}.{suffix}" for suffix in MARLIN_SUFFIXES}
        for tname in rec["tensors"]:
            if tname not in allowed or tname not in manifest["weight_map"]:
                raise CheckpointError(f"{where}: layers[{name!r}].tensors lists {short_repr(tname)}, which is not one of"
                                      f" that layer's Marlin tensors in weight_map")
        try:
            ScalarType.parse(rec["weight_type"])
        except (KeyError, ValueError):
            raise CheckpointError(f"{where}: layers[{name!r}].weight_type = {rec['weight_type']!r} is no weight"
                                  " type") from None


def _kind_name(kind) -> str:
    return " or ".join(k.__name__ for k in kind) if isinstance(kind, tuple) else kind.__name__


def open_marlin(path) -> MarlinCheckpoint:
    path = os.fspath(path)
    manifest_path = os.path.join(path, MANIFEST)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such directory")
    require_complete(path)
    if not os.path.lexists(manifest_path):
        raise CheckpointError(f"{path}: no {MANIFEST}, so this is not a complete Marlin checkpoint")
    manifest = read_json(manifest_path, MANIFEST)
    _check_manifest(manifest, manifest_path)
    files = open_source(path)
    expected = set(manifest["weight_map"])
    missing = sorted(expected - set(files.where))
    if missing:
        raise CheckpointError(f"{path}: tensor {missing[0]!r} listed in {MANIFEST} is in no file ({len(missing)}"
                              " missing): missing tensor")
    extra = sorted(set(files.where) - expected)
    if extra:
        raise CheckpointError(f"{files.describe(extra[0])} is not listed in {MANIFEST}: extra tensor")
    return MarlinCheckpoint(path, manifest, files)
