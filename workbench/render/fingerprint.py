"""A short hash of what a figure draws, for notebooks to assert in the cell that draws it.

nbval compares a figure only as the text ``<Figure size ... with N Axes>`` (PNG bytes change with every matplotlib
release, so they are not compared at all). ``figure_fingerprint`` hashes the *data* a render function handed to
matplotlib instead: image arrays, the colours of their colormaps, every text (cell labels, titles, axis labels,
explicitly set tick labels), line coordinates and patch rectangles. A swapped, shifted or blank picture changes it;
a new matplotlib version that rasterizes differently does not. Automatic tick labels (chosen by matplotlib's
locators) and colorbar axes are left out for the same reason.
"""
from __future__ import annotations

import hashlib

import numpy as np
from matplotlib.image import AxesImage
from matplotlib.patches import Rectangle
from matplotlib.ticker import FixedFormatter


def _feed(h, *parts) -> None:
    for part in parts:
        if isinstance(part, np.ndarray):
            a = np.ascontiguousarray(part)
            if a.dtype.kind == "f":
                a = np.round(a.astype(np.float64), 6)
            h.update(str(a.shape).encode() + a.tobytes())
        else:
            h.update(repr(part).encode())


def _axis_labels(axis) -> list[str]:
    formatter = axis.get_major_formatter()
    return list(formatter.seq) if isinstance(formatter, FixedFormatter) else []


def figure_fingerprint(fig) -> str:
    """16 hex digits of sha256 over the drawn data of every (non-colorbar) axes of ``fig``, in order."""
    h = hashlib.sha256()
    for ax in fig.axes:
        if hasattr(ax, "_colorbar"):
            continue
        _feed(h, "axes", ax.get_title(), ax.get_xlabel(), ax.get_ylabel(), _axis_labels(ax.xaxis),
              _axis_labels(ax.yaxis))
        for image in ax.get_images():
            if isinstance(image, AxesImage):
                data = np.ma.filled(np.ma.asarray(image.get_array()).astype(np.float64), np.nan)
                _feed(h, "image", data, np.asarray(image.to_rgba(data, bytes=True)))
        for text in ax.texts:
            _feed(h, "text", text.get_text(), np.asarray(text.get_position(), dtype=np.float64))
        for line in ax.get_lines():
            _feed(h, "line", np.asarray(line.get_xydata(), dtype=np.float64))
        for patch in ax.patches:
            if isinstance(patch, Rectangle):
                _feed(h, "rect", np.array([*patch.get_xy(), patch.get_width(), patch.get_height()], np.float64),
                      patch.get_edgecolor())
        for collection in ax.collections:
            _feed(h, "collection", np.asarray(collection.get_offsets(), dtype=np.float64))
    return h.hexdigest()[:16]


def assert_fingerprint(fig, expected: str):
    """Assert that ``fig`` draws the data it drew when the notebook was committed; returns ``fig`` (to display it)."""
    got = figure_fingerprint(fig)
    assert got == expected, (f"the figure's data changed: fingerprint {got}, committed {expected}. If the change is "
                             "intended, re-execute the notebook and commit the new fingerprint.")
    return fig
