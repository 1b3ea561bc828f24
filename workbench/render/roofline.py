"""Why the Marlin layout exists, in numbers and pictures: bytes a GEMM must move, the roofline it sits under, and
how many 16-byte loads one lane issues per tile in each layout.

A GEMM of M activation rows by a K×N weight does 2·M·N·K flops and must move at least the weight (with its scales
and zero points), the activations A (M×K) and the output C (M×N). At decode sizes (small M) the weight dominates the
bytes and the flops per byte are few, so the time is bytes ÷ read bandwidth: 4-bit weights with group-128 scales
are about 3.9× fewer bytes than fp16 ones, which bounds the speedup. The layout decides whether the kernel gets
there: a lane of a warp must get its operands with few, full 16-byte loads.

The measured pictures read a results document (``workbench.render.bench``); the model pictures take shapes only.
"""
from __future__ import annotations

import numpy as np
from matplotlib.patches import Rectangle

from workbench.formats import marlin_tile as mt
from workbench.formats.packing import pack_factor
from workbench.render._draw import HTML, HIGHLIGHT, OKABE_ITO, html_table, new_figure
from workbench.render.bench import OURS, group_title, is_variant
from workbench.scalar_types import ScalarType

ACT_BYTES = 2  # fp16 / bf16 activations and outputs
SCALE_BYTES = 2  # the Marlin kernels' scales are in the activation type
_DENSE = {"fp16": ScalarType.F16, "bf16": ScalarType.BF16}
LOAD_BYTES = 16  # the widest global load of one lane (cp.async / ld.global.v4)


def weight_type_of(name: str) -> ScalarType:
    """A results file's ``wtype`` (``u4b8``, ``fp16``, ...) as a ScalarType."""
    return _DENSE.get(str(name).lower()) or ScalarType.parse(name)


def weight_bytes(n: int, k: int, wtype: str, group: int | None = -1) -> int:
    """Bytes of a K×N weight in ``wtype``: the codes, plus one scale per (group, column) and, for types with zero
    points, one zero-point code per (group, column). Dense fp16/bf16 weights have neither."""
    wt = weight_type_of(wtype)
    codes = n * k * wt.bits // 8
    if wt in (ScalarType.F16, ScalarType.BF16):
        return codes
    groups = 1 if group in (None, -1) else k // int(group)
    zeros = groups * n * wt.bits // 8 if wt.has_zero_points else 0
    return codes + groups * n * SCALE_BYTES + zeros


def gemm_bytes(n: int, k: int, m: int, wtype: str, group: int | None = -1) -> int:
    """The least bytes a GEMM moves: weight (+ scales, zero points) + A (M×K) + C (M×N)."""
    return weight_bytes(n, k, wtype, group) + ACT_BYTES * m * (n + k)


def gemm_flops(n: int, k: int, m: int) -> int:
    return 2 * m * n * k


def arithmetic_intensity(n: int, k: int, m: int, wtype: str, group: int | None = -1) -> float:
    """Flops per byte moved."""
    return gemm_flops(n, k, m) / gemm_bytes(n, k, m, wtype, group)


def ideal_time_s(n, k, m, wtype, group=-1, read_gbs=None, peak_tflops=None) -> float:
    """Roofline time: the larger of bytes ÷ read bandwidth and flops ÷ peak (either term left out when not given;
    with neither, the time is in bytes and only ratios of it mean anything)."""
    memory = gemm_bytes(n, k, m, wtype, group) / (read_gbs * 1e9) if read_gbs else gemm_bytes(n, k, m, wtype, group)
    compute = gemm_flops(n, k, m) / (peak_tflops * 1e12) if (peak_tflops and read_gbs) else 0.0
    return max(memory, compute)


def ideal_speedup(n, k, m, wtype, group=-1, read_gbs=None, peak_tflops=None, over: str = "fp16") -> float:
    """How much faster a ``wtype`` GEMM can be than an ``over`` one of the same shape under the same roofline."""
    return (ideal_time_s(n, k, m, over, None, read_gbs, peak_tflops)
            / ideal_time_s(n, k, m, wtype, group, read_gbs, peak_tflops))


# ---------------------------------------------------------------------------------------------------------------
# Loads per lane, from the index maps
# ---------------------------------------------------------------------------------------------------------------
LAYOUTS = ("gptq", "awq", "marlin")
LAYOUT_NAMES = {"gptq": "GPTQ rows [K/pf, N]", "awq": "AWQ columns [K, N/pf]",
                "marlin": "Marlin tiles [K/16, N·16/pf]"}


