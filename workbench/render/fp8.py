"""Pictures of the FP8 formats (``formats.fp8``): the bit move and its 2^8 factor, block-FP8's direct gathers."""
from __future__ import annotations

import numpy as np

from workbench.formats import fp8 as f8
from workbench.formats.marlin_tile import TILE_K, TILE_N, words_per_tile
from workbench.render._draw import HTML, draw_grid, hex_word, html_table, new_figure, outline, separators


def fp8_code_table() -> dict[str, np.ndarray]:
    """All 256 E4M3 bytes: true value, the kernel's bit-moved fp16, and the ratio (NaN codes 0x7F/0xFF excluded)."""
    raw = np.arange(256, dtype=np.uint8)
    true = f8.e4m3_to_float32(raw)
    moved = f8.kernel_bit_move_f16(raw).astype(np.float32)
    finite = np.isfinite(true)
    return {"raw": raw[finite], "true": true[finite], "moved": moved[finite]}


def render_fp8_bit_move():
    """True E4M3 value against the bit-moved fp16 value: a straight line of slope 2^-8 through all 254 finite codes."""
    t = fp8_code_table()
    bias = f8.FP8_EXPONENT_BIAS[f8.F16]
    fig, (ax_v, ax_r) = new_figure(10, 3.4, ncols=2)
    for sign, marker, name in ((1, "o", "positive codes"), (-1, "x", "negative codes (|value|)")):
        pick = np.sign(t["true"]) == sign
        ax_v.scatter(np.abs(t["true"][pick]), np.abs(t["moved"][pick]), s=8, marker=marker, label=name)
    ax_v.set_xscale("log", base=2)  # log-log of |value|: the bit move is a straight line, zero is left out
    ax_v.set_yscale("log", base=2)
    ax_v.set_xlabel("|true E4M3 value|")
    ax_v.set_ylabel("|fp16 after the bit move|")
    ax_v.set_title("(b & 0x80) << 8 | (b & 0x7F) << 7: every point on value × 2^-8", fontsize=9)
    ax_v.legend(fontsize=7, loc="upper left")
    nonzero = t["true"] != 0
    ax_r.plot(t["raw"][nonzero], t["true"][nonzero] / t["moved"][nonzero], ".", markersize=4)
    ax_r.set_ylim(0, 1.25 * bias)  # from zero, so a constant looks constant
    ax_r.set_xticks([0, 64, 128, 192, 255], ["0x00", "0x40", "0x80", "0xc0", "0xff"])
    ax_r.set_xlabel("E4M3 byte")
    ax_r.set_ylabel("true / moved")
    ax_r.set_title(f"ratio is {bias:g} = 2^(15-7) for every finite nonzero code,\nsubnormals included", fontsize=9)
    return fig


def fp8_examples_html(raws=(0x01, 0x08, 0x38, 0x40, 0x7E, 0xB8, 0xFE)) -> HTML:
    raw = np.asarray(raws, dtype=np.uint8)
    true = f8.e4m3_to_float32(raw)
    moved = f8.kernel_bit_move_f16(raw)
    rows = [(f"0x{int(r):02x}", f"{float(v):g}", f"0x{int(m.view(np.uint16)):04x}", f"{float(m):g}",
             f"{float(m) * f8.FP8_EXPONENT_BIAS[f8.F16]:g}") for r, v, m in zip(raw, true, moved)]
    return HTML(html_table(["E4M3 byte", "value", "moved fp16 bits", "moved value", "× 2^8"], rows,
                           caption="the kernel's bit move loses exactly 2^8 (fp16; 2^120 for bf16)"))


