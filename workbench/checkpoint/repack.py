"""``repack``: a source checkpoint -> a Marlin checkpoint, streamed tensor by tensor, written atomically.

Output layout (directory):

* ``model.safetensors`` (or ``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``): per quantized
  layer ``<name>.qweight`` I32 ([E,] K/16, N*16/pf), ``<name>.scales`` F16/BF16 ([E,] ng, N) permuted,
  ``<name>.zeros`` I32 ([E,] ng, N/pf) for u4/u8, ``<name>.g_idx`` / ``<name>.perm`` I32 ([E,] K) for act-order;
  every other tensor byte-identical under its own name. Each file's ``__metadata__`` names the workbench format,
  its version, the source format and the layers it holds (JSON strings).
* ``marlin_checkpoint.json``: the whole layer table; ``.marlin-workbench.json``: the marker that says this tool wrote
  the directory and whether it is complete.
* ``config.json``: the source's, with ``quantization_config`` saying this workbench's Marlin layout
  (``workbench.repacked_config``); the source's other files (tokenizer, ...) copied unchanged.

Memory: one layer (or one expert of a stack) is resident at a time, plus the op's temporaries; pass-through tensors
are copied in 64 MiB chunks. Atomicity: everything is written under ``<out>.partial`` (marked, locked) and renamed
at the end; on an error that folder is removed, an interrupted or killed run leaves it marked partial
(``workbench.checkpoint.output`` has the states).
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass

import numpy as np

import workbench
from workbench.checkpoint.convert import nonfinite_scales, to_marlin
from workbench.checkpoint.layers import LayerSpec, Plan, discover
from workbench.checkpoint.output import MARKER, OutputDir, OutputError, read_marker
from workbench.checkpoint.safetensors_io import (CheckpointError, PlannedTensor, StreamingWriter, encode_header,
                                                 planned_header)
from workbench.checkpoint.source import CONFIG_FILES, INDEX_NAME, SourceCheckpoint, open_source
from workbench.repacked_config import write_config
from workbench.text import count

MANIFEST = "marlin_checkpoint.json"
FORMAT_NAME = "marlin-workbench"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3


def choose_backend(backend: str) -> tuple[str, str]:
    """(ops backend, sentence saying which path runs)."""
    from workbench import hardware

    if backend not in ("auto", "numpy", "numba"):
        raise ValueError(f"backend = {backend!r} is not auto, numpy or numba")
    if backend == "auto":
        backend = "numba" if hardware.gpu_available() and _numba_backend_built() else "numpy"
    if backend == "numba":
        return "numba", f"Numba CUDA kernels on {hardware.describe()}"
    return "numpy", "NumPy reference path on the CPU" + ("" if hardware.gpu_available() else " (no CUDA GPU found)")


def _numba_backend_built() -> bool:
    """True when workbench.ops dispatches to the Numba kernels (a tiny probe; the dispatcher may not have them yet)."""
    from workbench import ops

    try:
        ops.marlin_permute_scales(np.ones((1, 64), np.float16), 16, 64, -1, backend="numba")
        return True
    except NotImplementedError:
        return False


def layer_tensors(spec: LayerSpec) -> list[PlannedTensor]:
    """The Marlin tensors of one layer, in file order."""
    lead = (spec.num_experts,) if spec.num_experts else ()
    pf = 32 // spec.bits
    ng = spec.parts[0][0].num_groups
    out = [PlannedTensor(f"{spec.name}.qweight", "I32", lead + (spec.size_k // 16, spec.size_n * 16 // pf)),
           PlannedTensor(f"{spec.name}.scales", spec.marlin_scales_tag, lead + (ng, spec.size_n))]
    if spec.weight_type.has_zero_points:
        out.append(PlannedTensor(f"{spec.name}.zeros", "I32", lead + (ng, spec.size_n // pf)))
    if spec.act_order:
        out += [PlannedTensor(f"{spec.name}.g_idx", "I32", lead + (spec.size_k,)),
                PlannedTensor(f"{spec.name}.perm", "I32", lead + (spec.size_k,))]
    out += [PlannedTensor(f"{spec.name}.{suffix}", tag, lead + shape)
            for suffix, tag, shape in spec.extra_marlin_tensors]
    return out


def layer_record(spec: LayerSpec) -> dict:
    """What the manifest and the file metadata say about a layer."""
    return {
        "source_format": spec.source_format, "weight_type": spec.weight_type.label, "bits": spec.bits,
        "group_size": spec.group_size, "act_order": spec.act_order, "size_k": spec.size_k, "size_n": spec.size_n,
        "num_experts": spec.num_experts, "act_dtype": np.dtype(spec.act_dtype).name,
        "segments": [[p.prefix, p.size_n] for p in spec.parts[0]],
        "tensors": [t.name for t in layer_tensors(spec)], **spec.manifest_extras,
    }


@dataclass
class _Unit:
    """A layer or a pass-through tensor: the granularity at which output is assigned to files."""

    layer: LayerSpec | None
    name: str
    tensors: list[PlannedTensor]
    source_bytes: int

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def _units(src: SourceCheckpoint, plan: Plan) -> list[_Unit]:
    units = []
    for spec in plan.layers:  # discover refused pass-through names that collide with a layer's Marlin tensors
        units.append(_Unit(spec, spec.name, layer_tensors(spec), sum(src.info(n).nbytes for n in spec.source_tensors)))
    for name in plan.passthrough:
        info = src.info(name)
        units.append(_Unit(None, name, [PlannedTensor(name, info.dtype, info.shape)], info.nbytes))
    return units


def _shard(units: list[_Unit], max_bytes: int) -> list[list[_Unit]]:
    shards: list[list[_Unit]] = [[]]
    size = 0
    for unit in units:
        if shards[-1] and size + unit.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(unit)
        size += unit.nbytes
    return shards


def check_repackable(plan: Plan, where: str) -> None:
    """Refuse a plan with nothing to convert or with layers Marlin cannot take; ``where`` names the checkpoint."""
    if not plan.layers:
        raise CheckpointError(f"{where}: no quantized layers found: nothing to repack")
    bad = [spec for spec in plan.layers if spec.problems]
    if bad:
        lines = [f"  {spec.name}: {'; '.join(spec.problems)}" for spec in bad[:20]]
        more = f"\n  ... and {len(bad) - 20} more" if len(bad) > 20 else ""
        raise CheckpointError(f"{where}: {len(bad)} layer(s) are not Marlin-compatible:\n" + "\n".join(lines) + more)


def source_paths(src: SourceCheckpoint, path) -> list[str]:
    """Every path the source is read from, which the output may not be, contain or lie inside: the source directory
    (for a single-file source, that file) and each shard and config file (symlink targets resolve in the check)."""
    paths = [os.path.join(src.root, f) for f in src.files]
    paths += [os.path.join(src.root, f) for f in (INDEX_NAME, "config.json", *CONFIG_FILES)
              if os.path.lexists(os.path.join(src.root, f))]
    return paths + ([src.root] if os.path.isdir(os.fspath(path)) else [])


def repack(path, out, *, force: bool = False, backend: str = "auto", max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
           progress: bool = True, log=None) -> dict:
    """Write the Marlin checkpoint of ``path`` to directory ``out``; return the manifest. Every check (input, output
    path, header sizes) runs before anything is created; the writing follows ``output.OutputDir``'s states."""
    log = log or (lambda msg: print(msg, file=sys.stderr))
    if read_marker(os.fspath(path)) is not None:
        raise CheckpointError(f"{path}: is a Marlin checkpoint written by `workbench repack` (it holds {MARKER}), not a"
                              " source checkpoint to repack")
    src = open_source(path)
    target = OutputDir(os.fspath(out), source_paths(src, path), force=force, source=os.path.abspath(src.root), log=log)
    out = target.out
    plan = discover(src)
    check_repackable(plan, src.root)
    ops_backend, sentence = choose_backend(backend)
    units = _units(src, plan)
    shards = _shard(units, max_shard_bytes)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    for fname, shard in zip(names, shards):  # a header the format refuses is refused here, before any write
        encode_header(planned_header([t for u in shard for t in u.tensors], _shard_metadata(shard, plan)),
                      os.path.join(out, fname))
    log(f"repack: {count(len(plan.layers), 'quantized layer')} ({plan.settings.source_format}),"
        f" {count(len(plan.passthrough), 'tensor')} carried over; {sentence}")
    manifest = {
        "workbench_format": FORMAT_NAME, "format_version": workbench.FORMAT_VERSION,
        "workbench_version": workbench.__version__, "source_format": plan.settings.source_format,
        "source": os.path.abspath(src.root), "quant_config_source": src.quant_config_source,
        "layers": {spec.name: layer_record(spec) for spec in plan.layers},
        "passthrough": list(plan.passthrough), "weight_map": {},
    }
    from tqdm.auto import tqdm

    with target as tmp:
        try:
            total = sum(u.source_bytes for u in units)
            with tqdm(total=total, unit="B", unit_scale=True, desc=f"repack ({ops_backend})", disable=not progress,
                      file=sys.stderr) as bar:
                for fname, shard in zip(names, shards):
                    _write_shard(src, os.path.join(tmp, fname), shard, plan, ops_backend, bar, log)
                    for unit in shard:
                        for t in unit.tensors:
                            manifest["weight_map"][t.name] = fname
            if len(shards) > 1:
                index = {"metadata": {"total_size": sum(u.nbytes for u in units), "workbench_format": FORMAT_NAME},
                         "weight_map": manifest["weight_map"]}
                with open(os.path.join(tmp, INDEX_NAME), "w", encoding="utf-8") as f:
                    json.dump(index, f, indent=2)
            for other in src.other_files:
                if other not in (MANIFEST, "config.json", *CONFIG_FILES):  # their settings move into config.json
                    shutil.copy2(os.path.join(src.root, other), os.path.join(tmp, other))
            write_config(tmp, src.config, src.quant_config, src.quant_config_source, plan.settings.source_format)
            with open(os.path.join(tmp, MANIFEST), "w", encoding="utf-8") as f:
                json.dump(manifest, f, indent=2)
                f.flush()
                os.fsync(f.fileno())
            target.publish()
        except OSError as exc:  # disk full, read-only mount, quota: the partial folder is removed on the way out
            where = exc.filename or tmp
            raise OutputError(f"{where}: {exc.strerror or exc} while writing the output; nothing was left under"
                              f" {out}") from None
    log(f"repack: wrote {out} ({count(len(shards), 'file')})")
    return manifest


