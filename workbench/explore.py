"""The layout explorer on a layer of a real checkpoint, and ``workbench explore CKPT --layer NAME``, which writes a
notebook that opens it (``jupyter lab explore.ipynb``).

``layer_explorer(path, layer)`` is ``workbench.explorer.LayoutExplorer`` set to the layer's format, K, N and group
size, with one more table: for the selected element, the 32-bit word of the checkpoint's Marlin ``qweight`` that
holds it, the code in its field, the same code read back through ``ops.marlin_to_codes`` (they must agree), and its
scale. The explorer draws layers up to its largest K and N (``workbench.explorer.K_CHOICES`` / ``N_CHOICES``);
``workbench example-checkpoint`` writes layers that fit.
"""
from __future__ import annotations

import os

import numpy as np

# workbench.explorer (ipywidgets, matplotlib) is imported where it is used, so that the command line starts quickly
DEFAULT_NOTEBOOK = "explore.ipynb"


def _choose_layer(weights: dict, layer: str | None, path) -> str:
    if layer is not None:
        if layer not in weights:
            raise ValueError(f"{path}: no quantized layer named {layer!r}; it has {', '.join(sorted(weights))}")
        return layer
    fits = [name for name, w in weights.items() if _misfit(w) is None]
    if not fits:
        from workbench.explorer import K_CHOICES, N_CHOICES

        raise ValueError(f"{path}: no layer fits the explorer (K in {K_CHOICES}, N in {N_CHOICES}, one expert)")
    return fits[0]


def _misfit(w) -> str | None:
    """Why the explorer cannot draw MarlinWeight ``w``, or None."""
    from workbench.explorer import FORMATS, GROUP_CHOICES, K_CHOICES, N_CHOICES

    if w.num_experts:
        return f"it is a stack of {w.num_experts} experts; the explorer draws one matrix"
    if w.size_k not in K_CHOICES or w.size_n not in N_CHOICES:
        return f"K x N = {w.size_k} x {w.size_n}; the explorer draws K in {K_CHOICES} and N in {N_CHOICES}"
    if w.weight_type.label not in FORMATS:
        return f"weight type {w.weight_type.label} is not one of the explorer's formats {FORMATS}"
    if w.group_size not in GROUP_CHOICES:
        return f"group size {w.group_size} is not one of the explorer's {GROUP_CHOICES}"
    return None


class LayerExplorer:
    """The layout explorer on one layer of a checkpoint, with the selected element's stored word and code."""

    def __init__(self, path, layer: str | None = None, k: int = 5, n: int = 70, dpi: int = 72):
        import ipywidgets as widgets

        from workbench import load, ops
        from workbench.explorer import LayoutExplorer

        weights = load(path)
        self.path, self.layer = os.fspath(path), _choose_layer(weights, layer, path)
        w = self.weight = weights[self.layer]
        why = _misfit(w)
        if why:
            raise ValueError(f"{self.path}: layer {self.layer!r} cannot be drawn: {why}")
        bits = w.weight_type.bits
        self.codes = ops.marlin_to_codes(w.qweight, w.size_k, w.size_n, bits)  # (K, N) uint8, Marlin row order
        self.scales = ops.marlin_unpermute_scales(w.scales, w.size_k, w.size_n, w.group_size)  # (ng, N)
        self.explorer = LayoutExplorer(fmt=w.weight_type.label, size_k=w.size_k, size_n=w.size_n,
                                       group_size=w.group_size, k=min(k, w.size_k - 1), n=min(n, w.size_n - 1),
                                       dpi=dpi)
        for control in (self.explorer.fmt, self.explorer.size_k, self.explorer.size_n, self.explorer.group_size):
            control.disabled = True  # fixed by the checkpoint
        self.stored = widgets.HTML()
        self.stored.add_class("wb-layer-stored")
        for control in (self.explorer.k, self.explorer.n):
            control.observe(lambda change: self.refresh(), names="value")
        title = widgets.HTML(f"<b>{self.layer}</b> of <code>{self.path}</code>: {w.weight_type.label},"
                             f" K x N = {w.size_k} x {w.size_n}, group size {w.group_size}")
        self.widget = widgets.VBox([title, self.stored, self.explorer.widget])
        self.widget.add_class("wb-layer-explorer")
        self.refresh()

    def element(self, k: int, n: int) -> dict:
        """What the checkpoint stores for element (k, n): word index, word, field, code (two ways), scale."""
        from workbench.formats import marlin_tile as mt

        w = self.weight
        bits = w.weight_type.bits
        word, field = (int(x) for x in mt.marlin_kn_to_word_field(k, n, w.size_n, bits))
        value = int(np.asarray(w.qweight).reshape(-1)[word]) & 0xFFFFFFFF
        if w.g_idx is not None:  # act-order: the group of Marlin row k (rows are sorted by group)
            group = int(w.g_idx[k])
        else:
            group = 0 if w.group_size == -1 else k // w.group_size
        field_code = (value >> (bits * field)) & ((1 << bits) - 1)  # field f holds bits [f*bits, (f+1)*bits)
        return {"word": word, "value": value, "field": field, "field_code": field_code,
                "code": int(self.codes[k, n]), "group": group, "scale": float(self.scales[group, n])}

    def refresh(self) -> None:
        from workbench.render._draw import html_table

        k, n = self.explorer.k.value, self.explorer.n.value
        e = self.element(k, n)
        rows = [("word", f"{e['word']} = 0x{e['value']:08x}"), ("field", e["field"]),
                ("code in the field", e["field_code"]), ("code via ops.marlin_to_codes", e["code"]),
                ("scale", f"{e['scale']:.6g} (group {e['group']}, column {n})")]
        if self.weight.perm is not None:
            rows.append(("checkpoint row", int(self.weight.perm[k])))
        self.stored.value = html_table(["stored in the checkpoint", f"(k={k}, n={n})"], rows,
                                       caption=self.layer, css_class="wb-stored")

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget)


