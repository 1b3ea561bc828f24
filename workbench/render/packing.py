"""Pictures of checkpoint packing (GPTQ rows, column packing, AWQ's interleave), drawn from ``formats.packing``.

Each picture packs an ``arange``-coded matrix — every code names its source — and unpacks the words field by field,
so what is drawn is what the packer produced, not a re-statement of it.
"""
from __future__ import annotations

import numpy as np

from workbench.formats import packing as pk
from workbench.formats import gptq
from workbench.render._draw import HTML, draw_grid, hex_word, html_table, new_figure, separators


def render_gptq_packing(bits: int = 4, size_k: int = 16, size_n: int = 8):
    """GPTQ qweight [K/pf, N]: which word row and which field every (k, n) lands in (packs along K)."""
    pf = pk.pack_factor(bits)
    if size_k > (1 << bits):
        raise ValueError(f"size_k = {size_k} exceeds the {1 << bits} distinct {bits}-bit codes this picture needs")
    # every column holds distinct codes, so a packed value names its source row
    codes = ((np.arange(size_k)[:, None] + np.arange(size_n)[None, :]) % (1 << bits)).astype(np.uint8)
    words = pk.pack_rows(codes, bits)  # (K/pf, N)
    fields = pk._unpack_last_axis(words, bits)  # (K/pf, N, pf)
    src_row = np.empty((size_k, size_n), dtype=np.int64)
    src_field = np.empty((size_k, size_n), dtype=np.int64)
    for r in range(words.shape[0]):
        for n in range(size_n):
            for j in range(pf):
                k = int(np.flatnonzero(codes[:, n] == fields[r, n, j])[0])
                src_row[k, n] = r
                src_field[k, n] = j
    labels = np.char.add(np.char.add("w", src_row.astype(str)), np.char.add(".f", src_field.astype(str)))
    fig, (ax,) = new_figure(1.1 + 0.55 * size_n, 0.9 + 0.33 * size_k)
    draw_grid(ax, src_field, count=pf, cmap="tab10", labels=labels, fontsize=7, colorbar="field j")
    separators(ax, pf, None, codes.shape, color="black", linewidth=2)
    ax.set_title(f"GPTQ {bits}-bit qweight [K/{pf}, N]: code (k, n) -> word row k//{pf} (w), field k%{pf} (f)",
                 fontsize=9)
    ax.set_xlabel("n")
    ax.set_ylabel("k")
    return fig


def render_awq_packing(bits: int = 4, rows: int = 2, size_n: int = 16):
    """AWQ qweight [K, N/pf]: packs along N with the interleave AWQ_ORDER inside each word."""
    pf = pk.pack_factor(bits)
    codes = (np.arange(rows * size_n) % (1 << bits)).astype(np.uint8).reshape(rows, size_n)
    if size_n > (1 << bits):
        raise ValueError(f"size_n = {size_n} exceeds the {1 << bits} distinct {bits}-bit codes this picture needs")
    words = pk.awq_pack(codes, bits)
    fields = pk._unpack_last_axis(words, bits)  # (rows, N/pf, pf): field j of word (r, c)
    field_of = np.empty((rows, size_n), dtype=np.int64)
    for r in range(rows):
        for c in range(words.shape[1]):
            for j in range(pf):
                n = int(np.flatnonzero(codes[r] == fields[r, c, j])[0])  # found from the packed value
                field_of[r, n] = j
    labels = np.char.add(np.char.add("w", (np.arange(size_n) // pf).astype(str)[None, :].repeat(rows, 0)),
                         np.char.add(".f", field_of.astype(str)))
    fig, (ax,) = new_figure(1.5 + 0.6 * size_n, 1.2 + 0.5 * rows)
    draw_grid(ax, field_of, count=pf, cmap="tab10", labels=labels, fontsize=7, colorbar="field j")
    separators(ax, None, pf, codes.shape, color="black", linewidth=2)
    ax.set_title(f"AWQ {bits}-bit: column n -> word n//{pf}, field AWQ_UNDO[n%{pf}]; "
                 f"field j holds column {pk.AWQ_ORDER[bits].tolist()}[j]", fontsize=9)
    ax.set_xlabel("n")
    ax.set_ylabel("row")
    return fig


def awq_order_html(bits: int = 4) -> HTML:
    order = pk.AWQ_ORDER[bits]
    rows = [(j, f"{j * bits}..{j * bits + bits - 1}", f"c·{pk.pack_factor(bits)} + {int(order[j])}")
            for j in range(pk.pack_factor(bits))]
    return HTML(html_table(["field j", "bits", "column"], rows, caption=f"AWQ {bits}-bit field order"))


def qzeros_html(bits: int = 4) -> HTML:
    """GPTQ v1 qzeros: stored = zero − 1; the symmetric word, and what +1 does to a few stored words."""
    pf = pk.pack_factor(bits)
    sym = gptq.symmetric_stored_word(bits)
    examples = [np.full((1, pf), z, dtype=np.uint8) for z in (7 if bits == 4 else 127, 8 if bits == 4 else 136, 0)]
    rows = []
    for stored in examples:
        word = pk.pack_cols(stored, bits)
        zeros = gptq.gptq_v1_zero_points(word, bits)
        rows.append((hex_word(word[0, 0]), int(stored[0, 0]), int(zeros[0, 0]),
                     hex_word(gptq.gptq_v1_qzeros_to_v2(word, bits)[0, 0]),
                     gptq.gptq_qzeros_are_symmetric_code7(word, bits)))
    return HTML(html_table(["stored v1 word", "stored field", "zero point", "v2 word (+1)", "symmetric?"], rows,
                           caption=f"{bits}-bit GPTQ v1 qzeros (symmetric word {hex_word(sym)})"))
