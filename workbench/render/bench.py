"""The benchmark results under ``bench/results/``: one file per family, its schema checked, its cells compared.

``bench/results/<family>.json`` holds the current data of one family (the bench scripts write it; ``bench/report.py``
turns it into the tables of ``BENCHMARKS.md`` and notebook 07 draws it). Every reader goes through
``load_family``/``validate_results``, so a file that lacks a key fails with its path and the key's place named,
instead of a KeyError somewhere in a table.

Schema 1::

    {"schema": 1, "family": "<family>",
     "meta": {"gpu": str, "sms": int, "date": "YYYY-MM-DD", "commit": str, "torch": str, "cupy": str, "nvcc": str,
              "ceilings": {"copy_gbs": float, "read_gbs": float, "mma_tflops": float | null,
                           "cublas_tflops": float | null},
              "method": {...}, "peers": {"<method>": "<owner/repo@commit or version>"}},
     "rows": [{...}, ...]}

``method`` is ``"ours"`` for this project's kernel and a short peer id otherwise; ``us`` is the median time per call
in microseconds; ``gbs`` is the bytes the cell must move divided by that time.
"""
from __future__ import annotations

import json
import math
import pathlib
import re
from numbers import Real


SCHEMA_VERSION = 1
FAMILIES = ("gemm", "moe", "repack", "checkpoint", "host", "torch_models", "pipeline")
OURS = "ours"

# key -> accepted types ("number" = int or float, not bool); None in a tuple allows null
_NUMBER = "number"
_META_KEYS = {"gpu": str, "sms": int, "date": str, "commit": str, "torch": str, "cupy": str, "nvcc": str,
              "ceilings": dict, "method": dict, "peers": dict}
_CEILING_KEYS = {"copy_gbs": (_NUMBER, None), "read_gbs": (_NUMBER, None), "mma_tflops": (_NUMBER, None),
                 "cublas_tflops": (_NUMBER, None)}
CEILING_KEYS = tuple(_CEILING_KEYS)
GPU_FAMILIES = ("gemm", "moe", "repack")  # their files must carry the bandwidth ceilings; a CPU run has none
_COMMON_ROW_KEYS = {"method": str, "us": _NUMBER}
ROW_KEYS = {
    "gemm": {"layer": str, "n": int, "k": int, "m": int, "wtype": str, "group": (int, None), "act": str,
             "launch": str, "gbs": _NUMBER},
    "moe": {"model": str, "experts": int, "topk": int, "n": int, "k": int, "m": int, "wtype": str,
            "group": (int, None), "act": str, "launch": str},
    "repack": {"op": str, "n": int, "k": int, "wtype": str, "gbs": _NUMBER, "pct_copy": _NUMBER},
}
# graph: calls replayed from a CUDA graph; plain: issued one by one from Python; isolated: one call after an L2 flush
CHOICES = {"act": ("fp16", "bf16"), "launch": ("graph", "plain", "isolated")}
_DATE = re.compile(r"\d{4}-\d{2}-\d{2}\Z")


class ResultsSchemaError(ValueError):
    """A results file that does not follow the schema; the message names the file and the offending key."""


def _type_ok(value, accepted) -> bool:
    for kind in accepted if isinstance(accepted, tuple) else (accepted,):
        if kind is None and value is None:
            return True
        if kind == _NUMBER and isinstance(value, Real) and not isinstance(value, bool):
            return True
        if isinstance(kind, type) and isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
            return True
    return False


def _type_name(accepted) -> str:
    names = {str: "a string", int: "an integer", dict: "an object", _NUMBER: "a number", None: "null"}
    return " or ".join(names[k] for k in (accepted if isinstance(accepted, tuple) else (accepted,)))


def _check_keys(obj: dict, keys: dict, where: str, source: str) -> None:
    for key, accepted in keys.items():
        if key not in obj:
            raise ResultsSchemaError(f"{source}: {where} lacks the required key {key!r}")
        if not _type_ok(obj[key], accepted):
            raise ResultsSchemaError(f"{source}: {where}[{key!r}] must be {_type_name(accepted)}, "
                                     f"got {obj[key]!r}")


def required_row_keys(family: str) -> dict:
    """Required row keys of ``family`` and their types (every family needs ``method`` and ``us``)."""
    return {**_COMMON_ROW_KEYS, **ROW_KEYS.get(family, {})}


