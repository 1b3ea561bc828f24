"""Pictures of the Marlin 16×64 tile: one picture per named map of ``workbench.formats.marlin_tile``.

The packed tensor is drawn *per tile* as a 32 × 32 grid: one row per lane of the warp, one column per
(word slot, field) of that lane — a lane's words for a tile are consecutive, so a row of the picture is exactly what
one lane loads. Tiles sit where their (k_tile, n_tile) puts them; Marlin row ``r`` of the 2-D tensor is k-tile ``r``.
Every coordinate drawn comes from the maps (``marlin_word_field_to_kn``, ``marlin_kn_to_word_field``,
``slot_element_to_fragment``, ``mma_b_fragment``); nothing here re-derives the layout.
"""
from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure

from workbench.formats import fp4_marlin
from workbench.formats import marlin_tile as mt
from workbench.formats import microscale as ms
from workbench.formats.packing import pack_factor
from workbench.formats.scales import num_groups, permute_scales, scale_permutation
from workbench.render._draw import (COMPANION, HIGHLIGHT, HTML, draw_grid, hex_word, html_table, lane_cmap,
                                    new_figure, outline, separators)
from workbench.scalar_types import ScalarType

# what the explorer lets you colour by: name -> (label, number of distinct values)
COLOR_BY = {
    "subblock": ("sub-block 0..3", 4),
    "lane": ("lane 0..31", 32),
    "field": ("field", 8),
    "k": ("k inside the tile (0..15)", 16),
    "n": ("n inside the sub-block (0..15)", 16),
}


def microscale_of(fmt) -> ms.MicroscaleFormat | None:
    """The microscaling format named ``fmt`` ('nvfp4', 'mxfp4', 'mxfp8'), or None for any other name or width."""
    return ms.FORMATS.get(fmt) if isinstance(fmt, str) else None


def bits_of(fmt) -> int:
    """Code width of a weight type name ('u4b8', 'u4', 'u8b128', 'u8', 'fe4m3fn'), of a microscaling format
    ('nvfp4', 'mxfp4': E2M1 codes take the 4-bit tile; 'mxfp8': E4M3 bytes take the 8-bit one) or of 4 / 8."""
    if isinstance(fmt, (int, np.integer)) and not isinstance(fmt, bool):
        return mt.check_bits(int(fmt))
    micro = microscale_of(fmt)
    return micro.element_bits if micro is not None else ScalarType.parse(fmt).bits


def _fmt_label(fmt) -> str:
    if isinstance(fmt, (int, np.integer)):
        return f"{fmt}-bit"
    micro = microscale_of(fmt)
    if micro is None:
        return str(ScalarType.parse(fmt))
    extra = ", fp32 global scale" if micro.has_global_scale else ""
    return f"{micro.name} ({micro.element.upper()} codes, group {micro.group_size} {micro.scale.upper()} scales{extra})"


def check_layout_shape(size_k: int, size_n: int) -> None:
    mt._check_tile_shape(size_k, size_n)


def coordinates_of(word, field, size_n: int, bits: int) -> dict[str, np.ndarray]:
    """Every named coordinate of Marlin (word, field), vectorized: the maps composed one step at a time."""
    word = np.asarray(word, dtype=np.int64)
    field = np.asarray(field, dtype=np.int64)
    tile, wit = np.divmod(word, mt.words_per_tile(bits))
    lane, slot = np.divmod(wit, mt.words_per_lane(bits))
    warp, half, e = mt.slot_element_to_fragment(slot, mt.FIELD_INTERLEAVE[bits][field], bits)
    k, n = mt.marlin_word_field_to_kn(word, field, size_n, bits)
    return {"word": word, "field": field, "tile": tile, "word_in_tile": wit, "lane": lane, "slot": slot,
            "subblock": warp, "half": half, "fragment_element": e, "k": k, "n": n}


def _color_value(coords: dict[str, np.ndarray], color_by: str) -> np.ndarray:
    if color_by not in COLOR_BY:
        raise ValueError(f"color_by = {color_by!r} is not one of {sorted(COLOR_BY)}")
    if color_by == "k":
        return coords["k"] % mt.TILE_K
    if color_by == "n":
        return coords["n"] % 16
    return coords[color_by]


