"""``verify``: every Marlin tensor, taken back to the source layout with the inverse ops, equals the source bit for
bit; pass-through tensors are byte-identical; the layer table matches a fresh reading of the source."""
from __future__ import annotations

import sys
from dataclasses import dataclass, field

import numpy as np

from workbench.checkpoint.convert import compare_with_source
from workbench.checkpoint.layers import discover
from workbench.checkpoint.marlin_ckpt import open_marlin
from workbench.checkpoint.repack import layer_record
from workbench.checkpoint.source import open_source


@dataclass
class VerifyReport:
    layers_checked: int = 0
    tensors_checked: int = 0
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
    expected = {spec.name: spec for spec in plan.layers}
    for name in sorted(set(marlin.layers) - set(expected)):
        report.problems.append(f"{name}: in the Marlin checkpoint but not a quantized layer of {src.root}")
    for name in sorted(set(expected) - set(marlin.layers)):
        report.problems.append(f"{name}: quantized layer of {src.root} missing from the Marlin checkpoint")
    if sorted(marlin.manifest["passthrough"]) != sorted(plan.passthrough):
        gone = sorted(set(plan.passthrough) - set(marlin.manifest["passthrough"]))
        new = sorted(set(marlin.manifest["passthrough"]) - set(plan.passthrough))
        report.problems.append(f"pass-through tensors differ: missing {gone[:5]}, extra {new[:5]}")
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
            for e in range(max(spec.num_experts, 1)):
                m = marlin.tensors(spec.name, e)
                report.problems += compare_with_source(src, spec, e, m)
                report.tensors_checked += sum(x is not None for x in (m.qweight, m.scales, m.zeros, m.g_idx, m.perm))
                bar.update(1)
            report.layers_checked += 1
            if len(report.problems) >= max_problems:
                report.problems.append(f"stopped after {max_problems} problems")
                return report
        for name in plan.passthrough:
            if name in marlin.files.where:
                a, b = marlin.files.info(name), src.info(name)
                if (a.dtype, a.shape) != (b.dtype, b.shape):
                    report.problems.append(f"{name}: {a.dtype} {list(a.shape)} in the Marlin checkpoint, {b.dtype}"
                                           f" {list(b.shape)} in the source")
                else:
                    diff = _first_byte_difference(marlin.files.files[marlin.files.where[name]],
                                                  src.files[src.where[name]], name)
                    if diff is not None:
                        report.problems.append(f"{name}: pass-through bytes differ from byte {diff}")
                report.tensors_checked += 1
            bar.update(1)
    return report


def _first_byte_difference(a, b, name: str) -> int | None:
    """Offset of the first differing byte of tensor ``name`` in two files, compared in bounded chunks."""
    offset = 0
    for chunk_a, chunk_b in zip(a.iter_bytes(name), b.iter_bytes(name)):
        if chunk_a != chunk_b:
            x, y = np.frombuffer(chunk_a, np.uint8), np.frombuffer(chunk_b, np.uint8)
            return offset + int(np.flatnonzero(x != y)[0])
        offset += len(chunk_a)
    return None