def validate_results(doc, source: str = "results", family: str | None = None) -> dict:
    """``doc`` unchanged if it follows schema 1 (of ``family`` when given), else ResultsSchemaError naming ``source``
    and the key: top-level keys, meta and its ceilings, every row's required keys and their types, ``act`` and
    ``launch`` values, positive times."""
    if not isinstance(doc, dict):
        raise ResultsSchemaError(f"{source}: the document must be a JSON object, got {type(doc).__name__}")
    _check_keys(doc, {"schema": int, "family": str, "meta": dict, "rows": list}, "the document", source)
    if doc["schema"] != SCHEMA_VERSION:
        raise ResultsSchemaError(f"{source}: schema {doc['schema']!r}; this reader knows schema {SCHEMA_VERSION}")
    if doc["family"] not in FAMILIES:
        raise ResultsSchemaError(f"{source}: family {doc['family']!r} is not one of {', '.join(FAMILIES)}")
    if family is not None and doc["family"] != family:
        raise ResultsSchemaError(f"{source}: holds family {doc['family']!r}, expected {family!r}")
    meta = doc["meta"]
    _check_keys(meta, _META_KEYS, "meta", source)
    if not _DATE.match(meta["date"]):
        raise ResultsSchemaError(f"{source}: meta['date'] must be YYYY-MM-DD, got {meta['date']!r}")
    _check_keys(meta["ceilings"], _CEILING_KEYS, "meta['ceilings']", source)
    if doc["family"] in GPU_FAMILIES:
        _check_keys(meta["ceilings"], {"copy_gbs": _NUMBER, "read_gbs": _NUMBER}, "meta['ceilings']", source)
    for name in ("copy_gbs", "read_gbs"):
        if meta["ceilings"][name] is not None and meta["ceilings"][name] <= 0:
            raise ResultsSchemaError(f"{source}: meta['ceilings'][{name!r}] must be positive, got "
                                     f"{meta['ceilings'][name]!r}")
    keys = required_row_keys(doc["family"])
    for i, row in enumerate(doc["rows"]):
        where = f"rows[{i}]"
        if not isinstance(row, dict):
            raise ResultsSchemaError(f"{source}: {where} must be an object, got {row!r}")
        _check_keys(row, keys, where, source)
        for key, allowed in CHOICES.items():
            if key in keys and row[key] not in allowed:
                raise ResultsSchemaError(f"{source}: {where}[{key!r}] is {row[key]!r}, not one of "
                                         f"{', '.join(allowed)}")
        if not (math.isfinite(row["us"]) and row["us"] > 0):
            raise ResultsSchemaError(f"{source}: {where}['us'] must be a positive time, got {row['us']!r}")
    return doc


def results_path(results_dir, family: str) -> pathlib.Path:
    if family not in FAMILIES:
        raise ValueError(f"unknown benchmark family {family!r}; expected one of {', '.join(FAMILIES)}")
    return pathlib.Path(results_dir) / f"{family}.json"


def load_family(results_dir, family: str) -> dict | None:
    """The validated ``results_dir/<family>.json``, or None when that family has no file."""
    path = results_path(results_dir, family)
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
    except ValueError as exc:
        raise ResultsSchemaError(f"{path}: not valid JSON ({exc})") from exc
    return validate_results(doc, str(path), family)


def load_results(results_dir) -> dict[str, dict | None]:
    """Every family, in FAMILIES order: its validated document, or None when its file is missing."""
    return {family: load_family(results_dir, family) for family in FAMILIES}


def missing_note(family: str, results_dir="bench/results") -> str:
    return (f"No results for {family}: {pathlib.Path(results_dir) / (family + '.json')} is not there yet "
            f"(run the {family} benchmark on a GPU, then python3 bench/report.py).")


def repo_results_dir(start=None) -> pathlib.Path:
    """``bench/results`` of the checkout that contains ``start`` (default: the working directory)."""
    here = pathlib.Path(start or pathlib.Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / "pyproject.toml").is_file():
            return folder / "bench" / "results"
    return here / "bench" / "results"


