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

import hashlib
import json
import os
import shutil
import sys
import time

import numpy as np

import workbench
from workbench.formats._checks import padded_k, padded_n
from workbench.checkpoint import microscale
from workbench.checkpoint.convert import nonfinite_scales, to_marlin
from workbench.checkpoint.layers import LayerSpec, Plan, discover
from workbench.checkpoint.settings import FP8
from workbench.checkpoint.executor import check_shared, check_workers, connect, parse_executor, run_dask
from workbench.checkpoint.files import is_regular
from workbench.checkpoint.manifest import Journal, check_fingerprint, fingerprint, shard_entry, shard_intact
from workbench.checkpoint.output import MARKER, KeepsPartial, KeptPartialError, OutputDir, OutputError, read_marker
from workbench.checkpoint.pipeline import (WRITING_PREFIX, ShardJob, Stats, Unit, current_rss, default_workers,
                                           describe_stats, peak_rss, run_local, writing_path)
from workbench.checkpoint.safetensors_io import (COPY_CHUNK_BYTES, CheckpointError, PlannedTensor, StreamingWriter,
                                                 dtype_tag, encode_header, planned_header)
from workbench.checkpoint.source import CONFIG_FILES, INDEX_NAME, SourceCheckpoint, open_source
from workbench.repacked_config import write_config
from workbench.text import count

MANIFEST = "marlin_checkpoint.json"
FORMAT_NAME = "marlin-workbench"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
# below this much source data, starting worker processes (each imports NumPy and opens the source) costs more than
# it saves: the local executor then converts in this process
PARALLEL_MIN_BYTES = 256 * 1024**2


def choose_backend(backend: str) -> tuple[str, str]:
    """(ops backend, sentence saying which path runs)."""
    from workbench import hardware

    if backend not in ("auto", "cpu", "numpy", "numba"):
        raise ValueError(f"backend = {backend!r} is not auto, cpu, numpy or numba")
    gpu = None  # (an explicit numpy never looks for a GPU: that would load numba.cuda in the coordinator)
    if backend == "auto":
        gpu = hardware.gpu_available()
        backend = "numba" if gpu and _numba_backend_built() else "cpu"
    if backend == "numba":
        return "numba", f"Numba CUDA kernels on {hardware.describe()}"
    why = "" if gpu is None else " (no CUDA GPU found)" if not gpu else " (the Numba kernels are not available)"
    if backend == "cpu":
        return "cpu", "compiled host loops on the CPU (workbench.host_repack, bit for bit the reference)" + why
    return "numpy", "NumPy reference path on the CPU"


def _numba_backend_built() -> bool:
    """True when workbench.ops dispatches to the Numba kernels (a tiny probe; the dispatcher may not have them yet)."""
    from workbench import ops

    try:
        ops.marlin_permute_scales(np.ones((1, 64), np.float16), 16, 64, -1, backend="numba")
        return True
    except NotImplementedError:
        return False