def convert_layer(src: SourceCheckpoint, spec: LayerSpec, expert: int, backend: str):
    """``to_marlin``, with an op's refusal (a ValueError naming values only) said with the layer and checkpoint."""
    try:
        return to_marlin(src, spec, expert, backend)
    except CheckpointError:
        raise
    except (ValueError, TypeError) as exc:
        which = f" expert {expert}" if spec.num_experts else ""
        raise CheckpointError(f"{src.root}: layer {spec.name!r}{which}: {exc}") from exc


def _shard_metadata(shard: list[_Unit], plan: Plan) -> dict[str, str]:
    layers = {u.layer.name: layer_record(u.layer) for u in shard if u.layer is not None}
    return {"format": "pt", "workbench_format": FORMAT_NAME, "workbench_format_version": workbench.FORMAT_VERSION,
            "source_format": plan.settings.source_format, "marlin_layers": json.dumps(layers)}


def _write_shard(src: SourceCheckpoint, path: str, shard: list[_Unit], plan: Plan, backend: str, bar, log) -> None:
    writer = StreamingWriter(path, [t for u in shard for t in u.tensors], _shard_metadata(shard, plan))
    try:
        for unit in shard:
            if unit.layer is None:
                src.files[src.where[unit.name]].copy_bytes_to(unit.name, lambda chunk: writer.append(unit.name, chunk))
                bar.update(unit.source_bytes)
                continue
            spec = unit.layer
            experts = range(spec.num_experts) if spec.num_experts else [None]
            per_expert = unit.source_bytes // max(spec.num_experts, 1)
            for warning in nonfinite_scales(src, spec):
                log(f"repack: warning: {warning}")
            for e in experts:
                m = convert_layer(src, spec, e or 0, backend)
                writer.write(f"{spec.name}.qweight", m.qweight, e)
                writer.write(f"{spec.name}.scales", m.scales, e)
                if spec.weight_type.has_zero_points:
                    writer.write(f"{spec.name}.zeros", m.zeros, e)
                if spec.act_order:
                    writer.write(f"{spec.name}.g_idx", m.g_idx, e)
                    writer.write(f"{spec.name}.perm", m.perm, e)
                for suffix, value in m.extra.items():
                    writer.write(f"{spec.name}.{suffix}", value, e)
                bar.update(per_expert)
        writer.close()
    except BaseException:
        writer.abort()
        raise
