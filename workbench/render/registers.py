"""Pictures of the last step: a word becoming B registers bit by bit, and the warp's view of one pipeline stage.

Lanes are coloured by ``_draw.lane_colors`` (hue = lane // 4, lightness = lane % 4) and every lane cell also
carries its number.
"""
from __future__ import annotations

import numpy as np
from matplotlib.colors import to_rgb

from workbench.formats import register_dequant as rd
from workbench.formats import warp_stage as ws
from workbench.formats.marlin_tile import LANES, words_per_lane
from workbench.render._draw import HTML, hex_word, html_table, lane_colors, new_figure, separators, text_color
from workbench.scalar_types import ScalarType


def _lane_grid(ax, lanes: np.ndarray, labels: np.ndarray, fontsize: float = 6.5) -> None:
    colors = lane_colors()
    ax.imshow(colors[lanes], interpolation="nearest", aspect="auto")
    for (r, c), text in np.ndenumerate(labels):
        ax.text(c, r, text, ha="center", va="center", fontsize=fontsize, color=text_color(colors[lanes[r, c]]))


# ---------------------------------------------------------------------------------------------------------------
# A word, bit by bit
# ---------------------------------------------------------------------------------------------------------------
FIELD_COLORS = ["#E69F00", "#56B4E9", "#009E73", "#F0E442", "#0072B2", "#D55E00", "#CC79A7", "#999999"]


def dequant_steps(word, weight_type, act_dtype=np.float16, scale=1.0, zero=None, h: int = 0):
    """The named intermediate registers of ``dequant_subblock`` for one word (4-bit) or word pair (8-bit, FP8) and
    column half h: a list of (name, uint32 value)."""
    wt = ScalarType.parse(weight_type)
    words = np.atleast_1d(np.asarray(word, dtype=np.int64)).astype(np.uint32)
    if words.size != rd.words_per_subblock(wt):
        raise ValueError(f"{wt} takes {rd.words_per_subblock(wt)} word(s) per sub-block, got {words.size}")
    steps = []
    zeros = None if zero is None else np.array([zero, zero])
    rd.dequant_subblock(words[None, :], wt, act_dtype, np.full((1, 2), scale, dtype=act_dtype), zeros, steps=steps)
    return [(name, int(np.asarray(v).ravel()[0])) for hh, name, v in steps if hh == h]


def dequant_steps_html(word, weight_type, act_dtype=np.float16, scale=1.0, zero=None, h: int = 0) -> HTML:
    """The steps as a table: register in hex, and its two 16-bit halves read as act_dtype (the carrier for the
    integer steps: fp16, or bf16 for 4-bit codes with bf16 activations)."""
    wt = ScalarType.parse(weight_type)
    carrier = rd.BF16 if rd.carries_in_bf16(wt, act_dtype) else rd.F16
    rows = []
    for name, value in dequant_steps(word, wt, act_dtype, scale, zero, h):
        final = name.startswith("b[") or wt is ScalarType.FE4M3FN
        dtype = np.dtype(act_dtype) if final else carrier
        lo, hi = rd.halves(np.uint32(value), dtype)
        if name.startswith("word"):  # raw codes, not numbers
            rows.append((name, hex_word(value), "", "", "codes"))
        else:
            rows.append((name, hex_word(value), f"{float(lo):g}", f"{float(hi):g}", str(dtype)))
    return HTML(html_table(["step", "register", "low half", "high half", "read as"], rows,
                           caption=f"{wt} word(s) {', '.join(hex_word(w) for w in np.atleast_1d(word))}, column half "
                                   f"{h}, scale {scale:g}" + ("" if zero is None else f", zero {zero}")))


def _carried_bits(wt: ScalarType, h: int) -> dict[str, tuple[int, int]]:
    """Step name -> (mask of the result bits that carry code bits, how far up the word they came from)."""
    if wt.bits == 4 and wt is not ScalarType.FE4M3FN:
        return {"lop3 low mask | 0x6400": (rd.LO_MASK, 8 * h), "lop3 high mask | 0x6400": (rd.HI_MASK, 8 * h),
                "lop3 low mask | 0x4300": (rd.LO_MASK, 8 * h), ">> 4, lop3 low mask | 0x4300": (rd.LO_MASK, 8 * h + 4)}
    if wt is ScalarType.FE4M3FN:
        return {}
    return {"prmt bytes 0, 2 under 0x64": (0x00FF00FF, 0), "prmt bytes 1, 3 under 0x64": (0x00FF00FF, 8)}


