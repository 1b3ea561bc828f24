"""Benchmark data committed under ``bench/results/``: read whatever JSON is there and draw bandwidth against M.

The benchmark scripts own their schema; this reader only relies on a few field names and says which files it could
not chart instead of guessing: a record is charted when it has an ``M`` (or ``m``) and one bandwidth field.
"""
from __future__ import annotations

import json
import pathlib

import numpy as np

from workbench.render._draw import HTML, html_table, new_figure

BANDWIDTH_KEYS = ("gbps", "GB/s", "effective_gbps", "bandwidth_gbps", "eff_gbps", "gb_per_s", "GB_per_s")
MB_KEYS = ("MB_per_s", "mb_per_s", "MB/s")  # read as GB/s / 1000
SERIES_KEYS = ("impl", "kernel", "backend", "name", "op", "method")
M_KEYS = ("M", "m", "size_m")
COPY_KEYS = ("copy_gbps", "copy_GB/s", "copy_bandwidth_gbps", "memcpy_gbps")


def _records_of(doc) -> tuple[list[dict], dict]:
    """(records, file-level metadata) of one JSON document."""
    if isinstance(doc, list):
        return [r for r in doc if isinstance(r, dict)], {}
    if isinstance(doc, dict):
        for key in ("results", "records", "rows", "data", "measurements"):
            if isinstance(doc.get(key), list):
                meta = {k: v for k, v in doc.items() if not isinstance(v, (list, dict))}
                meta.update(doc.get("meta") if isinstance(doc.get("meta"), dict) else {})
                return [r for r in doc[key] if isinstance(r, dict)], meta
        return [], {k: v for k, v in doc.items() if not isinstance(v, (list, dict))}
    return [], {}


def load_bench_results(directory) -> list[dict]:
    """One entry per JSON file: {"file", "records", "meta", "error"} (sorted by file name; unreadable files named)."""
    directory = pathlib.Path(directory)
    out = []
    for path in sorted(directory.glob("*.json")) if directory.is_dir() else []:
        try:
            records, meta = _records_of(json.loads(path.read_text()))
            out.append({"file": path.name, "records": records, "meta": meta, "error": None})
        except (OSError, ValueError) as exc:
            out.append({"file": path.name, "records": [], "meta": {}, "error": f"{type(exc).__name__}: {exc}"})
    return out


def _first(record: dict, keys) -> object:
    for key in keys:
        if key in record and record[key] is not None:
            return record[key]
    return None


def bandwidth_gbps(record: dict) -> float | None:
    """The record's effective bandwidth in GB/s (from a GB/s field, or an MB/s field / 1000), else None."""
    gb = _first(record, BANDWIDTH_KEYS)
    if isinstance(gb, (int, float)):
        return float(gb)
    mb = _first(record, MB_KEYS)
    if not isinstance(mb, (int, float)):  # e.g. "repack_MB_per_s": the first field named in MB/s
        mb = next((v for k, v in sorted(record.items()) if k.endswith("MB_per_s") and isinstance(v, (int, float))),
                  None)
    return float(mb) / 1000.0 if isinstance(mb, (int, float)) else None


def chartable(record: dict) -> bool:
    return bandwidth_gbps(record) is not None


# result files the notebooks look for: file-name prefix -> who writes them
EXPECTED = {"gemm": "the native GEMM benchmark (bench/bench_gemm.py, on a GPU)",
            "repack": "the Numba repack benchmark (bench/bench_repack.py, on a GPU)"}


def missing_results(results: list[dict], expected=EXPECTED) -> list[str]:
    """One sentence per expected result family with no ``<prefix>_*.json`` file."""
    return [f"No {prefix}_*.json yet: {who} has not committed results." for prefix, who in expected.items()
            if not any(r["file"].startswith(prefix) for r in results)]


def bench_summary_html(results: list[dict], directory: str = "bench/results", expected=EXPECTED) -> HTML:
    missing = "".join(f"<p class='wb-bench-missing'>{m}</p>" for m in missing_results(results, expected))
    if not results:
        return HTML(f"<p class='wb-bench-missing'>No benchmark results under <code>{directory}</code> yet: the GEMM and "
                    f"repack benchmarks (run on a GPU) write their JSON there.</p>{missing}")
    rows = []
    for entry in results:
        n_chart = sum(chartable(r) for r in entry["records"])
        keys = sorted({k for r in entry["records"] for k in r})
        rows.append((entry["file"], len(entry["records"]), n_chart, entry["error"] or ", ".join(keys[:12])))
    return HTML(html_table(["file", "records", "chartable", "fields (or error)"], rows,
                           caption=f"benchmark data under {directory}") + missing)


def render_bandwidth_chart(results: list[dict]):
    """Effective GB/s: against M (one line per implementation) where records have M, else one bar per op.

    One panel per file and (K, N) shape; a device-copy ceiling, when the data has one, is drawn dashed.
    """
    panels = {}
    for entry in results:
        for r in entry["records"]:
            if chartable(r):
                shape = (r.get("K", r.get("k")), r.get("N", r.get("n")))
                panels.setdefault((entry["file"], shape), []).append(r)
    if not panels:
        fig, (ax,) = new_figure(6, 1.2)
        ax.axis("off")
        ax.text(0.5, 0.5, "no chartable benchmark records (need M and a GB/s field)", ha="center", va="center")
        return fig
    keys = sorted(panels, key=str)[:12]
    cols = min(3, len(keys))
    rows_n = -(-len(keys) // cols)
    fig, axes = new_figure(4.2 * cols, 3.2 * rows_n, ncols=cols, nrows=rows_n)
    for ax, key in zip(axes, keys):
        recs = panels[key]
        file, shape = key
        title = f"{file}\nK×N = {shape[0]}×{shape[1]}" if shape[0] else file
        if not any(isinstance(_first(r, M_KEYS), (int, float)) for r in recs):  # no M: one bar per op
            names = [str(_first(r, SERIES_KEYS) or i) for i, r in enumerate(recs)]
            ax.barh(range(len(recs)), [bandwidth_gbps(r) for r in recs])
            ax.set_yticks(range(len(recs)))
            ax.set_yticklabels(names, fontsize=7)
            ax.set_xscale("log")
            ax.set_xlabel("effective GB/s")
            ax.set_title(title, fontsize=8)
            continue
        series = {}
        for r in recs:
            series.setdefault(str(_first(r, SERIES_KEYS) or "ours"), []).append(r)
        for name, rs in sorted(series.items()):
            rs = sorted(rs, key=lambda r: _first(r, M_KEYS))
            ax.plot([_first(r, M_KEYS) for r in rs], [bandwidth_gbps(r) for r in rs], "o-", markersize=3,
                    label=name)
        ceilings = [c for c in (_first(r, COPY_KEYS) for r in recs) if isinstance(c, (int, float))]
        if ceilings:
            ax.axhline(float(np.median(ceilings)), color="black", linestyle="--", linewidth=1, label="device copy")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("M (tokens)")
        ax.set_ylabel("effective GB/s")
        ax.set_title(title, fontsize=8)
        ax.legend(fontsize=6)
    for ax in axes[len(keys):]:
        ax.axis("off")
    return fig


def repo_results_dir(start=None) -> pathlib.Path:
    """``bench/results`` of the checkout that contains ``start`` (default: the working directory)."""
    here = pathlib.Path(start or pathlib.Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / "pyproject.toml").is_file():
            return folder / "bench" / "results"
    return here / "bench" / "results"