# ---------------------------------------------------------------------------------------------------------------
# Cells: ours beside each peer
# ---------------------------------------------------------------------------------------------------------------
# What makes two rows the same measurement cell, per family. A peer that runs the Marlin formats is compared like for
# like (same shape and format); a baseline that runs its own format (cuBLAS fp16, tinygemm's int4 with bf16) by shape
# only: it is what a user would otherwise run for that layer.
SHAPE_KEYS = {"gemm": ("layer", "n", "k", "m"), "moe": ("model", "experts", "topk", "n", "k", "m"),
              "repack": ("op", "n", "k")}
FORMAT_KEYS = {"gemm": ("wtype", "group", "act"), "moe": ("wtype", "group", "act"), "repack": ("wtype",)}
BASELINES = ("cublas", "torch_fp16", "tinygemm")
_MEASURED = ("method", "us", "gbs", "pct_copy", "pct_read")


def _identity_keys(family: str, rows: list[dict]) -> tuple[str, ...]:
    if family in SHAPE_KEYS:
        return SHAPE_KEYS[family]
    # other families: the keys every row has whose values are strings or integers (floats are measurements)
    common = [k for k in rows[0] if all(k in r for r in rows)] if rows else []
    return tuple(k for k in common if k not in _MEASURED and k != "launch"
                 and all(isinstance(r[k], (str, int)) and not isinstance(r[k], bool) for r in rows))


def peers_of(doc: dict) -> list[str]:
    """The peer methods of a document, in the order their rows first appear."""
    return [m for m in dict.fromkeys(r["method"] for r in doc["rows"]) if m != OURS]


def compare_cells(doc: dict) -> list[dict]:
    """One entry per row of ours: ``{"row", "ratios": {peer: peer_us / ours_us}, "pct_read"}``.

    A ratio above 1 means ours is faster. A peer counts for a cell when it has a row with the same shape and the same
    format (a baseline in BASELINES: the same shape only); a peer row timed with the same launch kind is preferred.
    ``pct_read`` is the row's ``gbs`` as % of the read ceiling measured in the same run (None without ``gbs`` or
    a read ceiling).
    """
    family, rows = doc["family"], doc["rows"]
    shape = _identity_keys(family, rows)
    fmt = FORMAT_KEYS.get(family, ())
    read = doc["meta"]["ceilings"]["read_gbs"]
    index = {}
    for r in rows:
        if r["method"] != OURS:
            index.setdefault((r["method"], tuple(r.get(k) for k in shape)), []).append(r)
    cells = []
    for row in (r for r in rows if r["method"] == OURS):
        ratios = {}
        for peer in peers_of(doc):
            candidates = index.get((peer, tuple(row.get(k) for k in shape)), [])
            if peer not in BASELINES:
                candidates = [c for c in candidates if all(c.get(k) == row.get(k) for k in fmt)]
            same_launch = [c for c in candidates if c.get("launch") == row.get("launch")]
            chosen = (same_launch or candidates or [None])[0]
            if chosen is not None:
                ratios[peer] = float(chosen["us"]) / float(row["us"])
        gbs = row.get("gbs")
        pct_read = 100.0 * gbs / read if (gbs is not None and read) else None
        cells.append({"row": row, "ratios": ratios, "pct_read": pct_read})
    return cells


def is_variant(row: dict) -> bool:
    """A row of ours timed with a non-default setting beside the default one (programmatic launches off, or the
    batch-invariant mode)."""
    return row.get("pdl") is False or row.get("mode", "default") != "default"


# the keys that name one table (BENCHMARKS.md) or one panel (notebook 07) of a family
GROUP_KEYS = {"gemm": ("layer", "k", "n"), "moe": ("model", "experts", "topk", "k", "n")}
LAUNCH_ORDER = ("graph", "isolated", "plain")  # a family's timing method first, eager calls after


def group_title(family: str, row: dict) -> str:
    """The name of a row's table or panel: its layer (or model) and shape."""
    shape = f"K × N = {row['k']} × {row['n']}"
    if family == "gemm":
        return shape if row["layer"] == f"{row['k']}x{row['n']}" else f"{row['layer']}: {shape}"
    if family == "moe":
        return f"{row['model']}: {row['experts']} experts, top-{row['topk']}, {shape}"
    return ""


