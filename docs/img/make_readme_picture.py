"""Regenerate docs/img/layout_u4b8_32x128.png, the README's picture, with the package's own render function:
the layout explorer's picture for a 32 x 128 INT4 (u4b8) weight, element (k=5, n=70) selected.

    python3 docs/img/make_readme_picture.py
"""
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

from workbench.render.tile import render_layout  # noqa: E402

OUT = Path(__file__).with_name("layout_u4b8_32x128.png")

if __name__ == "__main__":
    fig = render_layout("u4b8", 32, 128, "subblock", k=5, n=70)
    fig.savefig(OUT, dpi=90, metadata={"Software": None})  # no version string: the file changes only with the picture
    print(f"wrote {OUT}")