def layer_explorer(path, layer: str | None = None, **kwargs) -> LayerExplorer:
    return LayerExplorer(path, layer, **kwargs)


def write_notebook(path, layer: str | None, notebook) -> str:
    """Write a notebook that opens ``layer_explorer(path, layer)``; returns the layer shown."""
    try:
        import nbformat
    except ImportError:
        raise ValueError("writing the explorer notebook needs nbformat, which JupyterLab brings:"
                         " pip install -e \".[notebook]\"") from None
    from workbench import load

    weights = load(path)
    layer = _choose_layer(weights, layer, path)
    why = _misfit(weights[layer])
    if why:
        raise ValueError(f"{path}: layer {layer!r} cannot be drawn: {why}")
    root = os.path.abspath(os.fspath(path))
    nb = nbformat.v4.new_notebook()
    # without a kernelspec JupyterLab asks which kernel to start instead of starting one
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [
        nbformat.v4.new_markdown_cell(
            f"# `{layer}`\n\nThe layout explorer on this layer of `{root}`. Move **k / n** (a weight element) or"
            " **word / field** (a packed position): the picture shows where the element sits in the Marlin tiles,"
            " and the first table shows the word this checkpoint stores there and the code in its field."),
        nbformat.v4.new_code_cell(f"from workbench.explore import layer_explorer\n\n"
                                  f"explorer = layer_explorer({root!r}, {layer!r})\nexplorer"),
    ]
    nbformat.write(nb, os.fspath(notebook))
    return layer


def _command(args) -> int:
    layer = write_notebook(args.path, args.layer, args.notebook)
    print(f"wrote {args.notebook}: the layout explorer on {layer}")
    print(f"open it with: jupyter lab {args.notebook}")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "explore", help="write a notebook that opens the layout explorer on a checkpoint's layer",
        description="Write a Jupyter notebook that opens the layout explorer on one quantized layer of a checkpoint"
                    " (Marlin, or any source format, converted in memory), then open it with `jupyter lab NOTEBOOK`."
                    " The explorer draws small layers, such as those `workbench example-checkpoint` writes; for a"
                    " larger one the error names the sizes it can draw.")
    p.add_argument("path", help="checkpoint directory")
    p.add_argument("--layer", default=None, help="layer name (default: the first one the explorer can draw)")
    p.add_argument("--notebook", default=DEFAULT_NOTEBOOK, help=f"notebook to write (default {DEFAULT_NOTEBOOK})")
    p.set_defaults(func=_command)
