"""A checkpoint on disk: its safetensors shards (single file or index json) and its quantization settings.

Layouts understood (what the producing tools write):

* ``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``
  (``{"metadata": {...}, "weight_map": {tensor: file}}``), or a single ``.safetensors`` path;
* quantization settings from ``config.json["quantization_config"]`` (transformers / Optimum / llm-compressor /
  DeepSeek-V3), else ``quantize_config.json`` (AutoGPTQ, GPTQModel), else ``quant_config.json`` (AutoAWQ), else
  ``hf_quant_config.json`` (NVIDIA ModelOpt: its ``quantization`` object, read as ``quant_method = "modelopt"``).
"""
from __future__ import annotations

import glob
import os
from dataclasses import dataclass, field

from workbench.checkpoint.files import CheckpointError, is_regular, kind_of, read_json
from workbench.checkpoint.safetensors_io import SafetensorsFile, TensorInfo

INDEX_NAME = "model.safetensors.index.json"
CONFIG_FILES = ("quantize_config.json", "quant_config.json", "hf_quant_config.json")
MODELOPT_CONFIG = "hf_quant_config.json"


@dataclass
class SourceCheckpoint:
    root: str  # directory holding the files
    files: dict[str, SafetensorsFile]  # file name -> parsed header
    where: dict[str, str]  # tensor name -> file name
    config: dict  # config.json (may be empty)
    quant_config: dict  # the quantization settings, wherever they came from (may be empty)
    quant_config_source: str  # file (and key) the settings came from, for messages
    other_files: list[str] = field(default_factory=list)  # non-safetensors files to carry over (tokenizer, ...)

    def info(self, name: str) -> TensorInfo:
        return self.files[self.where[name]].tensors[name]

    def read(self, name: str, index: int | None = None):
        return self.files[self.where[name]].read(name, index)

    def path_of(self, name: str) -> str:
        return os.path.join(self.root, self.where[name])

    def describe(self, name: str) -> str:
        """'file: tensor NAME (I32 [64, 256])' for error messages."""
        info = self.info(name)
        return f"{self.path_of(name)}: tensor {name!r} ({info.dtype} {list(info.shape)})"

    @property
    def names(self) -> list[str]:
        return list(self.where)


def _shard_name(name, index_path: str, tensor: str) -> str:
    """A shard file named in an index: a relative path inside the checkpoint (the file itself may be a symlink, as
    the Hugging Face cache stores them)."""
    if not isinstance(name, str) or not name or "\0" in name:
        raise CheckpointError(f"{index_path}: weight_map[{tensor!r}] = {name!r} is not a file name")
    if os.path.isabs(name) or ".." in name.replace("\\", "/").split("/"):
        raise CheckpointError(f"{index_path}: weight_map[{tensor!r}] = {name!r} points outside the checkpoint"
                              " directory (absolute or with '..'); shard names must be relative to it")
    return name


def _index_files(root: str, index_path: str) -> tuple[dict, list[str]]:
    index = read_json(index_path, "index json")
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index_path}: has no 'weight_map' object mapping tensor names to shard files (got"
                              f" {type(weight_map).__name__})")
    names = sorted({_shard_name(fname, index_path, tname) for tname, fname in weight_map.items()})
    return weight_map, names


def _optional_json(path: str, what: str) -> dict | None:
    """A config file when one exists under that name (anything there but a regular JSON object is refused)."""
    return read_json(path, what) if os.path.lexists(path) else None


