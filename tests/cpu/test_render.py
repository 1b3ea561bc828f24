"""Headless tests of the render functions and the widget classes (no frontend needed)."""
from __future__ import annotations

import re

import numpy as np
import pytest
from matplotlib.figure import Figure

from workbench import render
from workbench.formats import fp8 as f8
from workbench.formats import marlin_tile as mt
from workbench.formats.packing import pack_factor
from workbench.formats.scales import SCALE_PERM_32, SCALE_PERM_64
from workbench.render import tile as rtile
from workbench.weight import random_marlin_weight


@pytest.mark.parametrize("bits", [4, 8])
def test_packed_picture_covers_every_word_field_once(bits):
    size_k, size_n = 32, 128
    word, field = rtile.packed_grid_words(size_k, size_n, bits)
    flat = word * pack_factor(bits) + field
    assert np.array_equal(np.sort(flat.ravel()), np.arange(size_k * size_n))
    # every cell is where packed_cell says it is
    rng = np.random.default_rng()
    for r, c in zip(rng.integers(0, word.shape[0], 20), rng.integers(0, word.shape[1], 20)):
        assert rtile.packed_cell(word[r, c], field[r, c], size_n, bits) == (r, c)


@pytest.mark.parametrize("bits", [4, 8])
def test_source_picture_is_inverse_of_packed(bits):
    size_k, size_n = 32, 128
    word, field = rtile.source_grid_words(size_k, size_n, bits)
    k, n = mt.marlin_word_field_to_kn(word, field, size_n, bits)
    kk, nn = np.indices((size_k, size_n))
    assert np.array_equal(k, kk) and np.array_equal(n, nn)


@pytest.mark.parametrize("bits", [4, 8])
def test_coordinates_agree_with_describe_position(bits):
    rng = np.random.default_rng()
    size_k, size_n = 64, 192
    for k, n in zip(rng.integers(0, size_k, 10), rng.integers(0, size_n, 10)):
        d = mt.describe_position(int(k), int(n), size_n, bits)
        c = rtile.coordinates_of(d["word"], d["field"], size_n, bits)
        for key in ("lane", "subblock", "half", "fragment_element", "k", "n", "tile"):
            assert int(c[key]) == d[key], key


def test_every_render_returns_a_figure():
    mw, _ = random_marlin_weight(32, 64, "u4b8", -1)
    figures = [
        render.render_mma_fragment(), render.render_subblocks(), render.render_lane_words(4),
        render.render_lane_words(8), render.render_field_interleave(4), render.render_field_interleave(8),
        render.render_layout("u4b8", 32, 128, "lane", 3, 100), render.render_layout("fe4m3fn", 16, 64, "field"),
        render.render_gptq_packing(4), render.render_gptq_packing(8, 8, 4), render.render_awq_packing(4),
        render.render_awq_packing(8, 1, 8), render.render_scale_permutation(64, 5),
        render.render_scale_permutation(32), render.render_fp8_bit_move(), render.render_block_fp8_word(256, 128, 77),
        render.render_block_fp8_scale_map(256, 256, 3), render.render_gate_up_fusion(128, 64),
        render.render_act_order(64, 16),
    ]
    for fig in figures:
        assert isinstance(fig, Figure) and fig.axes


@pytest.mark.parametrize("fmt,bits", [("u4b8", 4), ("u8b128", 8), ("fe4m3fn", 8)])
def test_position_path_names_the_mapped_word(fmt, bits):
    rng = np.random.default_rng()
    size_k, size_n = 64, 128
    k, n = int(rng.integers(size_k)), int(rng.integers(size_n))
    html = render.position_path_html(fmt, size_k, size_n, k, n, 32)
    word, field = mt.marlin_kn_to_word_field(k, n, size_n, bits)
    assert f'data-word="{int(word)}"' in html and f'data-field="{int(field)}"' in html
    assert f"checkpoint s[{k // 32}, {n}]" in html


def test_word_sources_lists_the_codes_of_the_word():
    mw, q = random_marlin_weight(32, 128, "u4b8", -1, seed=int(np.random.default_rng().integers(1 << 30)))
    word = 77
    html = render.word_sources_html("u4b8", 32, 128, word, mw.qweight)
    cells = re.findall(r"<tr><td>(\d+)</td><td>(\d+)</td><td>(\d+)</td>.*?<td>(\d+)</td></tr>", html)
    assert len(cells) == 8
    for field, k, n, code in cells:
        assert q.codes[int(k), int(n)] == int(code)


def test_field_table_matches_spec_offsets():
    html = render.field_table_html(4)
    # docs/formats.md "Nibble interleave", 4-bit field table: (dk, dn) = (0,0) (8,0) (0,8) (8,8) (1,0) (9,0) (1,8) (9,8)
    expected = [(0, 0), (8, 0), (0, 8), (8, 8), (1, 0), (9, 0), (1, 8), (9, 8)]
    got = [(int(a), int(b)) for a, b in re.findall(r"<td>k\+(\d+)</td><td>n\+(\d+)</td>", html)]
    assert got == expected


def test_scale_lane_columns_follow_the_permutation():
    html = render.lane_scale_columns_html(64)
    assert str(SCALE_PERM_64[8:16].tolist()) in html
    assert "[1, 9, 17, 25, 33, 41, 49, 57]" in html  # lanes 4..7 own column 1 of every 8-column block
    assert str(SCALE_PERM_32[8:16].tolist()) in render.lane_scale_columns_html(32)


