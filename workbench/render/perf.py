"""Charts and tables of the current benchmark results (``bench/results/<family>.json``, read through
``workbench.render.bench``): ours beside each peer, against the ceilings measured in the same run. Notebook 07 binds
to these; ``bench/report.py`` writes the full tables of BENCHMARKS.md from the same cells.
"""
from __future__ import annotations

import numpy as np

from workbench.render._draw import HTML, OKABE_ITO, html_table, new_figure
from workbench.render.bench import GROUP_KEYS, OURS, compare_cells, config_label, group_title, peers_of, sorted_cells


def render_times(doc: dict, launch: str = "graph"):
    """Time per call against M, one panel per layer (GEMM) or model (MoE), one line per method and format timed
    with ``launch``; ours solid, peers dashed."""
    family = doc["family"]
    keys = GROUP_KEYS[family]
    rows = [r for r in doc["rows"] if r.get("launch") == launch]
    panels = list(dict.fromkeys(tuple(r[k] for k in keys) for r in rows))
    cols = max(1, min(3, len(panels)))
    fig, axes = new_figure(4.2 * cols, 3.2 * max(1, -(-len(panels) // cols)), ncols=cols,
                           nrows=max(1, -(-len(panels) // cols)))
    series = list(dict.fromkeys((r["method"], config_label(r).rsplit(",", 1)[0]) for r in rows))
    colors = dict(zip(series, OKABE_ITO * 4))
    for ax, panel in zip(axes, panels):
        for method, fmt in series:
            pts = sorted((r["m"], r["us"]) for r in rows if tuple(r[k] for k in keys) == panel
                         and (r["method"], config_label(r).rsplit(",", 1)[0]) == (method, fmt))
            if pts:
                ax.plot(*zip(*pts), "o-" if method == OURS else "s--", color=colors[(method, fmt)], markersize=3,
                        linewidth=1, label=f"{method} {fmt}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("M (tokens)")
        ax.set_ylabel("µs per call")
        ax.set_title(group_title(family, dict(zip(keys, panel))), fontsize=8)
    if panels:
        axes[0].legend(fontsize=6, loc="upper left")
    for ax in axes[len(panels):]:
        ax.axis("off")
    return fig


def ratio_summary(doc: dict, split_m: int = 16) -> list[tuple]:
    """Per format and launch of ours and per peer: the range of peer time ÷ our time over the cells with
    M ≤ ``split_m`` and over the larger ones (families without M: over all cells), and the range of % of the read
    ceiling. Rows: (format, peer, small-M range, large-M range, % of read range)."""
    cells = sorted_cells(compare_cells(doc))
    out = []

    def span(values, fmt):
        if not values:
            return "—"
        low, high = fmt(min(values)), fmt(max(values))
        return low if low == high else f"{low} – {high}"

    for config in dict.fromkeys(config_label(c["row"]) for c in cells):
        mine = [c for c in cells if config_label(c["row"]) == config]
        small = [c for c in mine if c["row"].get("m", 0) <= split_m]
        large = [c for c in mine if c["row"].get("m", 0) > split_m]
        reads = [c["pct_read"] for c in mine if c["pct_read"] is not None]
        for peer in peers_of(doc):
            out.append((config, peer, span([c["ratios"][peer] for c in small if peer in c["ratios"]],
                                           lambda v: f"×{v:.2f}"),
                        span([c["ratios"][peer] for c in large if peer in c["ratios"]], lambda v: f"×{v:.2f}"),
                        span(reads, lambda v: f"{v:.0f}%")))
    return out


def ratio_summary_html(doc: dict, split_m: int = 16) -> HTML:
    """ratio_summary as a table (peer time ÷ our time: above ×1, ours is faster)."""
    has_m = any("m" in r for r in doc["rows"])
    small, large = (f"M ≤ {split_m}", f"M > {split_m}") if has_m else ("all cells", "—")
    return HTML(html_table(["ours: format, launch", "peer", f"× peer, {small}", f"× peer, {large}",
                            "ours, % of read ceiling"], ratio_summary(doc, split_m),
                           caption=f"{doc['family']}: peer time ÷ our time"))


def render_ratios(doc: dict, config: str | None = None):
    """Peer time ÷ our time against M for one format of ours (default: the first), one panel per peer, one line
    per layer or model; ×1 drawn as the break-even line."""
    family = doc["family"]
    cells = compare_cells(doc)
    config = config or next((config_label(c["row"]) for c in cells), None)
    cells = [c for c in cells if config_label(c["row"]) == config]
    peers = [p for p in peers_of(doc) if any(p in c["ratios"] for c in cells)]
    keys = GROUP_KEYS.get(family, ())
    fig, axes = new_figure(3.6 * max(1, len(peers)), 3.0, ncols=max(1, len(peers)), sharey=True)
    if not peers:
        axes[0].text(0.5, 0.5, f"no peer rows beside ours ({config})", ha="center", va="center")
        axes[0].axis("off")
        return fig
    panels = list(dict.fromkeys(tuple(c["row"][k] for k in keys) for c in cells))
    for ax, peer in zip(axes, peers):
        for panel, color in zip(panels, OKABE_ITO * 4):
            pts = sorted((c["row"]["m"], c["ratios"][peer]) for c in cells
                         if tuple(c["row"][k] for k in keys) == panel and peer in c["ratios"])
            if pts:
                ax.plot(*zip(*pts), "o-", color=color, markersize=3, linewidth=1,
                        label=group_title(family, dict(zip(keys, panel))))
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("M (tokens)")
        ax.set_title(f"{peer} time ÷ ours", fontsize=9)
    axes[0].set_ylabel(f"ours: {config}")
    axes[0].legend(fontsize=6)
    return fig


def render_repack(doc: dict, launch: str = "isolated"):
    """Each repack op as % of a device copy of the same bytes, ours and peers side by side (one bar each), from the
    rows timed with ``launch`` (rows without a launch kind count for any)."""
    rows = [r for r in doc["rows"] if r.get("launch", launch) == launch]
    labels = list(dict.fromkeys(f"{r['op']} {r['wtype']} {r['k']}×{r['n']}" for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, (ax,) = new_figure(7.0, 0.35 * len(labels) * max(1, len(methods)) / 1.5 + 1.2)
    y = np.arange(len(labels))
    height = 0.8 / len(methods)
    for i, (method, color) in enumerate(zip(methods, OKABE_ITO * 2)):
        pct = {f"{r['op']} {r['wtype']} {r['k']}×{r['n']}": r["pct_copy"] for r in rows if r["method"] == method}
        ax.barh(y + (i - (len(methods) - 1) / 2) * height, [pct.get(label, np.nan) for label in labels],
                height=height, color=color, label=method)
    ax.set_yticks(y, labels, fontsize=7)
    ax.invert_yaxis()
    ax.axvline(100.0, color="black", linestyle=":", linewidth=1)
    ax.set_xlabel("% of a device copy of the same bytes")
    ax.legend(fontsize=7, loc="lower right")
    return fig