def open_source(path: str | os.PathLike) -> SourceCheckpoint:
    """Open and validate a checkpoint directory (or one .safetensors file) without reading any tensor data."""
    path = os.fspath(path)
    if not os.path.exists(path):
        what = "a dangling symlink" if os.path.lexists(path) else "no such file or directory"
        raise CheckpointError(f"{path}: {what}")
    index_path = os.path.join(path, INDEX_NAME)
    weight_map = None
    if not os.path.isdir(path):
        if not is_regular(path):
            raise CheckpointError(f"{path}: is {kind_of(os.stat(path).st_mode)}, not a checkpoint directory or a"
                                  " .safetensors file")
        root, names = os.path.dirname(path) or ".", [os.path.basename(path)]
    else:
        root = path
        if os.path.lexists(index_path):
            weight_map, names = _index_files(root, index_path)
        else:
            names = sorted(os.path.basename(p) for p in glob.glob(os.path.join(glob.escape(root), "*.safetensors")))
            if len(names) > 1:
                raise CheckpointError(
                    f"{root}: {len(names)} .safetensors files ({', '.join(names[:4])}...) but no {INDEX_NAME}"
                )
        if not names:
            raise CheckpointError(f"{root}: no .safetensors file found")
    files: dict[str, SafetensorsFile] = {}
    for name in names:
        file_path = os.path.join(root, name)
        if weight_map is not None and not os.path.lexists(file_path):
            raise CheckpointError(f"{index_path}: lists shard {name!r}, which does not exist")
        files[name] = SafetensorsFile(file_path)
    where: dict[str, str] = {}
    for fname, st in files.items():
        for tname in st.tensors:
            if tname in where:
                raise CheckpointError(f"{root}: tensor {tname!r} appears in both {where[tname]} and {fname}")
            where[tname] = fname
    if weight_map is not None:
        for tname, fname in weight_map.items():
            if where.get(tname) != fname:
                found = f"found in {where[tname]}" if tname in where else "found in no shard"
                raise CheckpointError(f"{index_path}: maps tensor {tname!r} to {fname}, but it is {found}: missing tensor")
        extra = sorted(set(where) - set(weight_map))
        if extra:
            raise CheckpointError(
                f"{os.path.join(root, where[extra[0]])}: holds tensor {extra[0]!r} that {INDEX_NAME} does not list"
                f" ({len(extra)} such tensors): extra tensor"
            )
    config_path = os.path.join(root, "config.json")
    config = _optional_json(config_path, "config.json") or {}
    quant_config, source = {}, ""
    qc = config.get("quantization_config")
    if qc is not None and not isinstance(qc, dict):
        raise CheckpointError(f"{config_path}: quantization_config is a {type(qc).__name__}, expected an object")
    if qc:
        if str(qc.get("quant_method", "")).lower() == "modelopt" and "quantization" in qc:
            qc = _modelopt_settings(qc, config_path)
        quant_config, source = qc, f"{config_path} (quantization_config)"
    for fname in CONFIG_FILES:
        fpath = os.path.join(root, fname)
        extra_cfg = _optional_json(fpath, fname)
        if extra_cfg is None:
            continue
        if fname == MODELOPT_CONFIG:
            extra_cfg = _modelopt_settings(extra_cfg, fpath)
        if not quant_config:
            quant_config, source = extra_cfg, fpath
        else:
            _check_agree(quant_config, source, extra_cfg, fpath)
    other = []
    if os.path.isdir(path):
        for entry in sorted(os.listdir(root)):
            full = os.path.join(root, entry)
            if is_regular(full) and not entry.endswith(".safetensors") and entry != INDEX_NAME:
                other.append(entry)
    return SourceCheckpoint(root, files, where, config, quant_config, source, other)


def _modelopt_settings(cfg: dict, where: str) -> dict:
    """ModelOpt keeps its settings under "quantization" (config.json may hold them flat or the same way)."""
    inner = cfg.get("quantization", cfg)
    if not isinstance(inner, dict):
        raise CheckpointError(f"{where}: quantization is a {type(inner).__name__}, expected an object")
    return {"quant_method": "modelopt", **inner}


def _check_agree(a: dict, a_src: str, b: dict, b_src: str) -> None:
    """Two config files naming the same setting must agree (bits, group size, act order, symmetry)."""
    aliases = {"bits": ("bits", "w_bit"), "group_size": ("group_size", "q_group_size"), "desc_act": ("desc_act",),
               "sym": ("sym",)}
    for key, names in aliases.items():
        va = next((a[n] for n in names if n in a), None)
        vb = next((b[n] for n in names if n in b), None)
        if va is not None and vb is not None and va != vb:
            raise CheckpointError(f"{a_src} says {key} = {va!r} but {b_src} says {key} = {vb!r}")
