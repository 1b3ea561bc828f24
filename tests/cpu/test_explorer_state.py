"""The widgets' state after the interactions that used to go wrong: shrinking K under a group size, an inspector
asked for a destination beyond 63, errors that only reached JupyterLab's log console, and the text a committed
notebook shows for a widget cell."""
import re

import numpy as np
import pytest

from workbench import explorer as ex
from workbench.formats import fp4_marlin as f4
from workbench.formats import marlin_tile as mt
from workbench.formats import microscale as ms


def _consistent(e: ex.LayoutExplorer) -> None:
    """Every control and every output describe the same shape and position."""
    bits = e.bits
    assert e.k.max == e.size_k.value - 1 and e.n.max == e.size_n.value - 1
    assert 0 <= e.k.value < e.size_k.value and e.group_size.value in ex._groups_for(e.size_k.value, e.fmt.value)
    word, field = mt.marlin_kn_to_word_field(e.k.value, e.n.value, e.size_n.value, bits)
    assert (e.word.value, e.field.value) == (word, field)
    assert f'data-word="{word}" data-field="{field}"' in e.path.value and e.error is None


def test_shrinking_k_under_a_group_size_redraws_once_for_the_new_shape(monkeypatch):
    e = ex.LayoutExplorer(size_k=128, size_n=64, n=40, dpi=20)
    e.group_size.value = 32
    e.k.value = 100
    drawn = []
    original = ex.rtile.render_layout
    monkeypatch.setattr(ex.rtile, "render_layout",
                        lambda fmt, k, n, *a, **kw: drawn.append((k, n)) or original(fmt, k, n, *a, **kw))
    e.size_k.value = 16
    assert drawn == [(16, 64)]  # one redraw, for K = 16 (the group observer used to draw K = 128 first, then fail)
    assert (e.k.value, e.group_size.value) == (15, -1)
    _consistent(e)


def test_a_group_size_that_still_divides_k_is_kept():
    e = ex.LayoutExplorer(size_k=128, size_n=64, dpi=20)
    e.group_size.value = 32
    e.size_k.value = 64
    assert e.group_size.value == 32
    _consistent(e)


def test_a_render_error_is_shown_in_the_widget(monkeypatch):
    e = ex.LayoutExplorer(dpi=20)

    def fail(*args, **kwargs):
        raise ValueError("position (k=100, n=70) is outside the 16×128 weight")

    monkeypatch.setattr(ex.rtile, "render_layout", fail)
    e.refresh()
    assert e.error == "position (k=100, n=70) is outside the 16×128 weight"
    assert "wb-error" in e.path.value and "outside the 16×128 weight" in e.path.value


