"""Pictures of the scale permutations (``formats.scales``): P64 is an 8×8 transpose, P32 a 4×4 transpose of pairs."""
from __future__ import annotations

import numpy as np

from workbench.formats.scales import SCALE_PERM_32, SCALE_PERM_64
from workbench.render._draw import HTML, draw_grid, html_table, new_figure, outline

PERMS = {64: SCALE_PERM_64, 32: SCALE_PERM_32}
# how a chunk is drawn: P64 as 8 rows of 8; P32 as 4 rows of 4 *pairs* (8 values)
_GRID = {64: (8, 8), 32: (4, 8)}


def _perm(width: int) -> np.ndarray:
    if width not in PERMS:
        raise ValueError(f"width = {width} is not a scale permutation width; expected 64 or 32")
    return PERMS[width]


def render_scale_permutation(width: int = 64, selected: int | None = None):
    """Checkpoint order (left) and Marlin order (right) of one chunk; each cell shows the source index it holds.

    Colours follow the source *row* of the left grid, so a transpose shows up as rows turning into columns.
    With ``selected`` (a destination index), that cell and its source are outlined.
    """
    perm = _perm(width)
    rows, cols = _GRID[width]
    unit = 1 if width == 64 else 2  # P32 moves pairs: a "row" of the picture is 4 pairs
    source = np.arange(width)
    source_row = (source // cols) if width == 64 else (source // 8)
    fig, (ax_in, ax_out) = new_figure(9, 2.2 + 0.45 * rows, ncols=2)
    draw_grid(ax_in, source_row.reshape(rows, cols), count=rows, cmap="Set2", labels=source.reshape(rows, cols),
              fontsize=8)
    draw_grid(ax_out, source_row[perm].reshape(rows, cols), count=rows, cmap="Set2", labels=perm.reshape(rows, cols),
              fontsize=8)
    ax_in.set_title(f"checkpoint scales, one {width}-chunk (index i)", fontsize=9)
    what = "an 8×8 block" if width == 64 else "a 4×4 block of column pairs"
    ax_out.set_title(f"Marlin order: out[d] = in[P{width}[d]],\nthe transpose of {what}", fontsize=9)
    for ax in (ax_in, ax_out):
        ax.set_xticks(range(cols))
        ax.set_yticks(range(rows))
    if unit == 2:
        for ax in (ax_in, ax_out):
            for c in range(2, cols, 2):
                ax.axvline(c - 0.5, color="black", linewidth=1.5)
    if selected is not None:
        if not 0 <= int(selected) < width:
            raise ValueError(f"selected = {selected} is outside a {width}-chunk")
        src = int(perm[int(selected)])
        outline(ax_out, *divmod(int(selected), cols))
        outline(ax_in, *divmod(src, cols))
        fig.suptitle(f"Marlin position {selected} holds checkpoint column {src} (of its chunk)", fontsize=10)
    return fig


def lane_scale_columns_html(width: int = 64) -> HTML:
    """Which checkpoint columns a lane's 8 consecutive scale reads return after the permutation."""
    perm = _perm(width)
    rows = []
    if width == 64:  # grouped: lane reads 8 halves at 8*(lane//4); they are the columns it owns in 4 sub-blocks
        for lane in range(0, 32, 4):
            start = 8 * (lane // 4)
            rows.append((f"{lane}..{lane + 3}", start, perm[start:start + 8].tolist()))
        caption = "P64 (grouped scales, applied to B fragments): reads at 8·(lane//4) give columns lane//4 + 8j"
    else:  # channelwise: lane reads 8 halves at 8*(lane%4); they are its accumulator column pairs
        for lane in range(4):
            start = 8 * lane
            rows.append((f"lane%4 = {lane}", start, perm[start:start + 8].tolist()))
        caption = "P32 (channelwise scales, applied to fp32 accumulators): reads at 8·(lane%4) give column pairs"
    return HTML(html_table(["lanes", "first index read", "checkpoint columns"], rows, caption=caption))