def test_fp8_code_table_ratio_is_the_exponent_bias():
    t = render.fp8.fp8_code_table()
    nz = t["true"] != 0
    assert t["raw"].size == 254
    assert np.array_equal(t["moved"][nz] * f8.FP8_EXPONENT_BIAS[f8.F16], t["true"][nz])


def test_gate_up_tiles_split_at_n():
    origin = render.fp8.gate_up_tiles(256, 128)
    assert origin.shape == (16, 4)
    assert np.array_equal(origin, np.repeat([[0, 0, 1, 1]], 16, axis=0))


def test_bad_inputs_raise_value_errors():
    with pytest.raises(ValueError, match="outside"):
        render.render_layout("u4b8", 32, 64, k=32, n=0)
    with pytest.raises(ValueError, match="not divisible"):
        render.render_layout("u4b8", 24, 64)
    with pytest.raises(ValueError, match="64 or 32"):
        render.render_scale_permutation(16)
    with pytest.raises(ValueError, match="outside"):
        render.word_sources_html("u8b128", 16, 64, 256)
    with pytest.raises(ValueError, match="unknown weight type"):
        render.render_layout("int3", 16, 64)
    with pytest.raises(ValueError, match="color_by"):
        render.render_layout("u4b8", 16, 64, color_by="rainbow")


def test_quantization_errors_on_random_weights_order_types():
    rng = np.random.default_rng()
    w = {"random": rng.standard_normal((256, 64)).astype(np.float32)}
    rows = render.quantization_errors(w)
    err = {(r["type"], r["group_size"]): r["rel_error"] for r in rows}
    assert err[("u8b128", 128)] < err[("u4b8", 128)]
    assert err[("u4b8", 32)] < err[("u4b8", -1)]
    assert isinstance(render.render_error_chart(rows), Figure)


def test_expert_stack_table_lists_offsets():
    from workbench import ops
    from workbench.formats.packing import pack_cols, pack_rows

    rng = np.random.default_rng()
    k, n, e = 64, 64, 3
    qweights = [pack_rows(rng.integers(0, 16, (k, n), dtype=np.uint8), 4) for _ in range(e)]
    scales = [rng.random((1, n)).astype(np.float16) for _ in range(e)]
    qzeros = [pack_cols(np.full((1, n), 7, dtype=np.uint8), 4) for _ in range(e)]
    mw = ops.stack_gptq_experts_to_marlin(qweights, scales, qzeros, 4, -1, k, n)
    html = render.expert_stack_html(mw)
    stride = k // 16 * n * 2
    assert f"0, {stride}, {2 * stride}" in html
    assert isinstance(render.render_expert_stack(mw), Figure)


def test_layout_explorer_keeps_positions_consistent():
    from workbench.explorer import IndexMapInspector, LayoutExplorer

    ex = LayoutExplorer(size_k=16, size_n=64, k=3, n=10, dpi=30)
    word, field = mt.marlin_kn_to_word_field(3, 10, 64, 4)
    assert (ex.word.value, ex.field.value) == (word, field)
    ex.word.value = 100
    assert mt.marlin_kn_to_word_field(ex.k.value, ex.n.value, 64, 4) == (100, ex.field.value)
    assert 'data-word="100"' in ex.path.value
    ex.fmt.value = "u8b128"
    assert ex.word.max == 255 and ex.field.max == 3
    ex.size_k.value = 16
    assert ex.group_size.options == (-1,)
    insp = IndexMapInspector(size_k=128, size_n=64, dpi=30)
    insp.which.value = "block-FP8 word sources"
    assert insp.index.max == 128 // 16 * 4 * 64 - 1
    assert "byte 3" in insp.info.value


def test_microscale_groups_run_along_k_of_the_marlin_weight():
    """A (K, N) weight made of exact MXFP4 values — an E2M1 value times one power of two per 32 consecutive k of a
    column — survives MXFP4 exactly; its transpose (groups along N) does not."""
    from workbench.formats import microscale as ms
    from workbench.render.accuracy import quantized_reference

    rng = np.random.default_rng()
    size_k, size_n = 64, 64
    codes = rng.integers(0, 16, (size_k, size_n), dtype=np.uint8)
    codes[::32] = 7  # every group holds a ±6, so the OCP rule picks exactly the group's power of two
    exponents = np.repeat(rng.integers(-6, 6, (size_k // 32, size_n)), 32, axis=0)
    w = np.ldexp(ms.e2m1_to_float32(codes), exponents).astype(np.float32)
    assert np.array_equal(quantized_reference(w, "mxfp4", 32), w)
    assert not np.array_equal(quantized_reference(np.ascontiguousarray(w.T), "mxfp4", 32), w.T)
    with pytest.raises(ValueError, match="group_size = 32 is not nvfp4's 16"):
        quantized_reference(w, "nvfp4", 32)


def test_output_errors_on_random_weights():
    rng = np.random.default_rng()
    w = {"random": rng.standard_normal((256, 128)).astype(np.float32)}
    rows = render.output_errors(w, seed=int(rng.integers(1 << 30)))
    err = {r["type"]: r for r in rows if r["type"] in ("nvfp4", "mxfp4", "mxfp8", "u8b128")}
    for key in ("rel_error", "out_error"):
        assert err["u8b128"][key] < err["mxfp8"][key] < err["nvfp4"][key] < err["mxfp4"][key]
    for r in rows:  # isotropic activations: output error is the weight error in expectation (64 rows: within 10 %)
        assert abs(r["out_error"] / r["rel_error"] - 1) < 0.10, r
    assert "mean output error" in render.output_errors_html(rows)
    assert len(render.render_output_error_chart(rows).axes) == 2
