"""ipywidgets front ends: the layout explorer and the index-map inspector.

They hold no layout logic: every control change calls a pure render function of ``workbench.render`` (a Figure,
shown as a PNG ``Image`` widget, and HTML) with the current values. Position controls are kept consistent through
``marlin_kn_to_word_field`` / ``marlin_word_field_to_kn``.
"""
from __future__ import annotations

import html
import io

import ipywidgets as widgets
import numpy as np

from workbench.formats import marlin_tile as mt
from workbench.formats.packing import pack_factor
from workbench.formats.scales import SCALE_PERM_32, SCALE_PERM_64
from workbench.render import fp8 as rfp8
from workbench.render import scales as rscales
from workbench.render import tile as rtile
from workbench.render._draw import html_table

MICROSCALE_FORMATS = ("nvfp4", "mxfp4", "mxfp8")  # their group size is fixed by the format (formats.microscale)
FORMATS = ("u4b8", "u4", "u8b128", "u8", "fe4m3fn") + MICROSCALE_FORMATS
K_CHOICES = (16, 32, 64, 128)
N_CHOICES = (64, 128, 192, 256)
GROUP_CHOICES = (-1, 32, 64, 128)


# Widget HTML gets no notebook table styling: without padding the columns of a table run together.
TABLE_STYLE = ("<style>.wb-layout-explorer td, .wb-layout-explorer th, .wb-index-inspector td, .wb-index-inspector th "
               "{padding: 1px 10px; text-align: right} .wb-layout-explorer caption {font-weight: bold}</style>")
DPI = 144  # twice the CSS pixel density the image is shown at: sharp on high-dpi screens, not stretched


def figure_png(fig, dpi: int = DPI) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def show_figure(image, fig, dpi: int) -> None:
    """Put ``fig`` into an Image widget at its natural size (72 CSS px per inch of figure), rendered at ``dpi``."""
    image.value = figure_png(fig, dpi)
    image.layout.width = f"{round(fig.get_figwidth() * 72)}px"


def widget_bundle(widget, summary: str) -> dict:
    """A widget's display data with a one-line text/plain instead of ``VBox(children=...)``: that text is what a
    committed (or untrusted) notebook shows until it is run."""
    bundle = dict(widget._repr_mimebundle_())
    bundle["text/plain"] = summary
    return bundle


def _display_widget(widget, summary: str) -> None:
    from IPython.display import display

    display(widget_bundle(widget, summary), raw=True)


def _groups_for(size_k: int, fmt: str = FORMATS[0]) -> list[int]:
    """The group sizes the dropdown offers. A microscaling format offers its own group (even where K does not hold a
    whole one: the widget then says why) beside the others, so that choosing another shows the format's rule."""
    groups = [g for g in GROUP_CHOICES if g == -1 or (g <= size_k and size_k % g == 0)]
    micro = rtile.microscale_of(fmt)
    if micro is not None and micro.group_size not in groups:
        groups = sorted(groups + [micro.group_size], key=lambda g: (g != -1, g))
    return groups


def _default_group(fmt: str, groups: list[int], previous: int) -> int:
    micro = rtile.microscale_of(fmt)
    if micro is not None:
        return micro.group_size
    return previous if previous in groups else -1


