"""``verify``: every Marlin tensor, taken back to the source layout with the inverse ops, equals the source bit for
bit; pass-through tensors are byte-identical; the source's other files are there (byte-identical, except the
``quantization_config`` of config.json, which repack may rewrite); the layer table matches a fresh reading of the
source. Only a directory marked complete by ``repack`` is verified (``output.require_complete``).

Memory: one layer's Marlin and source tensors plus one column block of the comparison (``convert.COLUMN_BLOCK``);
a mismatch is reported as its first position and a count, so it costs no more than a match.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
from dataclasses import dataclass, field

import numpy as np

from workbench.checkpoint.convert import compare_with_source
from workbench.checkpoint.executor import check_shared, check_workers, connect, is_killed_worker, parse_executor
from workbench.checkpoint.files import CheckpointError, is_regular, open_regular, read_json
from workbench.checkpoint.layers import discover
from workbench.checkpoint.marlin_ckpt import open_marlin
from workbench.checkpoint.output import LOCK, MARKER
from workbench.checkpoint.manifest import PROGRESS, check_fingerprint, fingerprint, shard_intact
from workbench.checkpoint.repack import MANIFEST, layer_record, layer_tensors, resolve_workers
from workbench.checkpoint.source import CONFIG_FILES, open_source

TOOL_FILES = (MANIFEST, MARKER, LOCK, PROGRESS)  # written by repack itself, not copied from the source


@dataclass
class VerifyReport:
    layers_checked: int = 0
    tensors_checked: int = 0
    differing_elements: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify(out, against, *, progress: bool = True, max_problems: int = 50, executor: str = "local",
           workers: int | None = None, retries: int = 2, worker_memory: int | None = None,
           resume: bool = False) -> VerifyReport:
    """Compare ``out`` with its source ``against``. ``executor``/``workers`` spread the layers over processes or a
    dask cluster (each layer is one task; the report is the same for any of them). ``resume`` skips the layers an
    earlier, interrupted verify of the same pair found matching, as long as neither side changed since (its record
    lives in the user's cache, ``resume_record_path``: nothing is written into either checkpoint)."""
    from tqdm.auto import tqdm

    where = parse_executor(executor)
    marlin = open_marlin(out)
    src = open_source(against)
    plan = discover(src)
    report = VerifyReport()
    source_format = plan.settings.source_format if plan.settings else None
    if marlin.manifest["source_format"] != source_format:
        report.problems.append(f"{marlin.root}: manifest says source_format = {marlin.manifest['source_format']!r},"
                               f" the source is {source_format!r}")
    expected = {spec.name: spec for spec in plan.layers}
    for name in sorted(set(marlin.layers) - set(expected)):
        report.problems.append(f"{name}: in the Marlin checkpoint but not a quantized layer of {src.root}")
    for name in sorted(set(expected) - set(marlin.layers)):
        report.problems.append(f"{name}: quantized layer of {src.root} missing from the Marlin checkpoint")
    if sorted(marlin.manifest["passthrough"]) != sorted(plan.passthrough):
        gone = sorted(set(plan.passthrough) - set(marlin.manifest["passthrough"]))
        new = sorted(set(marlin.manifest["passthrough"]) - set(plan.passthrough))
        report.problems.append(f"pass-through tensors differ: missing {gone[:5]}, extra {new[:5]}")
    report.problems += _other_files(marlin.root, src)
    specs = [expected[n] for n in sorted(set(expected) & set(marlin.layers))]
    record = _ResumeRecord(marlin, src, resume)
    todo = [spec for spec in specs if spec.name not in record.done]
    report.layers_checked += len(specs) - len(todo)
    report.tensors_checked += sum(record.done[s.name] for s in specs if s.name in record.done)
    total = sum(max(s.num_experts, 1) for s in specs) + len(plan.passthrough)
    with tqdm(total=total, desc="verify", disable=not progress, file=sys.stderr, dynamic_ncols=True) as bar:
        bar.update(sum(max(s.num_experts, 1) for s in specs) - sum(max(s.num_experts, 1) for s in todo))
        for name, (problems, differing, tensors) in _run_layers(marlin, src, todo, max_problems, where, workers,
                                                                 retries, worker_memory):
            spec = expected[name]
            report.problems += problems
            report.differing_elements += differing
            report.tensors_checked += tensors
            report.layers_checked += 1
            if not problems:
                record.add(name, tensors)
            bar.update(max(spec.num_experts, 1))
            if len(report.problems) >= max_problems:
                report.problems.append(f"stopped after {max_problems} problems")
                return report
        for name in plan.passthrough:
            _check_passthrough(marlin, src, name, report)
            bar.update(1)
    if report.ok:  # every tensor matches: a checksum that differs still names a file changed since (its metadata)
        report.problems += _shard_checksums(marlin)
    if report.ok:
        record.finish()
    return report


def check_layer(marlin, src, spec, max_problems: int = 50) -> tuple[list[str], int, int]:
    """(problems, differing elements, tensors checked) of one layer, every expert."""
    problems: list[str] = []
    differing = tensors = 0
    record = marlin.layers[spec.name]
    want = layer_record(spec)
    if record != want:
        keys = [k for k in want if record.get(k) != want[k]]
        return ([f"{spec.name}: manifest says {[(k, record.get(k)) for k in keys]}, the source gives"
                 f" {[(k, want[k]) for k in keys]}"], 0, 0)
    shape_problems = _shapes(marlin, spec)
    if shape_problems:
        return shape_problems, 0, 0
    for e in range(max(spec.num_experts, 1)):
        m = marlin.tensors(spec.name, e)
        try:
            found, count = compare_with_source(src, spec, e, m)
        except CheckpointError:
            raise
        except (ValueError, TypeError) as exc:  # an op refused the stored tensors: say which
            raise CheckpointError(f"{marlin.root}: layer {spec.name!r} expert {e}: {exc}") from exc
        problems += found
        differing += count
        tensors += sum(x is not None for x in (m.qweight, m.scales, m.zeros, m.g_idx, m.perm))
        if len(problems) >= max_problems:
            break
    return problems, differing, tensors


def _check_passthrough(marlin, src, name: str, report: VerifyReport) -> None:
    if name not in marlin.files.where:
        report.problems.append(f"{name}: pass-through tensor of {src.root} is missing from the Marlin checkpoint")
        return
    a, b = marlin.files.info(name), src.info(name)
    if (a.dtype, a.shape) != (b.dtype, b.shape):
        report.problems.append(f"{name}: {a.dtype} {list(a.shape)} in the Marlin checkpoint, {b.dtype}"
                               f" {list(b.shape)} in the source")
    else:
        diff = _first_byte_difference(marlin.files.files[marlin.files.where[name]], src.files[src.where[name]], name)
        if diff is not None:
            report.problems.append(f"{name}: pass-through bytes differ from byte {diff[0]} ({diff[1]} differing"
                                   " bytes)")
            report.differing_elements += diff[1]
    report.tensors_checked += 1


def _shard_checksums(marlin) -> list[str]:
    """Each output file against the checksum the manifest recorded for it (manifests of earlier versions have
    none): a file changed after the repack is named even where its layers would still convert back."""
    shards = marlin.manifest.get("shards")
    if not isinstance(shards, dict):
        return []
    problems = []
    for name, entry in sorted(shards.items()):
        if not shard_intact(os.path.join(marlin.root, name), entry):
            algorithm = entry.get("checksum") if isinstance(entry, dict) else None
            problems.append(f"{os.path.join(marlin.root, name)}: size or {algorithm} checksum differs from what"
                            f" {MANIFEST} recorded: the file changed after the repack")
    return problems


# ---------------------------------------------------------------------------------------------------------------
# running the layers: here, in worker processes, or on a dask cluster
# ---------------------------------------------------------------------------------------------------------------
_OPENED: dict = {}


def _layer_task(out: str, against: str, spec, max_problems: int):
    key = (out, against)
    if key not in _OPENED:
        _OPENED.clear()
        _OPENED[key] = (open_marlin(out), open_source(against))
    marlin, src = _OPENED[key]
    return spec.name, check_layer(marlin, src, spec, max_problems)


def _run_layers(marlin, src, specs, max_problems, where, workers, retries, worker_memory):
    """(layer name, (problems, differing, tensors)) for each of ``specs``, in the order they finish."""
    total = len(specs)
    if where.kind == "serial" or (where.kind == "local" and resolve_workers(workers, _layer_bytes(src, specs),
                                                                            total) == 1):
        for spec in specs:
            yield spec.name, check_layer(marlin, src, spec, max_problems)
        return
    out, against = os.path.abspath(marlin.root), os.path.abspath(src.root)
    if where.kind == "local":
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor, as_completed

        n = resolve_workers(workers, _layer_bytes(src, specs), total)
        method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
        with ProcessPoolExecutor(n, mp_context=multiprocessing.get_context(method)) as pool:
            futures = [pool.submit(_layer_task, out, against, spec, max_problems) for spec in specs]
            try:
                for fut in as_completed(futures):
                    try:
                        yield fut.result()
                    except Exception as exc:
                        if type(exc).__name__ == "BrokenProcessPool":
                            raise CheckpointError("a verify worker process died (killed, or out of memory);"
                                                  " rerun with --resume to skip the layers already checked") from None
                        raise
            finally:
                for fut in futures:
                    fut.cancel()
        return
    client = connect(where)
    try:
        biggest = max(specs, key=lambda s: _layer_bytes(src, [s]) // max(s.num_experts, 1), default=None)
        if biggest is not None:
            need = 3 * _layer_bytes(src, [biggest]) // max(biggest.num_experts, 1)
            check_workers(client, where, need, worker_memory, f"layer {biggest.name!r}")
        check_shared(client, where, [out, against])
        futures = {client.submit(_layer_task, out, against, spec, max_problems, retries=retries, pure=False): spec
                   for spec in specs}
        from distributed import as_completed as dask_completed

        try:
            with client.as_current():
                finished = dask_completed(list(futures))
            for fut in finished:
                try:
                    yield fut.result()
                except Exception as exc:
                    if is_killed_worker(exc):
                        raise CheckpointError(f"--executor {where}: the workers checking layer"
                                              f" {futures[fut].name!r} kept dying (killed, or out of memory); rerun"
                                              " with --resume to skip the layers already checked") from None
                    raise
        finally:
            client.cancel([f for f in futures if not f.done()], force=True)
    finally:
        client.close()


def _layer_bytes(src, specs) -> int:
    return sum(src.info(n).nbytes for s in specs for n in s.source_tensors)


# ---------------------------------------------------------------------------------------------------------------
# resume: the layers an interrupted verify already found matching
# ---------------------------------------------------------------------------------------------------------------
def resume_record_path(out: str, against: str) -> str:
    """Where ``verify --resume`` keeps its progress for this pair of checkpoints (the user's cache)."""
    key = hashlib.sha256(f"{os.path.realpath(out)}\0{os.path.realpath(against)}".encode()).hexdigest()[:24]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "marlin-workbench", "verify", key + ".json")


class _ResumeRecord:
    """{source fingerprint, output fingerprint, layers found matching: tensors}; replaced atomically per layer.
    With ``resume`` an existing record is used when both sides are unchanged and refused (SourceChanged)
    otherwise; without it, any old record is dropped and a new one kept in case this run is interrupted."""

    def __init__(self, marlin, src, resume: bool):
        self.path = resume_record_path(marlin.root, src.root)
        self.sides = {"source": [os.path.join(src.root, f) for f in src.files],
                      "output": [os.path.join(marlin.root, f) for f in marlin.files.files]
                      + [os.path.join(marlin.root, MANIFEST)]}
        self.done: dict[str, int] = {}
        old = self._read() if resume else None
        if old is not None:
            for side, paths in self.sides.items():
                check_fingerprint(old["fingerprint"][side], paths, f"the verify of {marlin.root} (its {side})")
            self.record = old
            self.done = dict(old["layers"])
        else:
            self.record = {"version": 1, "fingerprint": {side: fingerprint(paths)
                                                         for side, paths in self.sides.items()}, "layers": {}}

    def _read(self) -> dict | None:
        if not is_regular(self.path):
            return None
        try:
            record = read_json(self.path, "verify progress record")
        except CheckpointError:
            return None
        ok = record.get("version") == 1 and isinstance(record.get("layers"), dict) and isinstance(
            record.get("fingerprint"), dict) and set(record["fingerprint"]) == set(self.sides)
        return record if ok else None

    def add(self, name: str, tensors: int) -> None:
        self.record["layers"][name] = tensors
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            tmp = f"{self.path}.{os.getpid()}.tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(self.record, f)
            os.replace(tmp, self.path)
        except OSError:  # a read-only home: verify still works, it just cannot be resumed
            pass

    def finish(self) -> None:
        """A verify that completed needs no record."""
        with contextlib.suppress(OSError):
            os.remove(self.path)


def _shapes(marlin, spec) -> list[str]:
    """The Marlin tensors' dtypes and shapes against what the layer needs (before any of them is read)."""
    problems = []
    for t in layer_tensors(spec):
        if t.name not in marlin.files.where:
            problems.append(f"{t.name}: tensor of layer {spec.name!r} is missing from the Marlin checkpoint")
            continue
        info = marlin.files.info(t.name)
        if (info.dtype, info.shape) != (t.dtype, t.shape):
            problems.append(f"{marlin.files.describe(t.name)}: layer {spec.name!r} needs {t.dtype} {list(t.shape)}")
    return problems


def _other_files(root: str, src) -> list[str]:
    """The source's other files (config, tokenizer, ...) must be in the output: byte-identical, except that
    config.json may differ in its quantization_config (repack describes the Marlin format there) and the separate
    quantization files (quantize_config.json, quant_config.json) are left out: their settings moved into config.json
    (``workbench.repacked_config``)."""
    problems = []
    present = set(os.listdir(root))
    for name in src.other_files:
        if name in TOOL_FILES or name in CONFIG_FILES:
            continue
        ours, theirs = os.path.join(root, name), os.path.join(src.root, name)
        if name not in present:
            problems.append(f"{ours}: missing (the source has {theirs})")
        elif name == "config.json":
            a, b = read_json(ours, "config.json"), read_json(theirs, "config.json")
            a.pop("quantization_config", None)
            b.pop("quantization_config", None)
            if a != b:
                keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
                problems.append(f"{ours}: differs from {theirs} in {keys[:5]}")
        elif not _same_bytes(ours, theirs):
            problems.append(f"{ours}: differs from {theirs}")
    return problems


def _same_bytes(a: str, b: str, chunk: int = 1 << 20) -> bool:
    """Two regular files hold the same bytes (read in bounded chunks)."""
    with open_regular(a) as fa, open_regular(b) as fb:
        while True:
            x, y = fa.read(chunk), fb.read(chunk)
            if x != y:
                return False
            if not x:
                return True


def _first_byte_difference(a, b, name: str) -> tuple[int, int] | None:
    """(offset of the first differing byte, number of differing bytes) of tensor ``name`` in two files, compared in
    bounded chunks; None when identical."""
    offset, first, count = 0, None, 0
    for chunk_a, chunk_b in zip(a.iter_bytes(name), b.iter_bytes(name)):
        if chunk_a != chunk_b:
            x, y = np.frombuffer(chunk_a, np.uint8), np.frombuffer(chunk_b, np.uint8)
            differ = x != y
            count += int(np.count_nonzero(differ))
            if first is None:
                first = offset + int(np.argmax(differ))
        offset += len(chunk_a)
    return None if first is None else (first, count)