def lane_elements(lane: int) -> tuple[np.ndarray, np.ndarray]:
    """(k, n) inside one 16×64 tile of every weight element lane ``lane`` feeds to ``mma.m16n8k16`` as B: 4 elements
    of each of the tile's 8 16×8 fragments (sub-block w, half h: columns 16w + 8h ..)."""
    warp, half, e = np.meshgrid(np.arange(4), np.arange(2), np.arange(4), indexing="ij")
    dk, dn = mt.mma_b_fragment(lane, e.ravel())
    return dk, mt.subblock_column(warp.ravel(), half.ravel()) + dn


def element_byte(layout: str, k, n, bits: int, size_n: int = mt.TILE_N):
    """Byte offset of the 32-bit word that holds element (k, n) of a K×``size_n`` weight in ``layout``."""
    pf = pack_factor(bits)
    k, n = np.asarray(k), np.asarray(n)
    if layout == "gptq":  # word (k // pf, n) of a [K/pf, N] tensor
        word = (k // pf) * size_n + n
    elif layout == "awq":  # word (k, n // pf) of a [K, N/pf] tensor
        word = k * (size_n // pf) + n // pf
    elif layout == "marlin":
        word = mt.marlin_kn_to_word_field(k, n, size_n, bits)[0]
    else:
        raise ValueError(f"unknown layout {layout!r}; expected one of {', '.join(LAYOUTS)}")
    return 4 * word


def lane_loads(layout: str, bits: int, lane: int) -> np.ndarray:
    """The 16-byte-aligned segments (their first bytes) lane ``lane`` must read to get its B elements of one tile:
    each is one 16-byte load, the widest a lane issues."""
    k, n = lane_elements(lane)
    return np.unique(element_byte(layout, k, n, bits) // LOAD_BYTES * LOAD_BYTES)


def load_counts(bits: int) -> dict[str, np.ndarray]:
    """Layout -> (32,) 16-byte loads per lane for one 16×64 tile."""
    return {layout: np.array([lane_loads(layout, bits, lane).size for lane in range(mt.LANES)]) for layout in LAYOUTS}


def load_table_html(bit_widths=(4, 8)) -> HTML:
    rows = []
    for bits in bit_widths:
        need = 32 * bits // 8  # 32 codes of the tile per lane
        for layout, counts in load_counts(bits).items():
            loaded = int(counts.max()) * LOAD_BYTES
            rows.append((f"{bits}-bit", LAYOUT_NAMES[layout], int(counts.max()), need, f"{100 * need / loaded:.1f}%"))
    return HTML(html_table(["codes", "layout", "16-byte loads per lane per tile", "bytes the lane uses",
                            "share of loaded bytes used"], rows,
                           caption="one lane, one 16×64 tile: the loads its B fragments need"))


def render_lane_loads(bits: int = 4, lane: int = 0):
    """Lane ``lane``'s words of one 16×64 tile in each layout's memory order (one row of 16 words per 64 bytes),
    the lane's 16-byte loads outlined; beside it the load count of every lane."""
    fig, axes = new_figure(11.0, 3.4, ncols=len(LAYOUTS) + 1, width_ratios=[1] * len(LAYOUTS) + [1.2])
    words_per_row = 4 * LOAD_BYTES // 4  # 64 bytes a row: four loads
    for ax, layout in zip(axes, LAYOUTS):
        k, n = np.meshgrid(np.arange(mt.TILE_K), np.arange(mt.TILE_N), indexing="ij")
        tile_words = np.unique(element_byte(layout, k, n, bits) // 4)
        k_l, n_l = lane_elements(lane)
        mine = np.isin(tile_words, element_byte(layout, k_l, n_l, bits) // 4)
        rows = -(-tile_words.size // words_per_row)
        grid = np.full(rows * words_per_row, np.nan)
        grid[:tile_words.size] = mine
        ax.imshow(grid.reshape(rows, words_per_row), cmap="Greys", vmin=0, vmax=1.6, interpolation="nearest",
                  aspect="auto")
        position = {int(w): i for i, w in enumerate(tile_words)}
        for segment in lane_loads(layout, bits, lane):
            if int(segment // 4) in position:  # a segment's first word may hold no element of this tile
                r, c = divmod(position[int(segment // 4)], words_per_row)
                ax.add_patch(Rectangle((c - 0.5, r - 0.5), LOAD_BYTES // 4, 1, fill=False, edgecolor=HIGHLIGHT,
                                       linewidth=1.5))
        ax.set_title(f"{LAYOUT_NAMES[layout]}\nlane {lane}: {lane_loads(layout, bits, lane).size} loads", fontsize=8)
        ax.set_xlabel("word in a 64-byte row")
        ax.set_ylabel("64-byte row of the tile's words")
        ax.set_xticks([0, 4, 8, 12])
        ax.set_yticks([])
    ax = axes[-1]
    x = np.arange(len(LAYOUTS))
    for offset, width, color in ((-0.2, 4, OKABE_ITO[4]), (0.2, 8, OKABE_ITO[5])):
        counts = load_counts(width)
        heights = [int(counts[layout].max()) for layout in LAYOUTS]  # the most any lane issues
        ax.bar(x + offset, heights, width=0.4, color=color, label=f"{width}-bit codes")
        for xi, h in zip(x + offset, heights):
            ax.text(xi, h + 0.3, str(h), ha="center", fontsize=7)
    ax.set_xticks(x, [LAYOUT_NAMES[layout].split(" [")[0] for layout in LAYOUTS])
    ax.set_ylabel("16-byte loads per lane per tile")
    ax.set_title("the most loads any lane of the warp issues", fontsize=8)
    ax.legend(fontsize=7)
    return fig


# ---------------------------------------------------------------------------------------------------------------
# The model: bytes and ideal speedup against M (shapes only)
# ---------------------------------------------------------------------------------------------------------------
MODEL_FORMATS = (("fp16", None), ("u8b128", 128), ("u4b8", 128))


def render_traffic_model(n: int = 4096, k: int = 4096, ms=(1, 2, 4, 8, 16, 32, 64, 128, 256), formats=MODEL_FORMATS):
    """Left: flops per byte against M for each format (the x axis of a roofline). Right: the memory-bound speedup
    over fp16 (fp16 bytes ÷ the format's bytes): near 4× for 4-bit at M = 1, falling as A and C grow."""
    fig, (left, right) = new_figure(9.0, 3.2, ncols=2)
    ms = np.asarray(ms)
    for (wtype, group), color in zip(formats, OKABE_ITO[4:] + OKABE_ITO):
        label = wtype if group is None else f"{wtype} g{group}"
        left.plot(ms, [arithmetic_intensity(n, k, int(m), wtype, group) for m in ms], "o-", color=color,
                  markersize=3, label=label)
        if wtype != "fp16":
            right.plot(ms, [ideal_speedup(n, k, int(m), wtype, group) for m in ms], "o-", color=color, markersize=3,
                       label=label)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ms, [str(m) for m in ms])
        ax.set_xlabel("M (rows of activations)")
        ax.legend(fontsize=7)
    left.set_yscale("log")
    left.set_ylabel("flops per byte moved")
    left.set_title(f"arithmetic intensity, K × N = {k} × {n}", fontsize=9)
    right.axhline(4.0, color="black", linestyle=":", linewidth=1)
    right.set_ylabel("fp16 bytes ÷ bytes (ideal speedup)")
    right.set_title("memory-bound speedup over fp16", fontsize=9)
    return fig


# ---------------------------------------------------------------------------------------------------------------
# The measured roofline
# ---------------------------------------------------------------------------------------------------------------
def roofline_points(doc: dict, launch: str = "graph") -> list[dict]:
    """One point per GEMM row timed with ``launch`` (variants of ours left out): its method, format, flops per byte
    and achieved TFLOP/s. The bytes are the row's own (``gbs`` × time: what the cell must move)."""
    points = []
    for r in doc["rows"]:
        if r.get("launch", launch) != launch or is_variant(r):
            continue
        seconds = float(r["us"]) * 1e-6
        moved = float(r["gbs"]) * 1e9 * seconds
        flops = gemm_flops(r["n"], r["k"], r["m"])
        points.append({"method": r["method"], "wtype": r["wtype"], "m": r["m"], "layer": r["layer"],
                       "intensity": flops / moved, "tflops": flops / seconds / 1e12})
    return points


OURS_COLOR = OKABE_ITO[5]  # vermilion
PEER_COLORS = [OKABE_ITO[i] for i in (4, 2, 6, 0, 1, 7)]  # no yellow: it vanishes on white


def render_roofline(doc: dict, launch: str = "graph"):
    """Every GEMM cell of a results document under the roofs measured in the same run: the streaming-read ceiling
    (bytes/s × flops/byte) and the tensor peaks (mma.sync and cuBLAS fp16). One colour per method; the distance
    below the slanted roof is what a kernel leaves on the table at small M."""
    ceilings = doc["meta"]["ceilings"]
    points = roofline_points(doc, launch)
    fig, (ax,) = new_figure(7.0, 4.2)
    if not points:
        ax.text(0.5, 0.5, f"no {launch}-launch GEMM rows in this file", ha="center", va="center")
        ax.axis("off")
        return fig
    x = np.array([p["intensity"] for p in points])
    lo, hi = x.min() / 1.5, x.max() * 1.5
    xs = np.geomspace(lo, hi, 64)
    peaks = [(name, ceilings[key]) for name, key in (("mma.sync peak", "mma_tflops"), ("cuBLAS peak", "cublas_tflops"))
             if ceilings.get(key)]
    top = max([p for _, p in peaks], default=np.inf)
    ax.plot(xs, np.minimum(ceilings["read_gbs"] * 1e9 * xs / 1e12, top), color="black", linewidth=1.2,
            label=f"streaming read {ceilings['read_gbs']:.0f} GB/s")
    for (name, peak), style in zip(peaks, ("--", ":")):
        ax.axhline(peak, color="black", linestyle=style, linewidth=1, label=f"{name} {peak:.0f} TFLOP/s")
    peers = [m for m in dict.fromkeys(p["method"] for p in points) if m != OURS]
    for method, color in [*zip(peers, PEER_COLORS * 2), (OURS, OURS_COLOR)]:  # ours drawn last, on top
        mine = [p for p in points if p["method"] == method]
        if mine:
            ax.scatter([p["intensity"] for p in mine], [p["tflops"] for p in mine], s=14 if method == OURS else 10,
                       color=color, label=method, marker="o" if method == OURS else "s", alpha=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("flops per byte moved (each cell's own bytes)")
    ax.set_ylabel("TFLOP/s achieved")
    ax.set_title(f"{doc['meta']['gpu']}: every GEMM cell ({launch} launches) under the measured roofs", fontsize=9)
    ax.legend(fontsize=6, loc="upper left")
    return fig


def speedup_points(doc: dict, wtype: str = "u4b8", group: int = 128, act: str = "fp16", launch: str = "graph",
                   baseline: str = "cublas") -> list[dict]:
    """Per layer and M: ours (``wtype``/``group``/``act``) against the baseline's time with the same launch, and the
    roofline's ideal for the same cell under the ceilings of the run (the read bandwidth; cuBLAS's peak for fp16,
    mma.sync's for ours where the run measured it, else cuBLAS's too)."""
    c = doc["meta"]["ceilings"]
    base = {(r["layer"], r["m"]): r for r in doc["rows"] if r["method"] == baseline and r.get("launch") == launch}
    out = []
    for r in doc["rows"]:
        if (r["method"], r["wtype"], r["group"], r["act"], r["launch"]) != ("ours", wtype, group, act, launch) \
                or is_variant(r):
            continue
        b = base.get((r["layer"], r["m"]))
        if b is None:
            continue
        fp16 = ideal_time_s(r["n"], r["k"], r["m"], "fp16", None, c["read_gbs"], c.get("cublas_tflops"))
        quant = ideal_time_s(r["n"], r["k"], r["m"], wtype, group, c["read_gbs"],
                             c.get("mma_tflops") or c.get("cublas_tflops"))
        out.append({"layer": r["layer"], "k": r["k"], "n": r["n"], "m": r["m"],
                    "measured": float(b["us"]) / float(r["us"]), "ideal": fp16 / quant})
    return sorted(out, key=lambda p: (p["k"] * p["n"], p["layer"], p["m"]))


def render_speedup_vs_ideal(doc: dict, **select):
    """Measured speedup of ours over cuBLAS fp16 against M, one panel per layer, beside the roofline's ideal."""
    points = speedup_points(doc, **select)
    layers = list(dict.fromkeys((p["layer"], p["k"], p["n"]) for p in points))
    fig, axes = new_figure(3.3 * max(1, min(3, len(layers))), 2.8 * max(1, -(-len(layers) // 3)),
                           ncols=max(1, min(3, len(layers))), nrows=max(1, -(-len(layers) // 3)), sharey=True)
    if not layers:
        axes[0].text(0.5, 0.5, "no cells of ours with a cuBLAS row beside them", ha="center", va="center")
        axes[0].axis("off")
        return fig
    for ax, (layer, k, n) in zip(axes, layers):
        mine = [p for p in points if p["layer"] == layer]
        ms = [p["m"] for p in mine]
        ax.plot(ms, [p["ideal"] for p in mine], "--", color="black", linewidth=1, label="roofline ideal")
        ax.plot(ms, [p["measured"] for p in mine], "o-", color=OURS_COLOR, markersize=3, label="measured")
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(ms, [str(m) for m in ms], fontsize=6)
        ax.set_title(group_title("gemm", {"layer": layer, "k": k, "n": n}), fontsize=8)
        ax.set_xlabel("M")
    axes[0].set_ylabel("× over cuBLAS fp16")
    axes[0].legend(fontsize=6)
    for ax in axes[len(layers):]:
        ax.axis("off")
    return fig