class LayoutExplorer:
    """Choose format, K, N, group size and a position; see its path in the source matrix and the packed tensor."""

    def __init__(self, fmt: str = "u4b8", size_k: int = 32, size_n: int = 128, group_size: int | None = None,
                 k: int = 5, n: int = 70, color_by: str = "subblock", dpi: int = DPI):
        self.dpi = dpi
        self._syncing = False
        style = {"description_width": "initial"}
        if fmt not in FORMATS:
            raise ValueError(f"fmt = {fmt!r} is not one of the explorer's formats {FORMATS}")
        groups = _groups_for(size_k, fmt)
        if group_size is None:  # the format's own group for a microscaling format, else channelwise
            group_size = _default_group(fmt, groups, -1)
        if group_size not in groups:
            if rtile.microscale_of(fmt) is None:
                raise ValueError(f"group_size = {group_size!r} is not one of {groups} for K = {size_k}")
            # a Dropdown refuses a value outside its options: add it, and the widget says why the format refuses it
            groups = sorted(groups + [group_size], key=lambda g: (g != -1, g))
        self.fmt = widgets.Dropdown(options=FORMATS, value=fmt, description="format")
        self.size_k = widgets.Dropdown(options=K_CHOICES, value=size_k, description="K")
        self.size_n = widgets.Dropdown(options=N_CHOICES, value=size_n, description="N")
        self.group_size = widgets.Dropdown(options=groups, value=group_size, description="group size",
                                           style=style)
        self.color_by = widgets.Dropdown(options=list(rtile.COLOR_BY), value=color_by, description="colour by",
                                         style=style)
        self.k = widgets.IntSlider(value=k, min=0, max=size_k - 1, description="k", continuous_update=False)
        self.n = widgets.IntSlider(value=n, min=0, max=size_n - 1, description="n", continuous_update=False)
        self.word = widgets.IntSlider(value=0, min=0, max=self._words() - 1, description="word",
                                      continuous_update=False)
        self.field = widgets.IntSlider(value=0, min=0, max=pack_factor(rtile.bits_of(fmt)) - 1, description="field",
                                       continuous_update=False)
        self.image = widgets.Image(format="png")
        self.path = widgets.HTML()
        self.word_table = widgets.HTML()
        self.path.add_class("wb-explorer-path")
        for control in (self.fmt, self.size_k, self.size_n):
            control.observe(self._on_shape, names="value")
        for control in (self.group_size, self.color_by):
            control.observe(self._on_setting, names="value")
        for control in (self.k, self.n):
            control.observe(self._on_kn, names="value")
        for control in (self.word, self.field):
            control.observe(self._on_word_field, names="value")
        self.widget = widgets.VBox([
            widgets.HBox([self.fmt, self.size_k, self.size_n, self.group_size, self.color_by]),
            widgets.HBox([self.k, self.n, self.word, self.field]),
            widgets.HBox([self.path, self.word_table]),
            self.image,
        ])
        self.widget.add_class("wb-layout-explorer")
        self.error: str | None = None
        self._sync_word_field()
        self.refresh()

    # ---- state -------------------------------------------------------------------------------------------------
    @property
    def bits(self) -> int:
        return rtile.bits_of(self.fmt.value)

    def _words(self) -> int:
        return self.size_k.value // mt.TILE_K * self.size_n.value * mt.TILE_K // pack_factor(self.bits)

    def _sync_word_field(self) -> None:
        word, field = mt.marlin_kn_to_word_field(self.k.value, self.n.value, self.size_n.value, self.bits)
        self._syncing = True
        try:
            self.word.value, self.field.value = int(word), int(field)
        finally:
            self._syncing = False

    # ---- events ------------------------------------------------------------------------------------------------
    def _on_shape(self, change) -> None:
        # Every bound first, then the group choices: nothing may draw until the whole state describes one shape
        # (assigning options fires the group observer, which used to draw K = 128 content under K = 16).
        self._syncing = True
        try:
            self.k.max = self.size_k.value - 1  # lowering max clamps the value too
            self.n.max = self.size_n.value - 1
            self.word.max = self._words() - 1
            self.field.max = pack_factor(self.bits) - 1
            groups = _groups_for(self.size_k.value, self.fmt.value)
            previous = self.group_size.value
            self.group_size.options = groups
            self.group_size.value = _default_group(self.fmt.value, groups, previous)
        finally:
            self._syncing = False
        self._sync_word_field()
        self.refresh()

    def _on_setting(self, change) -> None:
        if not self._syncing:
            self.refresh()

    def _on_kn(self, change) -> None:
        if self._syncing:
            return
        self._sync_word_field()
        self.refresh()

    def _on_word_field(self, change) -> None:
        if self._syncing:
            return
        k, n = mt.marlin_word_field_to_kn(self.word.value, self.field.value, self.size_n.value, self.bits)
        self._syncing = True
        try:
            self.k.value, self.n.value = int(k), int(n)
        finally:
            self._syncing = False
        self.refresh()

    def refresh(self) -> None:
        fmt, size_k, size_n = self.fmt.value, self.size_k.value, self.size_n.value
        try:
            path = rtile.position_path_html(fmt, size_k, size_n, self.k.value, self.n.value, self.group_size.value)
            word_table = rtile.word_sources_html(fmt, size_k, size_n, self.word.value)
            fig = rtile.render_layout(fmt, size_k, size_n, self.color_by.value, self.k.value, self.n.value,
                                      zoom=size_k * size_n > 64 * 128)  # large shapes: zoom on the element's tile
        except ValueError as exc:  # shown where the learner looks, not only in JupyterLab's log console
            self.error = str(exc)
            self.path.value = f'<p class="wb-error" style="color:#b00020">{html.escape(str(exc))}</p>'
            return
        self.error = None
        # picture first, so that by the time the highlighted word's text changes the picture already shows it
        show_figure(self.image, fig, self.dpi)
        self.word_table.value = TABLE_STYLE + word_table
        self.path.value = TABLE_STYLE + path

    def summary(self) -> str:
        """One line of the current state: the text a notebook shows where widgets are not rendered."""
        return (f"Layout explorer: {self.fmt.value}, K = {self.size_k.value}, N = {self.size_n.value}, group size "
                f"{self.group_size.value}; (k, n) = ({self.k.value}, {self.n.value}) is word {self.word.value}, "
                f"field {self.field.value} (run the notebook to use the controls)")

    def _ipython_display_(self):
        _display_widget(self.widget, self.summary())


def layout_explorer(**kwargs) -> LayoutExplorer:
    return LayoutExplorer(**kwargs)


