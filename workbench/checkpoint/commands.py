"""``workbench inspect | repack | verify``. Exit codes (``workbench.cli.run`` maps errors to them): 0 success; 1 the
answer is "no" (incompatible layers, verification mismatches); 2 bad input or environment (message on stderr,
nothing written); 130 Ctrl-C. ``--json`` prints one JSON object on stdout instead of the tables."""
from __future__ import annotations

import argparse
import json
import sys

from workbench.cli import EXIT_NO, EXIT_OK
from workbench.text import count


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "inspect", help="list the quantized layers of a checkpoint and whether Marlin can take them",
        description="Print a table of every quantized layer of a safetensors checkpoint (GPTQ, AWQ, compressed-tensors"
                    " pack-quantized, block-FP8; MoE experts as stacks): source format, weight type, bits, group size,"
                    " act-order, K x N, experts, the bytes padding to whole 16 x 64 tiles adds to the layer's Marlin"
                    " tensors beside what padding K and N to 128 would add (--padding, --json: per tensor), Marlin"
                    " compatibility and why not. Exit 0 when every layer is"
                    " compatible, 1 when some is not, 2 on unreadable or inconsistent input.")
    p.add_argument("path", help="checkpoint directory (or a single .safetensors file)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--padding", action="store_true",
                   help="also list every Marlin tensor: its bytes, what padding to whole 16 x 64 tiles adds and what"
                        " padding K and N to 128 would add")
    p.set_defaults(func=_inspect)

    p = subparsers.add_parser(
        "repack", help="write a Marlin-format checkpoint",
        description="Convert every quantized layer to Marlin tensors (qweight tiles, permuted scales, zero points,"
                    " act-order g_idx/perm) and carry every other tensor over untouched. Streams one layer at a time,"
                    " writes to OUT.partial (marked and locked) and renames it to OUT only when complete; an"
                    " interrupted run leaves OUT.partial marked partial. OUT may not be, contain or lie inside the"
                    " source. Exit 0 on success, 2 on bad input (nothing is written under OUT), 130 on Ctrl-C.")
    p.add_argument("path", help="source checkpoint directory (or a single .safetensors file)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--force", action="store_true",
                   help="replace OUT (or a leftover OUT.partial) when this tool wrote it; never anything else")
    p.add_argument("--backend", choices=("auto", "cpu", "numpy", "numba"), default="auto",
                   help="auto: Numba CUDA kernels when a GPU is present, else cpu (default); cpu: compiled host"
                        " loops; numpy: the NumPy reference ops (slow, for checking); numba: the CUDA kernels")
    p.add_argument("--max-shard-size", type=_size, default="5GB", help="largest output file, e.g. 5GB, 500MB")
    p.add_argument("--resume", action="store_true",
                   help="continue a leftover OUT.partial: keep the files its journal lists and whose checksums still"
                        " match, write the rest (a source changed since is refused)")
    _executor_options(p, "repack")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_repack)

    p = subparsers.add_parser(
        "verify", help="check a Marlin checkpoint against its source, bit for bit",
        description="Take every Marlin tensor back to the source layout with the inverse ops and compare bit for bit;"
                    " on a mismatch name the layer and the first differing element with its tile, sub-block, lane,"
                    " word and field. Exit 0 when everything matches, 1 on mismatches, 2 on bad input.")
    p.add_argument("out", help="Marlin checkpoint directory written by `workbench repack`")
    p.add_argument("--against", required=True, help="the source checkpoint")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--resume", action="store_true",
                   help="skip the layers an interrupted verify of the same pair already found matching (refused when"
                        " either side changed since)")
    _executor_options(p, "verify")
    p.set_defaults(func=_verify)


def _executor_options(p, command: str) -> None:
    p.add_argument("--executor", default="local", metavar="local|serial|dask://HOST:PORT",
                   help="where the work runs: local (this machine: worker processes on the CPU, the GPU when the"
                        " backend is numba; default), serial (one layer at a time, least memory), or"
                        " dask://HOST:PORT (the workers of the dask.distributed scheduler at tcp://HOST:PORT; the"
                        " source and OUT must be on storage they all share)")
    p.add_argument("--workers", type=_positive, default=None,
                   help="local worker processes (default: every core for checkpoints over 256 MB, else 1)")
    p.add_argument("--retries", type=_non_negative, default=2,
                   help="dask: times a failed task is tried again (worker deaths are retried by the scheduler)")
    p.add_argument("--worker-memory", type=_size, default=None,
                   help="dask: memory each worker may use (default: its --memory-limit); the run is refused before"
                        f" anything is written when one {command} task would not fit in a worker thread's share")


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")
    return int(text)


def _non_negative(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 0")
    return int(text)


def _size(text: str) -> int:
    units = {"KB": 1024, "MB": 1024**2, "GB": 1024**3, "B": 1}
    t = text.strip().upper()
    for suffix, factor in units.items():
        if t.endswith(suffix) and t[: -len(suffix)].strip().replace(".", "", 1).isdigit():
            return int(float(t[: -len(suffix)]) * factor)
    if t.isdigit():
        return int(t)
    raise argparse.ArgumentTypeError(f"{text!r} is not a size like 5GB, 500MB or 1048576")


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def padding_cell(spec) -> str:
    """The extra bytes of the layer's Marlin tensors under the padding rule (K to 16, N to 64), then what padding
    K and N to 128 would add: "+rule / +pad128"."""
    from workbench.checkpoint.repack import padding_overhead

    rows = padding_overhead(spec)
    return (f"+{_bytes(sum(r['rule_extra_bytes'] for r in rows))} / "
            f"+{_bytes(sum(r['pad128_extra_bytes'] for r in rows))}")


def format_table(plan) -> str:
    header = ("layer", "format", "type", "bits", "group", "act-order", "K x N", "experts", "pad: tile / 128",
              "Marlin")
    rows = []
    for spec in plan.layers:
        rows.append((spec.name, spec.source_format, spec.weight_type.label, str(spec.bits), str(spec.group_size),
                     "yes" if spec.act_order else "no", f"{spec.size_k} x {spec.size_n}",
                     str(spec.num_experts) if spec.num_experts else "-", padding_cell(spec),
                     "yes" if spec.compatible else "NO: " + "; ".join(spec.problems)))
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header) - 1)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(row[:-1], widths)) + "  " + row[-1] for row in [header] + rows]
    lines.insert(1, "-" * min(max(len(line) for line in lines), 160))
    return "\n".join(lines)


