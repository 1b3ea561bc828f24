"""Charts of the committed GPU benchmark data, one per benchmark family, with baselines and ceilings beside ours.

Each function takes the parsed JSON a ``bench/`` script wrote (its schema is the script's; the fields read here are
named in each docstring) and returns a matplotlib Figure or an HTML table. Notebook 07 binds to these.
"""
from __future__ import annotations

import json
import pathlib

import numpy as np

from workbench.render._draw import HTML, html_table, new_figure

PLAIN = " (plain launch)"  # bench_gemm's suffix for ours timed with plain launches beside programmatic ones


def load_result(results_dir, name: str) -> dict | None:
    """The parsed ``results_dir/name`` or None when that file is not committed."""
    path = pathlib.Path(results_dir) / name
    return json.loads(path.read_text()) if path.is_file() else None


def _rows(doc: dict) -> list[dict]:
    return [r for r in doc.get("rows", []) if isinstance(r, dict)]


def _copy_gbs(doc: dict) -> float | None:
    meta = doc.get("meta", doc)
    value = meta.get("copy_gbs") or doc.get("copy_gbs")
    return float(value) if value else None


def _weight_bytes(row: dict) -> float:
    """Bytes a GEMM row moved, recovered from its effective GB/s and time (gbs · us · 1e3)."""
    return float(row["gbs"]) * float(row["us"]) * 1e3