def test_inspector_shows_the_destination_it_was_asked_for():
    i = ex.IndexMapInspector(which="block-FP8 word sources", size_k=256, size_n=128, index=300, dpi=20)
    assert (i.index.value, i.index.max) == (300, 256 // 16 * 4 * 128 - 1)
    assert "<td>Marlin word</td><td>300</td>" in i.info.value
    with pytest.raises(ValueError, match=r"index = 64 is outside 'scale P64 \(grouped\)'.*0\.\.63"):
        ex.IndexMapInspector(index=64)


def test_inspector_defaults_off_a_fixed_point_and_hides_unused_controls():
    i = ex.IndexMapInspector(dpi=20)
    assert i.index.value == 10 and "<td>source P[d]</td><td>17</td>" in i.info.value  # P64[10] = 17, not itself
    assert i.size_k.layout.display == "none" and i.size_n.layout.display == "none"
    i.which.value = "block-FP8 scale sources"
    assert i.size_k.layout.display is None


@pytest.mark.parametrize("make", [lambda: ex.LayoutExplorer(dpi=20), lambda: ex.IndexMapInspector(dpi=20)])
def test_widget_cells_show_a_sentence_not_a_vbox_repr(make):
    w = make()
    bundle = ex.widget_bundle(w.widget, w.summary())
    assert bundle["application/vnd.jupyter.widget-view+json"]["model_id"] == w.widget.model_id
    assert bundle["text/plain"] == w.summary() and "VBox" not in bundle["text/plain"]
    assert "run the notebook" in w.summary()


def test_large_shapes_get_a_zoom_on_the_selected_tile():
    from workbench.render import render_layout

    fig = render_layout("u4b8", 64, 128, "lane", k=40, n=70, zoom=True)
    zoom = fig.axes[2]
    assert zoom.get_title() == "zoom: the tile of (k=40, n=70); numbers are lanes"
    d = mt.describe_position(40, 70, 128, 4)
    (label,) = [t.get_text() for t in zoom.texts if tuple(t.get_position()) == (70 - 64, 40 - 32)]
    assert label == str(d["lane"])
    assert len(render_layout("u4b8", 16, 64, "lane", k=4, n=7).axes) == 3  # no zoom: 2 panels + colorbar


# ---- the microscaling formats ----------------------------------------------------------------------------------
def test_choosing_a_microscaling_format_takes_its_group_and_back(monkeypatch):
    e = ex.LayoutExplorer(size_k=64, size_n=128, dpi=20)
    e.group_size.value = 32
    for fmt, group in (("nvfp4", 16), ("mxfp4", 32), ("mxfp8", 32)):
        e.fmt.value = fmt
        assert e.group_size.value == group and e.bits == ms.FORMATS[fmt].element_bits
        _consistent(e)
        assert f"{fmt} (" in e.path.value and "shuffled" in e.path.value
    assert "S0E5M3" not in e.path.value  # MXFP8's scales stay E8M0 codes
    e.fmt.value = "nvfp4"
    assert "S0E5M3" in e.path.value and "global scale" in e.path.value
    e.fmt.value = "u4b8"  # 16 is no group of the integer formats: back to channelwise
    assert e.group_size.value == -1 and "shuffled" not in e.path.value
    _consistent(e)


@pytest.mark.parametrize("fmt", ex.MICROSCALE_FORMATS)
def test_the_explorer_maps_are_the_repack_of_the_format(fmt):
    """Every (k, n) the explorer puts at (word, field) is the code the format's repack writes there."""
    size_k, size_n = 64, 128
    rng = np.random.default_rng(31)
    e = ex.LayoutExplorer(fmt=fmt, size_k=size_k, size_n=size_n, dpi=20)
    k, n = np.indices((size_k, size_n))
    word, field = ex.rtile.source_grid_words(size_k, size_n, e.bits)
    if e.bits == 4:
        codes = rng.integers(0, 16, (size_n, size_k), dtype=np.uint8)
        qweight = f4.fp4_marlin_repack(ms.pack_fp4(codes), size_k, size_n)
        # and the same map as the format's own word -> source table
        flat = np.take_along_axis(f4.fp4_word_sources(word, size_k, size_n), field[..., None], axis=-1)[..., 0]
        assert np.array_equal(flat, n * size_k + k)
    else:
        codes = rng.integers(0, 256, (size_n, size_k), dtype=np.uint8)
        qweight = f4.mxfp8_marlin_repack(codes, size_k, size_n)
    words = qweight.reshape(-1).view(np.uint32)[word]
    fields = (words >> (e.bits * field).astype(np.uint32)) & np.uint32((1 << e.bits) - 1)
    assert np.array_equal(fields, codes.T)
    shown = [int(v) for v in re.findall(r"<td>(\d+)</td>", e.word_table.value)]  # the word table: field, k, n, ...
    table = np.array(shown).reshape(-1, 6)
    assert np.array_equal(table[:, 0], np.arange(32 // e.bits))
    assert np.array_equal(codes[table[:, 2], table[:, 1]], (int(qweight.reshape(-1).view(np.uint32)[e.word.value])
                          >> (e.bits * table[:, 0])) & ((1 << e.bits) - 1))


@pytest.mark.parametrize("fmt", ex.MICROSCALE_FORMATS)
@pytest.mark.parametrize("size_k", [32, 128])  # NVFP4 at K = 32 has two groups; 128: four (MX) or eight
def test_the_scale_path_is_the_scale_route_of_the_format(fmt, size_k):
    micro = ms.FORMATS[fmt]
    size_n = 128
    rng = np.random.default_rng(size_k)
    ng = size_k // micro.group_size
    group, column = ex.rtile.microscale_scale_positions(fmt, size_k, size_n)
    if micro.scale == "e8m0":
        scales = rng.integers(100, 150, (size_n, ng), dtype=np.uint8)
        marlin = f4.mx_marlin_scales(scales, size_k, size_n, fmt)
        assert np.array_equal(marlin[group, column], scales)
    else:
        scales = rng.integers(0x08, 0x78, (size_n, ng), dtype=np.uint8)  # positive normal E4M3 scales
        marlin, factor = f4.nvfp4_marlin_scales(scales, size_k, size_n, ms.F16)
        assert np.array_equal(f4.s0e5m3_to_float(marlin[group, column]) / factor, ms.e4m3_value(scales))
    e = ex.LayoutExplorer(fmt=fmt, size_k=size_k, size_n=size_n, k=size_k - 1, n=57, dpi=20)
    g = (size_k - 1) // micro.group_size
    assert f"<td>Marlin s[{group[57, g]}, {column[57, g]}] ([0, 2, 1, 3]" in e.path.value


@pytest.mark.parametrize("fmt, group, message", [
    ("nvfp4", 32, "group_size = 32 is not nvfp4's 16 (the format fixes it)"),
    ("mxfp4", -1, "group_size = -1 is not mxfp4's 32 (the format fixes it)"),
    ("mxfp8", 64, "group_size = 64 is not mxfp8's 32 (the format fixes it)"),
])
def test_a_group_size_the_format_does_not_have_is_an_error_in_the_widget(fmt, group, message):
    e = ex.LayoutExplorer(fmt=fmt, size_k=64, group_size=group, dpi=20)
    assert e.error == message and "wb-error" in e.path.value
    e.group_size.value = ms.FORMATS[fmt].group_size  # choosing the format's group clears it
    assert e.error is None
    _consistent(e)
    e.group_size.value = group  # and choosing the wrong one in the dropdown shows it again
    assert e.error == message


def test_k_without_a_whole_mx_group_is_an_error_in_the_widget():
    e = ex.LayoutExplorer(fmt="mxfp4", size_k=64, dpi=20)
    e.size_k.value = 16
    assert e.group_size.value == 32
    assert e.error == "size_k = 16 is not a positive multiple of mxfp4's group size 32"
    e.fmt.value = "nvfp4"
    assert e.error is None and e.group_size.value == 16
    _consistent(e)


def test_an_unknown_format_or_group_is_refused_by_name():
    with pytest.raises(ValueError, match=r"fmt = 'nvfp8' is not one of the explorer's formats"):
        ex.LayoutExplorer(fmt="nvfp8")
    with pytest.raises(ValueError, match=r"group_size = 16 is not one of \[-1, 32\] for K = 32"):
        ex.LayoutExplorer(fmt="u4b8", group_size=16)


def test_the_scale_shuffle_view_is_the_mx_scale_route():
    """The inspector's third map draws what mx_marlin_scales does to one 64-chunk of distinct codes."""
    size_k, size_n = 64, 64
    codes = (np.arange(size_n)[:, None] + np.array([[0, 64]])).astype(np.uint8)  # [N, 2]: column n of group g
    marlin = f4.mx_marlin_scales(codes, size_k, size_n, "mxfp4")
    permuted, shuffled = ex.rtile.microscale_scale_chunk()
    assert np.array_equal(marlin[0], shuffled) and np.array_equal(marlin[1], shuffled + 64)
    assert np.array_equal(shuffled, f4.shuffle_scales(permuted)) and not np.array_equal(shuffled, permuted)
    i = ex.IndexMapInspector(which="scale P64 + [0,2,1,3] shuffle (NVFP4, MX)", index=9, dpi=20)
    assert i.size_k.layout.display == "none"
    assert "<td>checkpoint column</td><td>17</td>" in i.info.value and "<td>P64 put it at</td><td>10</td>" in i.info.value
    fig = ex.rtile.render_microscale_scale_shuffle(9)
    labels = [int(t.get_text()) for t in fig.axes[-1].texts]
    assert labels == shuffled.tolist()
    with pytest.raises(ValueError, match="selected = 64 is outside a 64-chunk"):
        ex.rtile.render_microscale_scale_shuffle(64)