def packed_grid_words(size_k: int, size_n: int, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """(word, field) of every cell of the packed picture, shape (K/16 * 32, N/64 * 32) each."""
    check_layout_shape(size_k, size_n)
    wpl, pf = mt.words_per_lane(bits), pack_factor(bits)
    k_tiles, n_tiles = size_k // mt.TILE_K, size_n // mt.TILE_N
    row, col = np.indices((k_tiles * mt.LANES, n_tiles * wpl * pf))
    k_tile, lane = np.divmod(row, mt.LANES)
    n_tile, rest = np.divmod(col, wpl * pf)
    slot, field = np.divmod(rest, pf)
    word = (k_tile * n_tiles + n_tile) * mt.words_per_tile(bits) + lane * wpl + slot
    return word, field


def packed_cell(word: int, field: int, size_n: int, bits: int) -> tuple[int, int]:
    """Where Marlin (word, field) is drawn in the packed picture: (row, column)."""
    wpl, pf = mt.words_per_lane(bits), pack_factor(bits)
    tile, wit = divmod(int(word), mt.words_per_tile(bits))
    k_tile, n_tile = divmod(tile, size_n // mt.TILE_N)
    lane, slot = divmod(wit, wpl)
    return k_tile * mt.LANES + lane, n_tile * wpl * pf + slot * pf + int(field)


def source_grid_words(size_k: int, size_n: int, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """(word, field) that every source element (k, n) lands in, shape (K, N) each."""
    check_layout_shape(size_k, size_n)
    k, n = np.indices((size_k, size_n))
    return mt.marlin_kn_to_word_field(k, n, size_n, bits)


# ---------------------------------------------------------------------------------------------------------------
# Map 1: tensor-core fragment ownership
# ---------------------------------------------------------------------------------------------------------------
def render_mma_fragment():
    """The 16×8 B fragment of mma.m16n8k16: which lane owns each element, and as which of its 4 elements."""
    lane = np.arange(mt.LANES)[:, None]
    e = np.arange(4)[None, :]
    dk, dn = mt.mma_b_fragment(lane, e)  # (32, 4) each
    owner = np.empty((16, 8), dtype=np.int64)
    element = np.empty((16, 8), dtype=np.int64)
    owner[dk, dn] = lane
    element[dk, dn] = e
    labels = np.char.add(np.char.add("t", owner.astype(str)), np.char.add(".", element.astype(str)))
    fig, (ax,) = new_figure(4.2, 6.0)
    draw_grid(ax, owner, count=mt.LANES, cmap=lane_cmap(), labels=labels, fontsize=7)
    ax.set_title("mma.m16n8k16 B fragment: lane t owns 4 elements (t.e)")
    ax.set_xlabel("n (column of the 16×8 fragment)")
    ax.set_ylabel("k (row)")
    ax.set_xticks(range(8))
    ax.set_yticks(range(16))
    separators(ax, 8, None, owner.shape, color="black", linewidth=1.5)
    return fig


# ---------------------------------------------------------------------------------------------------------------
# Map 2: four 16×16 sub-blocks, two 16×8 fragments each
# ---------------------------------------------------------------------------------------------------------------
def render_subblocks():
    """The 16×64 tile cut into four 16×16 sub-blocks (s) of two 16×8 fragments (half h)."""
    grid = np.empty((mt.TILE_K, mt.TILE_N), dtype=np.int64)
    for warp in range(4):
        for half in range(2):
            first = int(mt.subblock_column(warp, half))
            grid[:, first:first + 8] = 2 * warp + half
    fig, (ax,) = new_figure(10, 3.2)
    draw_grid(ax, grid, count=8, cmap="Paired")
    for warp in range(4):
        for half in range(2):
            ax.text(int(mt.subblock_column(warp, half)) + 3.5, 7.5, f"sub-block {warp}\nhalf {half}", ha="center",
                    va="center", fontsize=8)
    separators(ax, None, 16, grid.shape, color="black", linewidth=2)
    ax.set_title("one Marlin tile = 16 (k) × 64 (n) = four 16×16 sub-blocks = eight 16×8 B fragments")
    ax.set_xlabel("n inside the tile")
    ax.set_ylabel("k inside the tile")
    return fig


# ---------------------------------------------------------------------------------------------------------------
# Map 3: which word a lane reads
# ---------------------------------------------------------------------------------------------------------------
def render_lane_words(bits: int, subblock: int | None = None):
    """Every element of one tile labelled with its word-in-tile and coloured by the lane that loads it.

    ``subblock``: zoom on that 16×16 sub-block (readable labels) instead of drawing the whole 16×64 tile."""
    bits = bits_of(bits)
    word, field = source_grid_words(mt.TILE_K, mt.TILE_N, bits)
    coords = coordinates_of(word, field, mt.TILE_N, bits)
    lanes = coords["lane"]
    first = 0
    if subblock is not None:
        if subblock not in range(4):
            raise ValueError(f"subblock = {subblock} is not one of 0..3")
        first = 16 * subblock
        word, lanes = word[:, first:first + 16], lanes[:, first:first + 16]
        labels = np.char.add(np.char.add("w", word.astype(str)), np.char.add("\nL", lanes.astype(str)))
        fig, (ax,) = new_figure(6.2, 6.2)
        draw_grid(ax, lanes, count=mt.LANES, cmap=lane_cmap(), labels=labels, fontsize=5.5)
        separators(ax, 8, 8, word.shape, color="black", linewidth=1.5)
        ax.set_xticks(range(16), [str(first + i) for i in range(16)])
        ax.set_yticks(range(16))
    else:  # the whole tile: colours only (the zoom carries the numbers)
        fig, (ax,) = new_figure(11, 3.4)
        draw_grid(ax, lanes, count=mt.LANES, cmap=lane_cmap())
        separators(ax, 8, 16, word.shape, color="black", linewidth=1.5)
    wpl = mt.words_per_lane(bits)
    where = "" if subblock is None else f"sub-block {subblock}: "
    what = "the colour is the lane" if subblock is None else \
        f"w: the word inside the tile (lane·{wpl} + slot), L: the lane"
    ax.set_title(f"{bits}-bit, {where}{what} —\na lane's {wpl} words are consecutive, {wpl * 4} bytes in one load",
                 fontsize=9)
    ax.set_xlabel("n inside the tile")
    ax.set_ylabel("k inside the tile")
    return fig


# ---------------------------------------------------------------------------------------------------------------
# Map 4: the field interleave
# ---------------------------------------------------------------------------------------------------------------
def field_table_html(bits: int) -> HTML:
    """For one word of lane t: field j -> natural element -> (dk, dn) relative to the lane's first element."""
    bits = bits_of(bits)
    pf = pack_factor(bits)
    fields = np.arange(pf)
    # word 0 = lane 0, slot 0 of tile 0: its (k, n) are exactly the offsets every word shares
    k, n = mt.marlin_word_field_to_kn(np.zeros(pf, dtype=np.int64), fields, mt.TILE_N, bits)
    rows = [(j, f"{j * bits}..{j * bits + bits - 1}", int(mt.FIELD_INTERLEAVE[bits][j]), f"k+{int(k[j])}",
             f"n+{int(n[j])}") for j in fields]
    return HTML(html_table(["field j", "bits", "natural element", "row", "column"], rows,
                           caption=f"{bits}-bit word: FIELD_INTERLEAVE = {mt.FIELD_INTERLEAVE[bits].tolist()}"))


def render_field_interleave(bits: int):
    """One word drawn as a register (bit 31 on the left): natural order above, Marlin's interleaved order below."""
    bits = bits_of(bits)
    pf = pack_factor(bits)
    fields = np.arange(pf)
    k, n = mt.marlin_word_field_to_kn(np.zeros(pf, dtype=np.int64), fields, mt.TILE_N, bits)
    natural = np.argsort(mt.FIELD_INTERLEAVE[bits])  # natural element e sits in field natural[e]
    fig, axes = new_figure(10, 3.0, nrows=2)
    for ax, title, order in ((axes[0], "natural order (element e in field e)", natural),
                             (axes[1], f"Marlin order: field j holds element {mt.FIELD_INTERLEAVE[bits].tolist()}[j]",
                              fields)):
        for j in range(pf):
            src = order[j]  # which field of the Marlin word holds the element drawn in slot j
            x = pf - 1 - j  # bit 31 on the left
            pair = int(k[src]) % 2  # rows k and k+1 form a dequant pair
            color = ["#9ecae1", "#fdae6b"][pair]
            ax.add_patch(_box(x, color))
            ax.text(x + 0.5, 0.5, f"k+{int(k[src])}, n+{int(n[src])}", ha="center", va="center", fontsize=8)
            ax.text(x + 0.5, -0.25, f"bits {j * bits}..{j * bits + bits - 1}", ha="center", va="center", fontsize=7)
        ax.set_xlim(0, pf)
        ax.set_ylim(-0.5, 1.1)
        ax.set_title(title, fontsize=9)
        ax.axis("off")
    fig.suptitle(f"{bits}-bit: the interleave puts rows k (blue) and k+1 (orange) of one column 16 bits apart, "
                 "so one mask turns a pair into a half2", fontsize=9)
    return fig


def _box(x: float, color: str):
    from matplotlib.patches import Rectangle

    return Rectangle((x + 0.03, 0.05), 0.94, 0.9, facecolor=color, edgecolor="black")


# ---------------------------------------------------------------------------------------------------------------
# Composition: the whole layout, and one element's path through it
# ---------------------------------------------------------------------------------------------------------------
def render_layout(fmt, size_k: int, size_n: int, color_by: str = "subblock", k: int | None = None,
                  n: int | None = None, zoom: bool = False):
    """Source matrix (K×N) beside the packed Marlin tensor (per tile: lanes × (slot, field)), coloured alike.

    With ``k, n`` the element is filled red in both pictures, and the other codes of its word are outlined in black.
    ``zoom`` (with ``k, n``) adds a third panel: the element's 16×64 tile, each cell labelled with the lane that
    loads it, so the selection stays readable when K and N make the overview small.
    """
    bits = bits_of(fmt)
    check_layout_shape(size_k, size_n)
    label, count = COLOR_BY.get(color_by, (None, None))
    src_word, src_field = source_grid_words(size_k, size_n, bits)
    pk_word, pk_field = packed_grid_words(size_k, size_n, bits)
    src_val = _color_value(coordinates_of(src_word, src_field, size_n, bits), color_by)
    pk_val = _color_value(coordinates_of(pk_word, pk_field, size_n, bits), color_by)
    count = pack_factor(bits) if color_by == "field" else count

    width = 5 + 6 * size_n / 64
    zoomed = zoom and k is not None and n is not None
    if zoomed:  # the overview on top (height capped), the element's tile across the full width below
        fig_width = min(max(width, 11), 18)
        top = min(2.6 + 1.9 * size_k / 16, 7.0)
        fig = Figure(figsize=(fig_width, top + 0.27 * fig_width + 0.8), layout="constrained")
        axd = fig.subplot_mosaic([["src", "pk"], ["zoom", "zoom"]], width_ratios=[2, 1],
                                 height_ratios=[top, 0.27 * fig_width])
        ax_src, ax_pk, ax_zoom = axd["src"], axd["pk"], axd["zoom"]
    else:
        fig, (ax_src, ax_pk) = new_figure(min(width, 18), 2.6 + 1.9 * size_k / 16, ncols=2, width_ratios=[2, 1])
    cmap = lane_cmap() if color_by == "lane" else "tab20"
    draw_grid(ax_src, src_val, count=count, cmap=cmap)
    draw_grid(ax_pk, pk_val, count=count, cmap=cmap, colorbar=label)
    separators(ax_src, mt.TILE_K, mt.TILE_N, src_val.shape, color="black", linewidth=1.5)
    separators(ax_pk, mt.LANES, mt.words_per_lane(bits) * pack_factor(bits), pk_val.shape, color="black",
               linewidth=1.5)
    ax_src.set_title(f"source weight (K={size_k}, N={size_n}), tiles outlined")
    ax_src.set_xlabel("n")
    ax_src.set_ylabel("k")
    ax_pk.set_title(f"Marlin {bits}-bit tensor [{size_k // 16}, {size_n * 16 // pack_factor(bits)}]: per tile, "
                    "row = lane, column = (slot, field)", fontsize=9)
    ax_pk.set_xlabel("tile n_tile · (word slot, field)")
    ax_pk.set_ylabel("tile k_tile · lane")
    if k is not None and n is not None:
        _check_position(k, n, size_k, size_n)
        word, field = (int(v) for v in mt.marlin_kn_to_word_field(k, n, size_n, bits))
        ks, ns = mt.marlin_word_field_to_kn(np.full(pack_factor(bits), word), np.arange(pack_factor(bits)), size_n, bits)
        for kk, nn in zip(ks, ns):
            outline(ax_src, int(kk), int(nn), color=COMPANION, linewidth=1.2)
        outline(ax_src, k, n, fill=True)
        row, col = packed_cell(word, 0, size_n, bits)
        outline(ax_pk, row, col, 1, pack_factor(bits), color=COMPANION, linewidth=1.2)
        outline(ax_pk, *packed_cell(word, field, size_n, bits), fill=True)
        if zoomed:
            _draw_zoom(ax_zoom, bits, size_n, color_by, count, cmap, k, n, ks, ns)
        fig.suptitle(f"(k={k}, n={n}) -> word {word}, field {field}; black: the other codes of that word", fontsize=10)
    return fig


def _draw_zoom(ax, bits: int, size_n: int, color_by: str, count: int, cmap, k: int, n: int, ks, ns) -> None:
    """The 16×64 tile of (k, n), coloured as the overview, every cell labelled with its lane."""
    k0, n0 = k - k % mt.TILE_K, n - n % mt.TILE_N
    kk, nn = np.meshgrid(np.arange(k0, k0 + mt.TILE_K), np.arange(n0, n0 + mt.TILE_N), indexing="ij")
    word, field = mt.marlin_kn_to_word_field(kk, nn, size_n, bits)
    coords = coordinates_of(word, field, size_n, bits)
    draw_grid(ax, _color_value(coords, color_by), count=count, cmap=cmap, labels=coords["lane"], fontsize=6)
    separators(ax, 8, 16, kk.shape, color="black", linewidth=1.2)
    for k_c, n_c in zip(ks, ns):
        outline(ax, int(k_c) - k0, int(n_c) - n0, color=COMPANION, linewidth=1.5)
    outline(ax, k - k0, n - n0, linewidth=2.5)
    ax.set_xticks(range(0, mt.TILE_N, 8), [str(n0 + c) for c in range(0, mt.TILE_N, 8)])
    ax.set_yticks(range(0, mt.TILE_K, 2), [str(k0 + r) for r in range(0, mt.TILE_K, 2)])
    ax.set_title(f"zoom: the tile of (k={k}, n={n}); numbers are lanes", fontsize=9)
    ax.set_xlabel("n")
    ax.set_ylabel("k")


def _check_position(k: int, n: int, size_k: int, size_n: int) -> None:
    if not (0 <= int(k) < size_k and 0 <= int(n) < size_n):
        raise ValueError(f"position (k={k}, n={n}) is outside the {size_k}×{size_n} weight")


def check_microscale_shape(micro: ms.MicroscaleFormat, size_k: int, group_size) -> None:
    """A microscaling format fixes its group size, and K must hold whole groups."""
    ms.check_group_size(micro, group_size)
    ms.check_k(micro, size_k)


def microscale_scale_positions(fmt, size_k: int, size_n: int) -> tuple[np.ndarray, np.ndarray]:
    """(group, column) in the Marlin scale tensor [K/G, N] of every checkpoint scale [N, K/G], each shape [N, K/G].

    Computed by sending the scales' own flat indices through the format's scale route (``fp4_marlin``: the
    permutation, then the [0, 2, 1, 3] shuffle), so the picture cannot drift from the bytes the kernel reads.
    """
    micro = ms.microscale_format(fmt)
    check_microscale_shape(micro, size_k, micro.group_size)
    ng = size_k // micro.group_size
    index = np.arange(size_n * ng, dtype=np.int64).reshape(size_n, ng)  # checkpoint scale (n, g) has index n·ng + g
    permuted = permute_scales(np.ascontiguousarray(index.T), size_k, size_n, micro.group_size)
    marlin = fp4_marlin.shuffle_scales(permuted)  # [ng, N]: the checkpoint index each Marlin position holds
    group = np.empty_like(index)
    column = np.empty_like(index)
    rows, cols = np.indices(marlin.shape)
    group.reshape(-1)[marlin.reshape(-1)] = rows.reshape(-1)
    column.reshape(-1)[marlin.reshape(-1)] = cols.reshape(-1)
    return group, column


def microscale_scale_rows(micro: ms.MicroscaleFormat, size_k: int, size_n: int, k: int, n: int,
                          group_size) -> list[tuple[str, str]]:
    """The path rows of (k, n)'s scale: which checkpoint scale, where the permutation and the shuffle put it, and
    what byte the kernel reads there."""
    check_microscale_shape(micro, size_k, group_size)
    g = k // micro.group_size
    group, column = microscale_scale_positions(micro, size_k, size_n)
    perm = scale_permutation(size_k, micro.group_size)
    chunk, lane_pos = divmod(n, perm.size)
    permuted = chunk * perm.size + int(np.flatnonzero(perm == lane_pos)[0])
    dest = int(column[n, g])
    byte = ("S0E5M3 byte: fp16(s · 2^7) << 1, high byte (a negative scale loses its sign)"
            if micro.scale == "e4m3" else "the E8M0 code itself, 2^(code − 127)")
    rows = [("scale", f"checkpoint weight_scale[{n}, {g}] (elements k = {g * micro.group_size}.."
                      f"{g * micro.group_size + micro.group_size - 1} of row n = {n})"),
            ("permuted", f"Marlin s[{g}, {permuted}] (P{perm.size})"),
            ("shuffled", f"Marlin s[{int(group[n, g])}, {dest}] ([0, 2, 1, 3] within the four columns "
                         f"{dest - dest % 4}..{dest - dest % 4 + 3})"),
            ("scale byte", byte)]
    if micro.has_global_scale:
        rows.append(("global scale", "one fp32 per tensor, × 2^7 (fp16) or × 2^119 (bf16) for the kernel"))
    return rows


def position_path_html(fmt, size_k: int, size_n: int, k: int, n: int, group_size: int = -1) -> HTML:
    """The path of element (k, n): tile -> sub-block -> fragment half -> lane -> word -> field -> bits -> scale."""
    bits = bits_of(fmt)
    check_layout_shape(size_k, size_n)
    _check_position(k, n, size_k, size_n)
    d = mt.describe_position(k, n, size_n, bits)
    c = coordinates_of(d["word"], d["field"], size_n, bits)
    wpl = mt.words_per_lane(bits)
    rows = [
        ("source", f"(k={d['k']}, n={d['n']})"),
        ("tile", f"{d['tile']} = (k_tile {d['k_tile']}, n_tile {d['n_tile']})"),
        ("sub-block", f"{d['subblock']} (columns {16 * d['subblock']}..{16 * d['subblock'] + 15} of the tile)"),
        ("B fragment half", f"{d['half']}"),
        ("lane", f"{d['lane']} (fragment element {d['fragment_element']})"),
        ("word", f"{d['word']} = tile·{mt.words_per_tile(bits)} + lane·{wpl} + slot {int(c['slot'])}; "
                 f"2-D index [{d['row']}, {d['column']}]"),
        ("field", f"{d['field']} (bits {d['field'] * bits}..{d['field'] * bits + bits - 1})"),
    ]
    micro = microscale_of(fmt)
    if micro is not None:
        rows += microscale_scale_rows(micro, size_k, size_n, k, n, group_size)
    else:
        ng = num_groups(size_k, group_size)
        group = 0 if group_size == -1 else k // group_size
        perm = scale_permutation(size_k, group_size)  # out[d] = in[perm[d]]: column n lands where perm names it
        chunk, lane_pos = divmod(n, perm.size)
        dest = chunk * perm.size + int(np.flatnonzero(perm == lane_pos)[0])
        rows.append(("scale", f"checkpoint s[{group}, {n}] -> Marlin s[{group}, {dest}] "
                              f"(P{perm.size}, {ng} group{'s' if ng > 1 else ''})"))
    body = html_table(["step", "value"], rows, caption=f"{_fmt_label(fmt)} K={size_k} N={size_n} "
                      f"group_size={group_size}", css_class="wb-path")
    return HTML(f'<div class="wb-path-box" data-word="{d["word"]}" data-field="{d["field"]}">'
                f'<b class="wb-word">word {d["word"]}, field {d["field"]}</b>{body}</div>')


def word_sources_html(fmt, size_k: int, size_n: int, word: int, qweight: np.ndarray | None = None) -> HTML:
    """The pf source elements of one Marlin word, field by field (with the code values when ``qweight`` is given)."""
    bits = bits_of(fmt)
    check_layout_shape(size_k, size_n)
    total = size_k // mt.TILE_K * size_n * mt.TILE_K // pack_factor(bits)
    if not 0 <= int(word) < total:
        raise ValueError(f"word = {word} is outside the {total} words of a {size_k}×{size_n} {bits}-bit weight")
    pf = pack_factor(bits)
    c = coordinates_of(np.full(pf, word), np.arange(pf), size_n, bits)
    value = None if qweight is None else int(np.asarray(qweight).reshape(-1)[int(word)])
    rows = []
    for j in range(pf):
        code = "" if value is None else (value >> (bits * j)) & ((1 << bits) - 1)
        rows.append((j, int(c["k"][j]), int(c["n"][j]), int(c["subblock"][j]), int(c["half"][j]),
                     int(c["fragment_element"][j]), code))
    caption = f"word {word} (lane {int(c['lane'][0])}, slot {int(c['slot'][0])})"
    if value is not None:
        caption += f" = {hex_word(value)}"
    return HTML(html_table(["field", "k", "n", "sub-block", "half", "fragment element", "code"], rows, caption=caption))


def words_html(words: np.ndarray, rows: int = 4, cols: int = 8, caption: str = "") -> HTML:
    """The top-left corner of an int32 word tensor in hex."""
    words = np.asarray(words)
    if words.ndim != 2:
        raise ValueError(f"words must be 2-D, got shape {words.shape}")
    corner = words[:rows, :cols]
    body = [[f"[{r}]"] + [hex_word(v) for v in corner[r]] for r in range(corner.shape[0])]
    return HTML(html_table([""] + [f"[{c}]" for c in range(corner.shape[1])], body,
                           caption=caption or f"shape {tuple(words.shape)}, dtype {words.dtype}"))


def microscale_scale_chunk() -> tuple[np.ndarray, np.ndarray]:
    """(after the permutation, after the shuffle): the checkpoint column that each of the 64 Marlin positions of one
    chunk holds, for any grouped microscaled layer (two groups of 32 along K: P64), through ``fp4_marlin``'s route."""
    size_k, size_n, group = 64, 64, 32
    index = np.tile(np.arange(size_n, dtype=np.int64), (size_k // group, 1))  # [ng, N]: each scale's own column
    permuted = permute_scales(index, size_k, size_n, group)
    return permuted[0], fp4_marlin.shuffle_scales(permuted)[0]


def render_microscale_scale_shuffle(selected: int | None = None):
    """One 64-chunk of NVFP4 / MX scales: checkpoint order, after P64, after the [0, 2, 1, 3] shuffle (8 × 8 each,
    each cell labelled with the checkpoint column it holds, coloured by that column's row of the left grid)."""
    permuted, shuffled = microscale_scale_chunk()
    source = np.arange(permuted.size)
    fig, axes = new_figure(12, 4.2, ncols=3)
    for ax, order, title in ((axes[0], source, "checkpoint scales, one 64-chunk (column i)"),
                             (axes[1], permuted, "after P64: out[d] = in[P64[d]]"),
                             (axes[2], shuffled, "after the shuffle: [0, 2, 1, 3] in every four")):
        draw_grid(ax, (order // 8).reshape(8, 8), count=8, cmap="Set2", labels=order.reshape(8, 8), fontsize=8)
        separators(ax, None, 4, (8, 8), color="black", linewidth=1.2)
        ax.set_title(title, fontsize=9)
        ax.set_xticks(range(8))
        ax.set_yticks(range(8))
    if selected is not None:
        if not 0 <= int(selected) < source.size:
            raise ValueError(f"selected = {selected} is outside a 64-chunk")
        d = int(selected)
        src = int(shuffled[d])
        via = int(np.flatnonzero(permuted == src)[0])
        outline(axes[2], *divmod(d, 8))
        outline(axes[1], *divmod(via, 8))
        outline(axes[0], *divmod(src, 8))
        fig.suptitle(f"Marlin position {d} holds checkpoint column {src} (P64 put it at {via}, the shuffle moved it"
                     f"{' nowhere' if via == d else f' to {d}'})", fontsize=10)
    return fig