# ---------------------------------------------------------------------------------------------------------------
# index-map inspector
# ---------------------------------------------------------------------------------------------------------------
MAPS = ("scale P64 (grouped)", "scale P32 (channelwise)", "scale P64 + [0,2,1,3] shuffle (NVFP4, MX)",
        "block-FP8 word sources", "block-FP8 scale sources")


class IndexMapInspector:
    """Pick a map and a destination index; see where it reads from."""

    def __init__(self, which: str = MAPS[0], size_k: int = 256, size_n: int = 128, index: int = 10, dpi: int = DPI):
        self.dpi = dpi
        self.which = widgets.Dropdown(options=MAPS, value=which, description="map", layout={"width": "320px"})
        self.size_k = widgets.Dropdown(options=(128, 256, 384), value=size_k, description="K (FP8)")
        self.size_n = widgets.Dropdown(options=(64, 128, 256), value=size_n, description="N (FP8)")
        if which not in MAPS:
            raise ValueError(f"which = {which!r} is not one of {MAPS}")
        # the slider's range comes from the map before the value is set: IntSlider clamps a value beyond max
        domain = self._domain_of(which, size_k, size_n)
        if not 0 <= index < domain:
            raise ValueError(f"index = {index} is outside {which!r} for K = {size_k}, N = {size_n}: destinations "
                             f"are 0..{domain - 1}")
        self.index = widgets.IntSlider(value=index, min=0, max=domain - 1, description="destination",
                                       continuous_update=False)
        self.image = widgets.Image(format="png")
        self.info = widgets.HTML()
        self.info.add_class("wb-inspector-info")
        for control in (self.which, self.size_k, self.size_n):
            control.observe(self._on_map, names="value")
        self.index.observe(lambda change: self.refresh(), names="value")
        self.widget = widgets.VBox([widgets.HBox([self.which, self.size_k, self.size_n]), self.index, self.info,
                                    self.image])
        self.widget.add_class("wb-index-inspector")
        self._on_map(None)

    def _domain(self) -> int:
        return self._domain_of(self.which.value, self.size_k.value, self.size_n.value)

    @staticmethod
    def _domain_of(which: str, size_k: int, size_n: int) -> int:
        if which.startswith("scale P64"):
            return SCALE_PERM_64.size
        if which.startswith("scale P32"):
            return SCALE_PERM_32.size
        if which == "block-FP8 word sources":
            return size_k // mt.TILE_K * 4 * size_n
        return size_k // rfp8.f8.BLOCK * size_n

    def _on_map(self, change) -> None:
        self.index.max = self._domain() - 1
        self.index.value = min(self.index.value, self.index.max)
        fp8_map = not self.which.value.startswith("scale")  # K and N only change the FP8 maps
        for control in (self.size_k, self.size_n):
            control.layout.display = None if fp8_map else "none"
        self.refresh()

    def summary(self) -> str:
        return (f"Index-map inspector: {self.which.value}, destination {self.index.value} (run the notebook to use "
                "the controls)")

    def refresh(self) -> None:
        which, size_k, size_n, d = self.which.value, self.size_k.value, self.size_n.value, self.index.value
        if which.endswith("(NVFP4, MX)"):
            permuted, shuffled = rtile.microscale_scale_chunk()
            fig = rtile.render_microscale_scale_shuffle(d)
            src = int(shuffled[d])
            rows = [("destination d", d), ("checkpoint column", src),
                    ("P64 put it at", int(np.flatnonzero(permuted == src)[0])),
                    ("P64 alone would leave there", int(permuted[d]))]
        elif which.startswith("scale"):
            width = 64 if "P64" in which else 32
            perm = rscales.PERMS[width]
            fig = rscales.render_scale_permutation(width, d)
            rows = [("destination d", d), ("source P[d]", int(perm[d]))]
        elif which == "block-FP8 word sources":
            src = rfp8.f8.block_fp8_word_sources(d, size_k, size_n)
            fig = rfp8.render_block_fp8_word(size_k, size_n, d)
            rows = [("Marlin word", d)] + [(f"byte {j}", f"row-major flat {int(s)} = [n={int(s) // size_k}, "
                                                         f"k={int(s) % size_k}]") for j, s in enumerate(src)]
        else:
            src = int(rfp8.f8.block_fp8_scale_sources(d, size_k, size_n))
            fig = rfp8.render_block_fp8_scale_map(size_k, size_n, d)
            groups = size_k // rfp8.f8.BLOCK
            rows = [("Marlin scale", f"[{d // size_n}, {d % size_n}]"),
                    ("inverse_scales", f"flat {src} = [{src // groups}, {src % groups}]")]
        self.info.value = TABLE_STYLE + html_table(["", "value"], rows, caption=which, css_class="wb-inspector")
        show_figure(self.image, fig, self.dpi)

    def _ipython_display_(self):
        _display_widget(self.widget, self.summary())


def index_map_inspector(**kwargs) -> IndexMapInspector:
    return IndexMapInspector(**kwargs)