def sorted_cells(cells: list[dict], keys=()) -> list[dict]:
    """compare_cells' entries in reading order: each format of ours as the bench wrote them, its default launch
    first (then its variants, then the other launch kinds), then by ``keys`` (e.g. M)."""
    formats = list(dict.fromkeys(_format_of(c["row"]) for c in cells))

    def order(c):
        row = c["row"]
        launch = LAUNCH_ORDER.index(row["launch"]) if row.get("launch") in LAUNCH_ORDER else len(LAUNCH_ORDER)
        return (formats.index(_format_of(row)), launch, is_variant(row),
                *[(str(type(row.get(k))), row.get(k, "")) for k in keys])

    return sorted(cells, key=order)


def _format_of(row: dict) -> tuple:
    return tuple(str(row.get(k)) for k in ("wtype", "group", "act"))


def config_label(row: dict) -> str:
    """``u4b8 g128 fp16, graph``-style label of a row's format and launch (keys it lacks are left out)."""
    parts = [str(row["wtype"])] if "wtype" in row else []
    if "group" in row and row["group"] is not None:
        parts.append("chan" if row["group"] == -1 else f"g{row['group']}")
    if "act" in row and row["act"] != row.get("wtype"):  # a dense fp16 peer is just "fp16"
        parts.append(str(row["act"]))
    label = " ".join(parts)
    if row.get("pdl") is False:  # ours without programmatic dependent launches, beside the default
        label += " no-PDL"
    if row.get("mode", "default") != "default":  # e.g. batch_invariant
        label += f" {row['mode']}"
    return f"{label}, {row['launch']}" if "launch" in row else label


def format_us(us: float) -> str:
    """A time in µs as the tables print it: one decimal from 10 µs up, two below."""
    return f"{us:.1f}" if us >= 10 else f"{us:.2f}"


def _vs_eager(row: dict) -> str:
    """A decoder launch's logits against eager's (bench_torch.py: teacher-forced on eager's tokens)."""
    if row.get("logits_equal_eager"):
        return "bitwise equal"
    a = row["vs_eager"]
    return f"cos min {a['cos_min']:.6f}, max abs {a['max_abs']:.4f}"


# Columns read from a row's measured fields (floats and records), which the tables of the families without
# SHAPE_KEYS leave out (they show a row's strings and integers): family -> (header, the row key, row -> text). A
# kind of row (``cell``) shows such a column when one of its rows has the key; a row without it reads "—".
MEASURED_COLUMNS = {
    "torch_models": (("vs eager: logits, teacher-forced", "vs_eager", _vs_eager),
                     ("fp16 nn.Linear µs", "fp16_us", lambda row: format_us(float(row["fp16_us"])))),
}


def measured_columns(family: str, rows: list[dict]) -> list[tuple[str, object]]:
    """``(header, row -> text)`` of the MEASURED_COLUMNS of ``family`` that any of ``rows`` carries, "—" for a row
    that lacks the key."""
    return [(header, (lambda row, key=key, text=text: text(row) if key in row else "—"))
            for header, key, text in MEASURED_COLUMNS.get(family, ()) if any(key in r for r in rows)]


def describe_run(doc: dict) -> str:
    """One sentence: where and when the run was, its ceilings and its peers' sources."""
    meta = doc["meta"]
    c = meta["ceilings"]
    ceilings = [f"{name} {c[key]:.0f} GB/s" for name, key in (("device copy", "copy_gbs"),
                                                               ("streaming read", "read_gbs")) if c.get(key)]
    if c.get("mma_tflops"):
        ceilings.append(f"mma.sync fp16 {c['mma_tflops']:.0f} TFLOP/s")
    if c.get("cublas_tflops"):
        ceilings.append(f"cuBLAS fp16 {c['cublas_tflops']:.0f} TFLOP/s")
    peers = ", ".join(f"{k} = {v}" for k, v in meta["peers"].items()) or "none"
    return (f"{meta['gpu']} ({meta['sms']} SMs), {meta['date']}, commit {meta['commit']}; torch {meta['torch']}, "
            f"CuPy {meta['cupy']}, nvcc {meta['nvcc']}. "
            + (f"Ceilings measured in the same run: {', '.join(ceilings)}. " if ceilings else "No device ceilings. ")
            + f"Peers: {peers}.")
