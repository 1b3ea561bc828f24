"""``verify``: every Marlin tensor, taken back to the source layout with the inverse ops, equals the source bit for
bit; pass-through tensors are byte-identical; the source's other files are there (byte-identical, except the
``quantization_config`` of config.json, which repack may rewrite); the layer table matches a fresh reading of the
source. Only a directory marked complete by ``repack`` is verified (``output.require_complete``).

Memory: one layer's Marlin and source tensors plus one column block of the comparison (``convert.COLUMN_BLOCK``);
a mismatch is reported as its first position and a count, so it costs no more than a match.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

import numpy as np

from workbench.checkpoint.convert import compare_with_source
from workbench.checkpoint.files import CheckpointError, open_regular, read_json
from workbench.checkpoint.layers import discover
from workbench.checkpoint.marlin_ckpt import open_marlin
from workbench.checkpoint.output import LOCK, MARKER
from workbench.checkpoint.repack import MANIFEST, layer_record, layer_tensors
from workbench.checkpoint.source import CONFIG_FILES, open_source

TOOL_FILES = (MANIFEST, MARKER, LOCK)  # written by repack itself, not copied from the source


@dataclass
class VerifyReport:
    layers_checked: int = 0
    tensors_checked: int = 0
    differing_elements: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify(out, against, *, progress: bool = True, max_problems: int = 50) -> VerifyReport:
    from tqdm.auto import tqdm

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
    total = sum(max(s.num_experts, 1) for s in specs) + len(plan.passthrough)
    with tqdm(total=total, desc="verify", disable=not progress, file=sys.stderr) as bar:
        for spec in specs:
            record = marlin.layers[spec.name]
            want = layer_record(spec)
            if record != want:
                keys = [k for k in want if record.get(k) != want[k]]
                report.problems.append(f"{spec.name}: manifest says {[(k, record.get(k)) for k in keys]}, the source"
                                       f" gives {[(k, want[k]) for k in keys]}")
                bar.update(max(spec.num_experts, 1))
                continue
            shape_problems = _shapes(marlin, spec)
            if shape_problems:
                report.problems += shape_problems
                bar.update(max(spec.num_experts, 1))
                continue
            for e in range(max(spec.num_experts, 1)):
                m = marlin.tensors(spec.name, e)
                try:
                    problems, differing = compare_with_source(src, spec, e, m)
                except CheckpointError:
                    raise
                except (ValueError, TypeError) as exc:  # an op refused the stored tensors: say which
                    raise CheckpointError(f"{marlin.root}: layer {spec.name!r} expert {e}: {exc}") from exc
                report.problems += problems
                report.differing_elements += differing
                report.tensors_checked += sum(x is not None for x in (m.qweight, m.scales, m.zeros, m.g_idx, m.perm))
                bar.update(1)
                if len(report.problems) >= max_problems:
                    break
            report.layers_checked += 1
            if len(report.problems) >= max_problems:
                report.problems.append(f"stopped after {max_problems} problems")
                return report
        for name in plan.passthrough:
            if name not in marlin.files.where:
                report.problems.append(f"{name}: pass-through tensor of {src.root} is missing from the Marlin"
                                       " checkpoint")
            else:
                a, b = marlin.files.info(name), src.info(name)
                if (a.dtype, a.shape) != (b.dtype, b.shape):
                    report.problems.append(f"{name}: {a.dtype} {list(a.shape)} in the Marlin checkpoint, {b.dtype}"
                                           f" {list(b.shape)} in the source")
                else:
                    diff = _first_byte_difference(marlin.files.files[marlin.files.where[name]],
                                                  src.files[src.where[name]], name)
                    if diff is not None:
                        report.problems.append(f"{name}: pass-through bytes differ from byte {diff[0]} ({diff[1]}"
                                               " differing bytes)")
                        report.differing_elements += diff[1]
                report.tensors_checked += 1
            bar.update(1)
    return report


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