def render_dequant_bits(word, weight_type, act_dtype=np.float16, scale=1.0, zero=None, h: int = 0):
    """One row of 32 bits per step (bit 31 on the left): the word's bits coloured by field, every later register's
    bits coloured by the field they came from where they still carry a code, grey where the magic number (or a
    computed result) sits."""
    wt = ScalarType.parse(weight_type)
    steps = dequant_steps(word, wt, act_dtype, scale, zero, h)
    fig, (ax,) = new_figure(8.0, 0.42 * len(steps) + 0.9)
    bits = np.array([[(v >> (31 - i)) & 1 for i in range(32)] for _, v in steps])
    color = np.ones((len(steps), 32, 3))
    shift0 = 8 * h if wt.bits == 4 else 0  # 4-bit column half 1 starts from word >> 8
    color[0] = [to_rgb(FIELD_COLORS[(b + shift0) // wt.bits]) if b + shift0 < 32 else to_rgb("#dddddd")
                for b in range(31, -1, -1)]  # the word: every bit is a field's
    carried = _carried_bits(wt, h)
    for row, (name, value) in enumerate(steps[1:], start=1):
        color[row] = to_rgb("#dddddd")
        if name in carried:  # code bits keep their field's colour; the magic number's bits are pink
            mask, shift = carried[name]
            for i in range(32):
                bit = 31 - i
                if (mask >> bit) & 1:
                    color[row, i] = to_rgb(FIELD_COLORS[(bit + shift) // wt.bits])
                elif (value >> bit) & 1:
                    color[row, i] = to_rgb("#f4b6c2")
    ax.imshow(color, interpolation="nearest", aspect="auto")
    for (r, c), b in np.ndenumerate(bits):
        ax.text(c, r, str(b), ha="center", va="center", fontsize=7)
    separators(ax, 1, 4, bits.shape, color="white", linewidth=1.0)
    ax.axvline(15.5, color="black", linewidth=1.5)  # the two 16-bit halves of a register
    for first in range(0, 32, wt.bits):  # which field each group of the word row's bits is
        bit = 31 - first
        if bit + shift0 < 32:
            ax.text(first + (wt.bits - 1) / 2, -0.75, f"{'byte' if wt.bits == 8 else 'field'} "
                    f"{(bit + shift0) // wt.bits}", ha="center", va="center", fontsize=6.5)
    ax.set_ylim(len(steps) - 0.5, -1.1)
    ax.set_yticks(range(len(steps)), [f"{name}  {hex_word(v)}" for name, v in steps], fontsize=7)
    ax.set_xticks([0, 8, 15, 16, 24, 31], ["31", "23", "16", "15", "7", "0"], fontsize=7)
    ax.set_title(f"{wt}, {np.dtype(act_dtype)}: column half {h} of one sub-block, bit 31 left "
                 "(word row coloured by field)", fontsize=8)
    return fig


# ---------------------------------------------------------------------------------------------------------------
# The warp's view of one stage
# ---------------------------------------------------------------------------------------------------------------
def lane_loads_html(bits: int) -> HTML:
    """Which lane copies which 16 bytes of a tile (global and shared offsets are the same)."""
    rows = []
    for lane in range(LANES):
        spans = ws.lane_load_bytes(lane, bits)
        words = ws.lane_load_words(lane, bits)
        rows.append((lane, ", ".join(f"[{a}, {b})" for a, b in spans), f"{words[0]}..{words[-1]}"))
    return HTML(html_table(["lane", "bytes of the tile", "words"], rows,
                           caption=f"{bits}-bit: {words_per_lane(bits)} words per lane, {16 * len(spans)} bytes"))


def _operand_panel(ax, table: np.ndarray, label_of, col0: int, title: str, ylabel: str) -> None:
    """A 16×8 operand drawn by owner lane: ``table`` (32, 4, 2) lane, element -> (row, column)."""
    owner = np.zeros((16, 8), int)
    labels = np.empty((16, 8), dtype=object)
    for lane in range(LANES):
        for e in range(table.shape[1]):
            row, col = table[lane, e]
            owner[row, col] = lane
            labels[row, col] = label_of(lane, e)
    _lane_grid(ax, owner, labels, fontsize=5.5)
    ax.set_title(title, fontsize=8)
    ax.set_xticks(range(8), [str(col0 + i) for i in range(8)], fontsize=6)
    ax.set_yticks(range(16), [str(i) for i in range(16)], fontsize=6)
    ax.set_xlabel("n (tile column)", fontsize=7)
    ax.set_ylabel(ylabel, fontsize=7)


def render_warp_stage(bits: int = 4, subblock: int = 0, half: int = 0):
    """Three panels of one stage: the tile's bytes by the lane that loads them (one row of 16 bytes per load), the
    B operand of one mma (sub-block ``subblock``, column half ``half``: lane·register.half), and the C accumulator
    elements each lane receives (lane·c index)."""
    fig, (ax_load, ax_b, ax_c) = new_figure(11.0, 4.6, ncols=3, width_ratios=[1.15, 1.0, 1.0])
    loads = np.arange(LANES * (bits // 4))  # 16-byte loads of one tile, in byte order
    load_lane = loads // (bits // 4)
    grid = np.repeat(load_lane[:, None], 4, axis=1)
    labels = np.array([[f"L{lane}" if c == 0 else f"w{4 * i + c}" for c in range(4)]
                       for i, lane in enumerate(load_lane)], dtype=object)
    wide = grid.reshape(-1, 8)  # two 16-byte loads per picture row
    wide_labels = labels.reshape(wide.shape)
    _lane_grid(ax_load, wide, wide_labels, fontsize=5.5)
    ax_load.set_title(f"{bits}-bit tile: 16 bytes (4 words) per load\nrow = 2 loads, global = shared offsets", fontsize=8)
    ax_load.set_xticks([0, 4], ["load 2r", "load 2r + 1"], fontsize=7)
    ax_load.set_yticks(range(0, wide.shape[0], 4), [f"{32 * r} B" for r in range(0, wide.shape[0], 4)], fontsize=6)

    t = ws.fragment_tables()
    col0 = 16 * subblock + 8 * half
    _operand_panel(ax_b, t["b"], lambda lane, e: f"{lane}·b{e // 2}.{'lh'[e % 2]}", col0,
                   f"B of one mma: sub-block {subblock}, half {half}\n(tile columns {col0}..{col0 + 7}) "
                   "lane·register.low/high", "k (row of the k tile)")
    _operand_panel(ax_c, t["c"], lambda lane, e: f"{lane}·c{e}", col0,
                   "C accumulators (fp32) of that mma\nlane·c index", "m (row of A)")
    return fig
