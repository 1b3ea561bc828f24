"""Drawing helpers shared by the render functions: Figures without pyplot, grids, outlines, HTML tables.

Every render function builds a fresh ``matplotlib.figure.Figure`` (never pyplot), so nothing is shown as a side
effect, nothing global is touched, and tests can call them headless.
"""
from __future__ import annotations

import html
from typing import Iterable, Sequence

import numpy as np
from matplotlib import colormaps
from matplotlib.colors import BoundaryNorm, Colormap, ListedColormap, to_rgb
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from matplotlib.ticker import MaxNLocator

HIGHLIGHT = "#d62728"  # the selected element
COMPANION = "#111111"  # the other codes of the selected word
OUTLINE = "#ffffff"


def new_figure(width: float, height: float, ncols: int = 1, nrows: int = 1, sharey: bool = False,
               **gridspec) -> tuple[Figure, np.ndarray]:
    fig = Figure(figsize=(width, height), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False, sharey=sharey, gridspec_kw=gridspec or None)
    return fig, axes.ravel()


# Lanes: hue = lane // 4 (PTX groupID: the B column a lane owns), lightness = lane % 4 (threadID_in_group: its k
# pair). Eight Okabe–Ito hues (told apart with the common forms of colour blindness) × four lightness steps give 32
# distinguishable colours; pictures of lanes also label every cell with its lane.
OKABE_ITO = ["#E69F00", "#56B4E9", "#009E73", "#F0E442", "#0072B2", "#D55E00", "#CC79A7", "#000000"]
LANE_LIGHTNESS = (0.0, 0.3, 0.55, 0.75)  # how far towards white, for lane % 4 = 0..3


def lane_colors() -> np.ndarray:
    """(32, 3) RGB, one colour per lane of a warp."""
    base = np.array([to_rgb(OKABE_ITO[lane // 4]) for lane in range(32)])
    light = np.array([LANE_LIGHTNESS[lane % 4] for lane in range(32)])[:, None]
    return base + (1.0 - base) * light


def lane_cmap() -> ListedColormap:
    return ListedColormap(lane_colors(), name="lanes")


def text_color(rgb) -> str:
    """Black or white, whichever reads better on a cell of colour ``rgb``."""
    return "black" if float(np.dot(np.asarray(rgb)[:3], [0.299, 0.587, 0.114])) > 0.45 else "white"


def discrete_cmap(count: int, name: "str | Colormap" = "tab20") -> tuple[ListedColormap, BoundaryNorm]:
    """A colour per integer value 0..count-1 (cycled when the palette is shorter)."""
    base = colormaps[name] if isinstance(name, str) else name
    colors = [base(i % base.N) for i in range(count)]
    return ListedColormap(colors), BoundaryNorm(np.arange(count + 1) - 0.5, count)


def draw_grid(ax, values: np.ndarray, *, count: int | None = None, cmap: "str | Colormap" = "tab20",
              labels: np.ndarray | None = None, fontsize: float = 6.0, colorbar: str | None = None):
    """Integer grid as coloured cells, optionally with a text label in each cell (black or white by contrast).
    Axis ticks are integers: the cells are discrete. Returns the image."""
    values = np.asarray(values)
    count = int(values.max()) + 1 if count is None else count
    cm, norm = discrete_cmap(count, cmap)
    image = ax.imshow(values, cmap=cm, norm=norm, interpolation="nearest", aspect="equal")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    if labels is not None:
        for (r, c), text in np.ndenumerate(labels):
            ax.text(c, r, str(text), ha="center", va="center", fontsize=fontsize,
                    color=text_color(cm(norm(values[r, c]))))
    if colorbar:
        bar = ax.figure.colorbar(image, ax=ax, label=colorbar, shrink=0.8)
        bar.set_ticks(np.arange(0, count, max(1, count // 8)))
    return image


def outline(ax, row: float, col: float, height: float = 1, width: float = 1, color: str = HIGHLIGHT,
            linewidth: float = 2.0, fill: bool = False, alpha: float = 1.0) -> None:
    """Rectangle around cells [row, row+height) × [col, col+width) of an imshow grid."""
    ax.add_patch(Rectangle((col - 0.5, row - 0.5), width, height, fill=fill, edgecolor=color, facecolor=color,
                           linewidth=linewidth, alpha=alpha))


def separators(ax, every_row: int | None, every_col: int | None, shape: tuple[int, int], color: str = OUTLINE,
               linewidth: float = 1.0) -> None:
    rows, cols = shape
    if every_row:
        for r in range(every_row, rows, every_row):
            ax.axhline(r - 0.5, color=color, linewidth=linewidth)
    if every_col:
        for c in range(every_col, cols, every_col):
            ax.axvline(c - 0.5, color=color, linewidth=linewidth)


def html_table(header: Sequence[str], rows: Iterable[Sequence[object]], caption: str = "", css_class: str = "") -> str:
    """A plain HTML table (escaped). Deterministic text, so nbval compares it."""
    cls = f' class="{html.escape(css_class)}"' if css_class else ""
    parts = [f"<table{cls}>"]
    if caption:
        parts.append(f"<caption>{html.escape(caption)}</caption>")
    parts.append("<tr>" + "".join(f"<th>{html.escape(str(h))}</th>" for h in header) + "</tr>")
    for row in rows:
        parts.append("<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in row) + "</tr>")
    parts.append("</table>")
    return "\n".join(parts)


def hex_word(value) -> str:
    return f"0x{int(np.uint32(np.int64(value) & 0xFFFFFFFF)):08x}"


class HTML(str):
    """An HTML string that Jupyter renders as HTML (``_repr_html_``) and everything else treats as a str."""

    def _repr_html_(self) -> str:
        return str(self)

    def __repr__(self) -> str:  # keeps notebooks' text/plain short; the HTML itself is what nbval compares
        return f"<HTML, {len(self)} characters>"