def format_padding_table(plan) -> str:
    """One row per Marlin tensor of every layer: bytes, extra bytes of the padding rule, of padding to 128."""
    from workbench.checkpoint.repack import padding_overhead

    header = ("tensor", "bytes", "tile padding", "padding to 128")
    rows = [(r["tensor"], _bytes(r["bytes"]), f"+{_bytes(r['rule_extra_bytes'])}",
             f"+{_bytes(r['pad128_extra_bytes'])}") for spec in plan.layers for r in padding_overhead(spec)]
    widths = [max(len(row[i]) for row in rows + [header]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [header] + rows]
    lines.insert(1, "-" * max(len(line) for line in lines))
    return "\n".join(lines)


def format_marlin_table(manifest: dict) -> str:
    header = ("layer", "type", "bits", "group", "act-order", "K x N", "experts", "from")
    rows = [(name, r["weight_type"], str(r["bits"]), str(r["group_size"]), "yes" if r["act_order"] else "no",
             f"{r['size_k']} x {r['size_n']}", str(r["num_experts"] or "-"), r["source_format"])
            for name, r in manifest["layers"].items()]
    widths = [max(len(row[i]) for row in rows + [header]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [header] + rows]
    lines.insert(1, "-" * max(len(line) for line in lines))
    return "\n".join(lines)


def _layer_json(spec) -> dict:
    from workbench.checkpoint.repack import padding_overhead

    return {"padding": padding_overhead(spec), "name": spec.name, "source_format": spec.source_format, "weight_type": spec.weight_type.label,
            "bits": spec.bits, "group_size": spec.group_size, "act_order": spec.act_order, "size_k": spec.size_k,
            "size_n": spec.size_n, "num_experts": spec.num_experts, "compatible": spec.compatible,
            "problems": list(spec.problems)}


def _inspect(args) -> int:
    from workbench.checkpoint import inspect
    from workbench.checkpoint.marlin_ckpt import is_marlin_checkpoint, open_marlin

    if is_marlin_checkpoint(args.path):
        ckpt = open_marlin(args.path)
        if args.json:
            print(json.dumps({"ok": True, "path": args.path, "kind": "marlin", "manifest": ckpt.manifest}))
            return EXIT_OK
        print(format_marlin_table(ckpt.manifest))
        print(f"\nMarlin checkpoint (workbench format {ckpt.manifest['format_version']}, from"
              f" {ckpt.manifest['source_format']}): {count(len(ckpt.layers), 'layer')},"
              f" {count(len(ckpt.manifest['passthrough']), 'tensor')} carried over")
        return EXIT_OK
    plan = inspect(args.path)
    bad = sum(not s.compatible for s in plan.layers)
    if args.json:
        print(json.dumps({"ok": not bad, "path": args.path, "kind": "source",
                          "source_format": plan.settings.source_format if plan.settings else None,
                          "settings_from": plan.settings.origin if plan.settings else None,
                          "layers": [_layer_json(s) for s in plan.layers], "passthrough": len(plan.passthrough),
                          "compatible": len(plan.layers) - bad, "incompatible": bad}))
        return EXIT_NO if bad else EXIT_OK
    if not plan.layers:
        print(f"{args.path}: no quantized layers ({count(len(plan.passthrough), 'unquantized tensor')})")
        return EXIT_OK
    print(format_table(plan))
    if getattr(args, "padding", False):
        print()
        print(format_padding_table(plan))
    print(f"\n{count(len(plan.layers), 'quantized layer')} ({plan.settings.source_format}, settings from"
          f" {plan.settings.origin}); {count(len(plan.passthrough), 'tensor')} carried over untouched;"
          f" {len(plan.layers) - bad} Marlin-compatible, {bad} not")
    return EXIT_NO if bad else EXIT_OK


def _repack(args) -> int:
    from workbench.checkpoint import repack

    repack(args.path, args.out, force=args.force, resume=args.resume, backend=args.backend,
           max_shard_bytes=args.max_shard_size, executor=args.executor, workers=args.workers, retries=args.retries,
           worker_memory=args.worker_memory, progress=not args.no_progress)
    return EXIT_OK


def _verify(args) -> int:
    from workbench.checkpoint import verify

    report = verify(args.out, args.against, progress=not args.no_progress, executor=args.executor,
                    workers=args.workers, retries=args.retries, worker_memory=args.worker_memory, resume=args.resume)
    if args.json:
        print(json.dumps({"ok": report.ok, "layers_checked": report.layers_checked,
                          "tensors_checked": report.tensors_checked, "differing_elements": report.differing_elements,
                          "problems": report.problems}))
        return EXIT_OK if report.ok else EXIT_NO
    if report.ok:
        print(f"verify: OK: {count(report.layers_checked, 'layer')}, {count(report.tensors_checked, 'tensor')} match"
              " the source bit for bit")
        return EXIT_OK
    for line in report.problems:
        print(f"MISMATCH {line}")
    print(f"verify: {count(len(report.problems), 'problem')}", file=sys.stderr)
    return EXIT_NO