def layer_tensors(spec: LayerSpec) -> list[PlannedTensor]:
    """The Marlin tensors of one layer, in file order: the weight zero-padded to K_pad x N_pad (docs/formats.md,
    "Shapes that are not tile multiples"; the manifest keeps the true size_k and size_n)."""
    lead = (spec.num_experts,) if spec.num_experts else ()
    pf = 32 // spec.bits
    ng = spec.parts[0][0].num_groups
    k_pad, n_pad = padded_k(spec.size_k), padded_n(spec.size_n)
    out = [PlannedTensor(f"{spec.name}.qweight", "I32", lead + (k_pad // 16, n_pad * 16 // pf)),
           PlannedTensor(f"{spec.name}.scales", spec.marlin_scales_tag, lead + (ng, n_pad))]
    if spec.weight_type.has_zero_points:
        out.append(PlannedTensor(f"{spec.name}.zeros", "I32", lead + (ng, n_pad // pf)))
    if spec.act_order:
        out += [PlannedTensor(f"{spec.name}.g_idx", "I32", lead + (spec.size_k,)),
                PlannedTensor(f"{spec.name}.perm", "I32", lead + (spec.size_k,))]
    out += [PlannedTensor(f"{spec.name}.{suffix}", tag, lead + shape)
            for suffix, tag, shape in spec.extra_marlin_tensors]
    return out


def padding_overhead(spec: LayerSpec) -> list[dict]:
    """Per Marlin tensor the bytes the padding rule adds over the unpadded tensor (K to a multiple of 16, N to 64),
    beside what padding K and N to the next multiple of 128 would add (the in-memory padding a loader does when its
    kernels want 128-wide tiles), for all experts together."""
    experts = spec.num_experts or 1
    k, n, g = spec.size_k, spec.size_n, spec.group_size
    scale_bytes = 1 if spec.microscale else np.dtype(spec.act_dtype).itemsize
    group = 128 if spec.source_format == FP8 else g

    def groups(rows: int) -> int:
        return 1 if group == -1 else -(-rows // group)

    def ceil_to(x: int, m: int) -> int:
        return -(-x // m) * m

    # bytes of each tensor for a weight of (rows, columns); codes: bits/8 bytes each, zero points too
    sizes = {"qweight": lambda r, c: r * c * spec.bits // 8, "scales": lambda r, c: groups(r) * c * scale_bytes}
    if spec.weight_type.has_zero_points:
        sizes["zeros"] = lambda r, c: groups(r) * c * spec.bits // 8
    out = []
    for suffix, size in sizes.items():
        true = size(k, n)
        rule = size(padded_k(k), padded_n(n))
        out.append({"tensor": f"{spec.name}.{suffix}", "bytes": experts * rule,
                    "rule_extra_bytes": experts * (rule - true),
                    "pad128_extra_bytes": experts * (size(ceil_to(k, 128), ceil_to(n, 128)) - true)})
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


def _units(src: SourceCheckpoint, plan: Plan) -> list[Unit]:
    units = []
    for spec in plan.layers:  # discover refused pass-through names that collide with a layer's Marlin tensors
        # values shared by a whole layer are read here, once: a task stages only its own expert's tensors
        microscale.layer_scale_factor(src, spec)
        units.append(Unit(spec, spec.name, layer_tensors(spec), sum(src.info(n).nbytes for n in spec.source_tensors)))
    for name in plan.passthrough:
        info = src.info(name)
        units.append(Unit(None, name, [PlannedTensor(name, info.dtype, info.shape)], info.nbytes))
    return units


def _shard(units: list[Unit], max_bytes: int) -> list[list[Unit]]:
    shards: list[list[Unit]] = [[]]
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


def plan_digest(jobs: list[ShardJob]) -> str:
    """What a resumed run must plan identically: every file's name and tensors (names, dtypes, shapes, order)."""
    text = json.dumps([[j.name, [[t.name, t.dtype, list(t.shape)] for t in j.planned], j.metadata] for j in jobs])
    return hashlib.sha256(text.encode()).hexdigest()


def resolve_workers(workers: int | None, total_bytes: int, tasks: int) -> int:
    """``workers`` as given, or (None) this machine's cores when the checkpoint is big enough to pay for starting
    worker processes (``PARALLEL_MIN_BYTES``), one otherwise."""
    if workers is not None:
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers = {workers!r} is not a positive integer")
        return workers
    return 1 if total_bytes < PARALLEL_MIN_BYTES else max(1, min(default_workers(), tasks))


def repack(path, out, *, force: bool = False, resume: bool = False, backend: str = "auto",
           max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, executor: str = "local", workers: int | None = None,
           retries: int = 2, worker_memory: int | None = None, progress: bool = True, log=None,
           stats: Stats | None = None) -> dict:
    """Write the Marlin checkpoint of ``path`` to directory ``out``; return the manifest. Every check (input, output
    path, header sizes, the cluster's workers) runs before anything is created; the writing follows
    ``output.OutputDir``'s states. ``executor``: ``local`` (the pipeline: ``workers`` processes on the CPU, two
    converter threads on a GPU), ``serial`` (one layer at a time, the reference) or ``dask://HOST:PORT``.
    ``resume`` continues a leftover ``OUT.partial``, keeping the files its journal lists and verifies. ``stats``
    (a ``pipeline.Stats``) is filled with what the run measured."""
    log = log or (lambda msg: print(msg, file=sys.stderr))
    stats = stats if stats is not None else Stats()
    where = parse_executor(executor)
    if not isinstance(retries, int) or isinstance(retries, bool) or retries < 0:
        raise ValueError(f"retries = {retries!r} is not a non-negative integer")
    if read_marker(os.fspath(path)) is not None:
        raise CheckpointError(f"{path}: is a Marlin checkpoint written by `workbench repack` (it holds {MARKER}), not a"
                              " source checkpoint to repack")
    src = open_source(path)
    protected = source_paths(src, path)
    target = OutputDir(os.fspath(out), protected, force=force, resume=resume, source=os.path.abspath(src.root),
                       log=log)
    out = target.out
    plan = discover(src)
    check_repackable(plan, src.root)
    ops_backend, sentence = choose_backend(backend)
    units = _units(src, plan)
    shards = _shard(units, max_shard_bytes)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    jobs = [ShardJob(fname, shard, _shard_metadata(shard, plan)) for fname, shard in zip(names, shards)]
    for job in jobs:  # a header the format refuses is refused here, before any write
        encode_header(planned_header(job.planned, job.metadata), os.path.join(out, job.name))
    total = sum(u.source_bytes for u in units)
    tasks = sum(len(u.tasks) for u in units if u.layer is not None)
    n_workers = resolve_workers(workers, total, tasks)
    source_files = [p for p in protected if is_regular(p)]
    client = None
    if where.kind == "dask":  # the cluster is asked before anything is created
        client = connect(where)
        biggest = max((u for u in units if u.layer is not None), key=lambda u: u.source_bytes // len(u.tasks))
        need = 2 * (biggest.source_bytes + biggest.nbytes) // len(biggest.tasks) + COPY_CHUNK_BYTES
        n_workers = check_workers(client, where, need, worker_memory, f"layer {biggest.name!r}")
    how = (f"{sentence}; {count(n_workers, 'worker')} on {where}" if where.kind != "serial" else
           f"{sentence}; one layer at a time")
    log(f"repack: {count(len(plan.layers), 'quantized layer')} ({plan.settings.source_format}),"
        f" {count(len(plan.passthrough), 'tensor')} carried over; {how}")
    manifest = {
        "workbench_format": FORMAT_NAME, "format_version": workbench.FORMAT_VERSION,
        "workbench_version": workbench.__version__, "source_format": plan.settings.source_format,
        "source": os.path.abspath(src.root), "quant_config_source": src.quant_config_source,
        "layers": {spec.name: layer_record(spec) for spec in plan.layers},
        "passthrough": list(plan.passthrough), "weight_map": {},
    }
    for job in jobs:
        for t in job.planned:
            manifest["weight_map"][t.name] = job.name
    from tqdm.auto import tqdm

    journal = None
    try:
        with target as tmp:
            try:
                journal = Journal(tmp, fingerprint(source_files), plan_digest(jobs))
                kept = {}
                if target.resumed:
                    kept = _resumed(tmp, journal, source_files, names, log)
                    target.mark_resumed()
                journal.save()
                todo = [job for job in jobs if job.name not in kept]
                stats.shards_kept = len(kept)
                stats.source_bytes = sum(job.source_bytes for job in todo)
                stats.output_bytes = sum(t.nbytes for job in todo for t in job.planned)
                on_shard = journal.add
                stats.baseline_rss_bytes = current_rss()
                start = time.perf_counter()
                with tqdm(total=total, unit="B", unit_scale=True, desc=f"repack ({ops_backend})",
                          disable=not progress, file=sys.stderr, dynamic_ncols=True) as bar:
                    bar.update(total - stats.source_bytes)
                    if where.kind == "serial":
                        for job in todo:
                            write_serial(src, writing_path(tmp, job.name), job.units, plan, ops_backend, bar, log)
                            entry = shard_entry(writing_path(tmp, job.name))
                            os.rename(writing_path(tmp, job.name), os.path.join(tmp, job.name))
                            on_shard(job.name, entry)
                        stats.path, stats.workers = "serial", 1
                        stats.memory_bound_bytes = max(u.source_bytes + u.nbytes for u in units) + COPY_CHUNK_BYTES
                    elif where.kind == "local":
                        run_local(src, os.fspath(path), tmp, todo, ops_backend, n_workers, bar, on_shard, stats)
                    else:
                        check_shared(client, where, [src.root, tmp])
                        stamps = {p: (os.stat(p).st_size, os.stat(p).st_mtime_ns) for p in source_files}
                        run_dask(client, where, os.path.abspath(os.fspath(path)), stamps, tmp, todo, backend,
                                 retries, bar, on_shard, stats)
                        stats.path, stats.workers = "dask", n_workers
                stats.seconds = time.perf_counter() - start
                stats.peak_rss_bytes = max(stats.peak_rss_bytes, peak_rss())
                for warning in stats.warnings:
                    log(f"repack: warning: {warning}")
                if len(shards) > 1:
                    index = {"metadata": {"total_size": sum(u.nbytes for u in units),
                                          "workbench_format": FORMAT_NAME},
                             "weight_map": manifest["weight_map"]}
                    with open(os.path.join(tmp, INDEX_NAME), "w", encoding="utf-8") as f:
                        json.dump(index, f, indent=2)
                for other in src.other_files:
                    if other not in (MANIFEST, "config.json", *CONFIG_FILES):  # their settings move into config.json
                        shutil.copy2(os.path.join(src.root, other), os.path.join(tmp, other))
                write_config(tmp, src.config, src.quant_config, src.quant_config_source, plan.settings.source_format)
                _remove_unfinished(tmp)  # the attempt of a cluster worker that died mid-file
                manifest["shards"] = {name: journal.record["shards"][name] for name in names}
                with open(os.path.join(tmp, MANIFEST), "w", encoding="utf-8") as f:  # written last
                    json.dump(manifest, f, indent=2)
                    f.flush()
                    os.fsync(f.fileno())
                os.remove(journal.path)  # the manifest now holds the checksums
                target.publish()
            except BaseException as exc:
                _remove_unfinished(tmp)
                if not isinstance(exc, OSError) or isinstance(exc, KeepsPartial):
                    raise
                what = f"{exc.filename or tmp}: {exc.strerror or exc} while writing the output"
                finished = len(journal.record["shards"]) if journal is not None else 0
                if finished and os.path.isdir(tmp):  # disk full, read-only mount, quota: keep what is finished
                    raise KeptPartialError(f"{what}; the {count(finished, 'finished file')} stay in {tmp} (rerun"
                                           " with --resume once the cause is fixed)") from None
                raise OutputError(f"{what}; nothing was left under {out}") from None
    finally:
        if client is not None:
            client.close()
    log(f"repack: wrote {out} ({count(len(shards), 'file')}"
        + (f", {stats.shards_kept} kept from the interrupted run" if stats.shards_kept else "")
        + f"): {describe_stats(stats)}")
    return manifest


def _remove_unfinished(folder: str) -> None:
    """Files still under their temporary names: never left behind, so no half-written shard survives anywhere."""
    if os.path.isdir(folder):
        for name in os.listdir(folder):
            if name.startswith(WRITING_PREFIX):
                os.remove(os.path.join(folder, name))


def _resumed(folder: str, journal: Journal, source_files: list[str], names: list[str], log) -> dict:
    """The shards of a leftover partial folder worth keeping: listed in its journal and still intact on disk; the
    rest is removed. A source changed since, or another plan, is refused (the folder is kept as it is)."""
    record = Journal.read(folder)
    if record is None:
        log(f"repack: {folder} has no progress journal (interrupted before its first file finished); starting over"
            " in it")
    else:
        check_fingerprint(record["source"], source_files, folder)
        if record["plan"] != journal.record["plan"]:
            raise KeptPartialError(f"{folder} was planned with other output files (another --max-shard-size?); rerun"
                                   " with the options it was started with, or --force to start again")
        journal.record = record
    kept = {}
    for name, entry in list(journal.record["shards"].items()):
        if name in names and shard_intact(os.path.join(folder, name), entry):
            kept[name] = entry
        else:
            log(f"repack: {name} does not match its journal entry; writing it again")
            del journal.record["shards"][name]
    for name in names:
        if name not in kept and os.path.lexists(os.path.join(folder, name)):
            os.remove(os.path.join(folder, name))
    _remove_unfinished(folder)
    log(f"repack: keeping {count(len(kept), 'finished file')}, writing {count(len(names) - len(kept), 'file')}")
    return kept


def convert_layer(src: SourceCheckpoint, spec: LayerSpec, expert: int, backend: str, column_block: int | None = None,
                  stream=None):
    """``to_marlin``, with an op's refusal (a ValueError naming values only) said with the layer and checkpoint."""
    try:
        return to_marlin(src, spec, expert, backend, column_block, stream)
    except CheckpointError:
        raise
    except (ValueError, TypeError) as exc:
        which = f" expert {expert}" if spec.num_experts else ""
        raise CheckpointError(f"{src.root}: layer {spec.name!r}{which}: {exc}") from exc


def _shard_metadata(shard: list[Unit], plan: Plan) -> dict[str, str]:
    layers = {u.layer.name: layer_record(u.layer) for u in shard if u.layer is not None}
    return {"format": "pt", "workbench_format": FORMAT_NAME, "workbench_format_version": workbench.FORMAT_VERSION,
            "source_format": plan.settings.source_format, "marlin_layers": json.dumps(layers)}


def write_serial(src: SourceCheckpoint, path: str, shard: list[Unit], plan: Plan, backend: str, bar, log) -> None:
    """One file, one layer at a time in this process: the smallest footprint, and the reference the pipeline is
    tested against byte for byte (``executor='serial'``)."""
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