def render_gemm_times(doc: dict, methods: tuple[str, ...] | None = None):
    """GEMM time against M, one panel per (K, N) layer, one line per method (rows: k, n, m, method, us, gbs).

    Dashed: the time the 4-bit group-128 layer would take at the device-copy bandwidth measured in the same run —
    the bandwidth roofline of a weight-streaming GEMM at small M.
    """
    rows = _rows(doc)
    shapes = sorted({(r["k"], r["n"]) for r in rows}, key=lambda s: (s[0] * s[1], s))
    # (bench_gemm's "(plain launch)" timings of ours are left out unless asked for: gemm_bars_html reports them)
    methods = methods or tuple(m for m in dict.fromkeys(r["method"] for r in rows) if not m.endswith(PLAIN))
    cols = min(3, len(shapes))
    fig, axes = new_figure(4.4 * cols, 3.3 * -(-len(shapes) // cols), ncols=cols, nrows=-(-len(shapes) // cols))
    copy = _copy_gbs(doc)
    for ax, (k, n) in zip(axes, shapes):
        for method in methods:
            pts = sorted((r["m"], r["us"]) for r in rows if (r["k"], r["n"], r["method"]) == (k, n, method))
            if pts:
                style = "s--" if ("cuBLAS" in method or "tinygemm" in method) else "o-"
                ax.plot(*zip(*pts), style, markersize=3, linewidth=1, label=method)
        u4 = [r for r in rows if (r["k"], r["n"]) == (k, n) and "u4b8 g128 fp16" in r["method"] and r["m"] == 1]
        if copy and u4:
            ax.axhline(_weight_bytes(u4[0]) / (copy * 1e3), color="black", linestyle=":", linewidth=1,
                       label="4-bit g128 at copy bandwidth")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("M (tokens)")
        ax.set_ylabel("µs")
        ax.set_title(f"K×N = {k}×{n}", fontsize=9)
    axes[0].legend(fontsize=6, loc="upper left")
    for ax in axes[len(shapes):]:
        ax.axis("off")
    return fig


def gemm_bars_html(doc: dict) -> HTML:
    """The issue's speed bars, read off the data: per layer, the range of speedups over cuBLAS fp16 at M ≤ 16 for
    INT4 g128 and FP8, and the M ≤ 64 values where INT4 g128 (bf16) loses to tinygemm. Where the run also timed
    ours with plain launches (bench_gemm's "(plain launch)" methods, beside programmatic ones), their ranges follow
    in brackets."""
    rows = _rows(doc)
    by = {(r["k"], r["n"], r["m"], r["method"]): r for r in rows}
    shapes = sorted({(r["k"], r["n"]) for r in rows}, key=lambda s: (s[0] * s[1], s))
    methods = {r["method"] for r in rows}

    def pick(word: str) -> str | None:
        return next((m for m in sorted(methods) if word in m and not m.endswith(PLAIN)), None)

    int4, fp8, int4_bf16, tiny = (pick("u4b8 g128 fp16"), pick("fe4m3fn"), pick("u4b8 g128 bf16"), pick("tinygemm"))
    table = []
    for k, n in shapes:
        def speedups(method):
            return [by[(k, n, m, method)]["speedup_vs_fp16"] for m in (1, 2, 4, 8, 16) if (k, n, m, method) in by]

        def span(method):
            s = speedups(method)
            text = f"×{min(s):.2f} – ×{max(s):.2f}" if s else "—"
            plain = speedups(f"{method}{PLAIN}") if method else []
            return text + (f" [plain ×{min(plain):.2f} – ×{max(plain):.2f}]" if plain else "")

        compared = [m for m in (1, 2, 4, 8, 16, 32, 64) if (k, n, m, int4_bf16) in by and (k, n, m, tiny) in by]
        losses = [m for m in compared if by[(k, n, m, int4_bf16)]["us"] > by[(k, n, m, tiny)]["us"]]
        verdict = ", ".join(map(str, losses)) or "none" if compared else "not in this run (no bf16 INT4 row)"
        table.append((f"{k}×{n}", span(int4), span(fp8), verdict))
    return HTML(html_table(["layer", "INT4 g128 vs fp16, M ≤ 16 (bar ×2.5)", "FP8 vs fp16, M ≤ 16 (bar ×1.6)",
                            "M ≤ 64 where tinygemm is faster (bar: none)"], table,
                           caption=f"{doc.get('meta', {}).get('gpu', '')} commit {doc.get('meta', {}).get('commit', '')}"))


def render_repack_bandwidth(doc: dict, target: float = 0.8, skip_prefixes: tuple[str, ...] = ("direct ", "staged ")):
    """Repack kernels as a fraction of a device copy of the same bytes (rows: transform, shape, fraction_of_copy).

    Rows whose transform starts with ``skip_prefixes`` (launch-shape sweep variants) are left out.
    """
    rows = [r for r in _rows(doc) if not str(r["transform"]).startswith(skip_prefixes)]
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    cols = min(3, len(shapes))
    tallest = max(len([r for r in rows if r["shape"] == s]) for s in shapes)
    fig, axes = new_figure(5.0 * cols, (0.22 * tallest + 1.0) * -(-len(shapes) // cols), ncols=cols,
                           nrows=-(-len(shapes) // cols))
    for ax, shape in zip(axes, shapes):
        rs = [r for r in rows if r["shape"] == shape]
        frac = np.array([r["fraction_of_copy"] for r in rs])
        ax.barh(range(len(rs)), frac * 100, color=["tab:green" if f >= target else "tab:orange" for f in frac])
        ax.set_yticks(range(len(rs)))
        ax.set_yticklabels([r["transform"] for r in rs], fontsize=6)
        ax.invert_yaxis()
        ax.axvline(target * 100, color="black", linestyle="--", linewidth=1)
        ax.set_xlabel("% of device-copy bandwidth")
        ax.set_title(shape, fontsize=9)
    for ax in axes[len(shapes):]:
        ax.axis("off")
    return fig


def render_moe_bandwidth(doc: dict, target_pct: float = 60.0):
    """MoE paths: % of copy bandwidth on the touched experts against tokens, one panel per model shape
    (rows: config, experts, k, n, top_k, m, method, pct_copy)."""
    rows = _rows(doc)
    configs = list(dict.fromkeys((r["config"], r["experts"], r["k"], r["n"], r["top_k"]) for r in rows))
    fig, axes = new_figure(4.2 * len(configs), 3.2, ncols=len(configs))
    for ax, cfg in zip(axes, configs):
        rs = [r for r in rows if (r["config"], r["experts"], r["k"], r["n"], r["top_k"]) == cfg]
        for method in dict.fromkeys(r["method"] for r in rs):
            pts = sorted((r["m"], r["pct_copy"]) for r in rs if r["method"] == method)
            ax.plot(*zip(*pts), "o-", markersize=3, linewidth=1, label=method)
        ax.axhline(target_pct, color="black", linestyle="--", linewidth=1, label=f"{target_pct:.0f}% bar")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("M (tokens)")
        ax.set_ylabel("% of copy (touched experts)")
        ax.set_title(f"{cfg[0]}: E={cfg[1]} K={cfg[2]} N={cfg[3]} top-{cfg[4]}", fontsize=8)
    axes[0].legend(fontsize=6)
    return fig


def render_repack_ab(doc: dict, shape: str | None = None, target: float = 0.8):
    """Old against new repack kernels from one A/B run (rows: shape, path, variant, fraction_of_copy): per path the
    old kernel and the fastest new launch shape, as % of a device copy, with the target line."""
    rows = [r for r in _rows(doc) if shape is None or r["shape"] == shape]
    shape = shape or rows[0]["shape"]
    rows = [r for r in rows if r["shape"] == shape]
    paths = list(dict.fromkeys(r["path"] for r in rows))
    old = [max((r for r in rows if r["path"] == p and r["variant"].startswith("old")),
               key=lambda r: r["fraction_of_copy"])["fraction_of_copy"] * 100 for p in paths]
    new = [max((r for r in rows if r["path"] == p and r["variant"].startswith("new")),
               key=lambda r: r["fraction_of_copy"])["fraction_of_copy"] * 100 for p in paths]
    fig, (ax,) = new_figure(6.5, 0.42 * len(paths) + 1.0)
    y = np.arange(len(paths))
    ax.barh(y - 0.2, old, height=0.4, color="tab:gray", label="before")
    ax.barh(y + 0.2, new, height=0.4, color=["tab:green" if v >= target * 100 else "tab:orange" for v in new],
            label="now")
    ax.set_yticks(y)
    ax.set_yticklabels(paths, fontsize=7)
    ax.invert_yaxis()
    ax.axvline(target * 100, color="black", linestyle="--", linewidth=1)
    ax.set_xlabel("% of device-copy bandwidth")
    ax.set_title(f"repack kernels, before and now ({shape})", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    return fig


def render_ablation(doc: dict, variants: tuple[str, ...] | None = None, grid_kind: str = "policy"):
    """The dense kernel with parts of its loop taken out (bench/ablation_probe.py; rows: k, n, m, label, variant, us,
    optional grid_kind): per cell one bar per variant in µs, the first variant (the kernel as it is) on top. Rows of
    another grid_kind are left out."""
    rows = [r for r in _rows(doc) if r.get("grid_kind", grid_kind) == grid_kind]
    variants = variants or tuple(dict.fromkeys(r["variant"] for r in rows))
    cells = list(dict.fromkeys((r["label"], r["k"], r["n"], r["m"]) for r in rows))
    us = {(r["label"], r["k"], r["n"], r["m"], r["variant"]): float(r["us"]) for r in rows}
    fig, (ax,) = new_figure(7.0, 0.5 * len(cells) * len(variants) / 2 + 1.2)
    height = 0.8 / len(variants)
    y = np.arange(len(cells))
    for i, variant in enumerate(variants):
        vals = [us.get((*cell, variant), np.nan) for cell in cells]
        ax.barh(y + (i - (len(variants) - 1) / 2) * height, vals, height=height, label=variant)
    ax.set_yticks(y)
    ax.set_yticklabels([f"{label.removeprefix('marlin ')} {k}×{n} M={m}" for label, k, n, m in cells], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("µs per call")
    ax.set_title("the GEMM with parts of its loop taken out (wrong results, timed only)", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    return fig
