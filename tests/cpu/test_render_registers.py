"""Render functions of the last step (workbench.render.registers) and the figure fingerprint, headless."""
import numpy as np
import pytest

from workbench.formats import register_dequant as rd
from workbench.render import registers as rr
from workbench.render import render_mma_fragment
from workbench.render.fingerprint import figure_fingerprint
from workbench.scalar_types import ScalarType


def test_lane_palette_tells_32_lanes_apart():
    colors = rr.lane_colors()
    assert colors.shape == (32, 3) and np.all((0 <= colors) & (colors <= 1))
    distance = np.linalg.norm(colors[:, None] - colors[None, :], axis=-1)
    assert distance[~np.eye(32, dtype=bool)].min() > 0.05  # no two lanes share a colour (tab20 cycled: 0 apart)
    assert len({tuple(np.round(c, 3)) for c in colors}) == 32


@pytest.mark.parametrize("weight_type,word", [("u4b8", 0x12345678), ("u4", 0x0F0F1234), ("u8b128", [1, 2]),
                                              ("u8", [0xFF00FF00, 7]), ("fe4m3fn", [0x38B8C040, 0x7F01])])
@pytest.mark.parametrize("act", [np.float16, rd.BF16], ids=str)
def test_dequant_steps_end_in_the_registers(weight_type, word, act):
    wt = ScalarType.parse(weight_type)
    zero = 3 if wt.has_zero_points else None
    for h in range(2):
        steps = rr.dequant_steps(word, wt, act, 0.5, zero, h)
        regs = rd.dequant_subblock(np.atleast_1d(np.asarray(word, np.int64)).astype(np.uint32)[None], wt, act,
                                   np.full((1, 2), 0.5, act), None if zero is None else np.array([[zero, zero]]))
        assert [v for name, v in steps if name.startswith("b[")] == [int(regs[0, h, 0]), int(regs[0, h, 1])]
    html = rr.dequant_steps_html(word, wt, act, 0.5, zero)
    assert "b[0][1] = times scale" in html
    fig = rr.render_dequant_bits(word, wt, act, 0.5, zero, 1)
    assert len(fig.axes) == 1


def test_dequant_steps_reject_a_wrong_word_count():
    with pytest.raises(ValueError, match="u8b128 takes 2 word"):
        rr.dequant_steps(5, "u8b128")


@pytest.mark.parametrize("bits", [4, 8])
def test_warp_stage_picture_and_loads_table(bits):
    fig = rr.render_warp_stage(bits)
    assert len(fig.axes) == 3
    html = rr.lane_loads_html(bits)
    assert html.count("<tr>") == 33 and ("[496, 512)" in html if bits == 4 else "[1008, 1024)" in html)


def test_fingerprint_is_stable_and_sees_changes():
    a, b = rr.render_warp_stage(4), rr.render_warp_stage(4)
    assert figure_fingerprint(a) == figure_fingerprint(b)
    assert figure_fingerprint(a) != figure_fingerprint(rr.render_warp_stage(8))
    assert figure_fingerprint(rr.render_dequant_bits(1, "u4b8")) != figure_fingerprint(rr.render_dequant_bits(2, "u4b8"))
    fig = rr.render_warp_stage(4)
    fig.axes[1].texts[5].set_text("swapped")  # one cell label changed
    assert figure_fingerprint(fig) != figure_fingerprint(a)
    fig = render_mma_fragment()
    before = figure_fingerprint(fig)
    fig.axes[0].get_images()[0].set_data(np.zeros((16, 8)))  # a blanked grid
    assert figure_fingerprint(fig) != before


@pytest.mark.parametrize("bits", [4, 8])
def test_warp_stage_byte_labels_match_the_lane_loads(bits):
    """Each picture row is two 16-byte loads; its label is the first byte of the load in its first cell."""
    from workbench.formats import warp_stage as ws

    ax = rr.render_warp_stage(bits).axes[0]
    loads_per_lane = bits // 4
    labelled_rows = [int(t.get_position()[1]) for t in ax.get_yticklabels()]
    for row, text in zip(labelled_rows, ax.get_yticklabels()):
        load = 2 * row  # the first cell of a row is load 2 row
        lane, which = divmod(load, loads_per_lane)
        assert text.get_text() == f"{ws.lane_load_bytes(lane, bits)[which, 0]} B"
    assert len(labelled_rows) == 32 * loads_per_lane // 2 // 4
