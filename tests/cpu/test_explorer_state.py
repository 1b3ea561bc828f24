"""The widgets' state after the interactions that used to go wrong: shrinking K under a group size, an inspector
asked for a destination beyond 63, errors that only reached JupyterLab's log console, and the text a committed
notebook shows for a widget cell."""
import pytest

from workbench import explorer as ex
from workbench.formats import marlin_tile as mt


def _consistent(e: ex.LayoutExplorer) -> None:
    """Every control and every output describe the same shape and position."""
    bits = e.bits
    assert e.k.max == e.size_k.value - 1 and e.n.max == e.size_n.value - 1
    assert 0 <= e.k.value < e.size_k.value and e.group_size.value in ex._groups_for(e.size_k.value)
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