def render_block_fp8_word(size_k: int, size_n: int, word: int):
    """Row-major E4M3 [N, K] with the 4 bytes of Marlin word ``word`` (the direct gather) and the 128×128 blocks."""
    f8.check_block_fp8_shapes(size_k, size_n)
    total = size_k // TILE_K * 4 * size_n
    if not 0 <= int(word) < total:
        raise ValueError(f"word = {word} is outside the {total} words of a K={size_k}, N={size_n} FP8 weight")
    sources = f8.block_fp8_word_sources(int(word), size_k, size_n)  # (4,) flat indices into [N, K]
    n_of, k_of = np.divmod(sources, size_k)
    tile = int(word) // words_per_tile(8)
    k_tile, n_tile = divmod(tile, size_n // TILE_N)
    block = (np.arange(size_n)[:, None] // f8.BLOCK) * (size_k // f8.BLOCK) + np.arange(size_k)[None, :] // f8.BLOCK
    fig, (ax, ax_zoom) = new_figure(12, 5.2, ncols=2, width_ratios=[2, 1])
    draw_grid(ax, block, count=int(block.max()) + 1, cmap="Pastel1")
    ax.set_aspect("auto")
    separators(ax, f8.BLOCK, f8.BLOCK, block.shape, color="black", linewidth=1.5)
    outline(ax, n_tile * TILE_N, k_tile * TILE_K, TILE_N, TILE_K, color="#1f77b4", linewidth=1.5)
    for n, k in zip(n_of, k_of):
        outline(ax, int(n), int(k), fill=True)
    ax.set_title("row-major [N, K] E4M3; colours: 128×128 scale blocks; blue: the word's Marlin tile", fontsize=9)
    ax.set_xlabel("k (row-major column)")
    ax.set_ylabel("n (row-major row)")
    # zoom: the 8 rows n of the word's 16×8 fragment, all 16 k of its tile, as the checkpoint stores them
    n_first = int(n_of[0]) - int(n_of[0]) % 8
    k0 = k_tile * TILE_K
    zoom = np.zeros((8, TILE_K), dtype=np.int64)
    labels = np.full((8, TILE_K), "", dtype=object)
    for byte, (n, k) in enumerate(zip(n_of, k_of)):
        zoom[int(n) - n_first, int(k) - k0] = 1
        labels[int(n) - n_first, int(k) - k0] = f"b{byte}"
    draw_grid(ax_zoom, zoom, count=2, cmap="Paired", labels=labels, fontsize=8)
    ax_zoom.set_xticks(range(0, TILE_K, 2))
    ax_zoom.set_xticklabels([str(k0 + t) for t in range(0, TILE_K, 2)])
    ax_zoom.set_yticks(range(8))
    ax_zoom.set_yticklabels([str(n_first + t) for t in range(8)])
    ax_zoom.set_title(f"zoom: rows n {n_first}..{n_first + 7}, k {k0}..{k0 + 15}\n(tile k_tile {k_tile}, "
                      f"n_tile {n_tile}); bytes b0..b3, low byte first", fontsize=8)
    ax_zoom.set_xlabel("k")
    ax_zoom.set_ylabel("n")
    fig.suptitle(f"Marlin word {word} gathers [n, k] = {[(int(n), int(k)) for n, k in zip(n_of, k_of)]}", fontsize=10)
    return fig


def render_block_fp8_scale_map(size_k: int, size_n: int, selected: int | None = None):
    """Destination index over Marlin scales [K/128, N] -> source index into inverse_scales [ceil(N/128), K/128]."""
    f8.check_block_fp8_shapes(size_k, size_n)
    groups = size_k // f8.BLOCK
    dest = np.arange(groups * size_n)
    src = f8.block_fp8_scale_sources(dest, size_k, size_n).reshape(groups, size_n)
    width_in = min(18, 2 + size_n / 16)
    fig, (ax,) = new_figure(width_in, 1.6 + 0.5 * groups)
    readable = (width_in - 1.5) / size_n >= 0.22  # inches per cell that a 6-pt, 3-digit label needs
    draw_grid(ax, src, count=int(src.max()) + 1, cmap="tab20", labels=src if readable else None, fontsize=6)
    ax.set_aspect("auto")
    width = 32 if groups == 1 else 64
    separators(ax, None, width, src.shape, color="black", linewidth=1.5)
    ax.set_title(f"Marlin scale [g, d] takes inverse_scales.flat[·] (K={size_k}, N={size_n}: P{width}, "
                 f"{groups} group{'s' if groups > 1 else ''} of 128)", fontsize=9)
    ax.set_xlabel("Marlin column d")
    ax.set_ylabel("group g")
    if selected is not None:
        if not 0 <= int(selected) < dest.size:
            raise ValueError(f"selected = {selected} is outside the {dest.size} Marlin scales")
        outline(ax, *divmod(int(selected), size_n))
    return fig


def gate_up_tiles(size_k: int, n_gate: int) -> np.ndarray:
    """(K/16, 2N/64) which projection (0 gate, 1 up) every Marlin tile of the fused [2N, K] weight came from."""
    size_n = 2 * n_gate
    f8.check_block_fp8_shapes(size_k, size_n)
    first_words = np.arange(size_k // TILE_K * (size_n // TILE_N)) * words_per_tile(8)
    n = f8.block_fp8_word_sources(first_words, size_k, size_n)[:, 0] // size_k
    return (n // n_gate).reshape(size_k // TILE_K, size_n // TILE_N)


def render_gate_up_fusion(size_k: int, n_gate: int):
    """Gate and up concatenated along N before tiling: the first N/64 tile columns are gate, the rest up."""
    origin = gate_up_tiles(size_k, n_gate)
    labels = np.where(origin == 0, "gate", "up")
    fig, (ax,) = new_figure(2 + 0.9 * origin.shape[1], 1.2 + 0.22 * origin.shape[0])
    draw_grid(ax, origin, count=2, cmap="Set1", labels=labels, fontsize=8)
    ax.set_aspect("auto")
    ax.set_title(f"fused w13 [2N={2 * n_gate}, K={size_k}] in Marlin tiles: which projection each tile holds",
                 fontsize=9)
    ax.set_xlabel("n_tile (64 columns)")
    ax.set_ylabel("k_tile (16 rows)")
    return fig


def block_scales_html(inverse_scales: np.ndarray, marlin_scales: np.ndarray, columns: int = 8) -> HTML:
    """Side by side: the first Marlin scale entries and the inverse scale each came from."""
    inv = np.asarray(inverse_scales, dtype=np.float32)
    ms = np.asarray(marlin_scales)
    size_k = inv.shape[1] * f8.BLOCK
    size_n = ms.shape[1]
    rows = []
    for d in range(columns):
        src = int(f8.block_fp8_scale_sources(d, size_k, size_n))
        rows.append((f"[0, {d}]", f"inv.flat[{src}] = {inv.reshape(-1)[src]:.6g}", f"{float(ms[0, d]):.6g}",
                     f"{float(ms[0, d]) / float(inv.reshape(-1)[src]):g}"))
    return HTML(html_table(["Marlin scale", "source", "value", "ratio"], rows,
                           caption=f"block-FP8 scales, {ms.dtype}: value = inverse scale × 2^8"))
