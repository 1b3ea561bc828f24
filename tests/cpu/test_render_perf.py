"""The performance pictures of notebooks 00 and 07, headless: the byte model, the loads per lane from the index maps,
and the measured charts on a small results document in the schema of bench/results."""
from __future__ import annotations

import numpy as np
import pytest
from matplotlib.figure import Figure

from workbench.formats import marlin_tile as mt
from workbench.formats.packing import pack_rows
from workbench.render import perf, roofline
from workbench.render.fingerprint import figure_fingerprint

from bench_fixture import gemm_doc, repack_doc


def test_bytes_follow_the_format():
    n, k = 4096, 4096
    assert roofline.weight_bytes(n, k, "fp16") == 2 * n * k
    assert roofline.weight_bytes(n, k, "u4b8", 128) == n * k // 2 + (k // 128) * n * 2
    assert roofline.weight_bytes(n, k, "u4", 128) == n * k // 2 + (k // 128) * n * 2 + (k // 128) * n // 2
    assert roofline.weight_bytes(n, k, "fe4m3fn", -1) == n * k + n * 2
    assert roofline.gemm_bytes(n, k, 3, "u8b128", 128) == roofline.weight_bytes(n, k, "u8b128", 128) + 2 * 3 * (n + k)
    with pytest.raises(ValueError, match="unknown weight type 'int3'"):
        roofline.weight_bytes(n, k, "int3")


def test_ideal_speedup_is_near_four_at_decode_and_falls_with_m():
    s1 = roofline.ideal_speedup(8192, 8192, 1, "u4b8", 128)
    assert 3.85 < s1 < 4.0  # the g128 scales cost 1/32 of the 4-bit codes
    assert roofline.ideal_speedup(8192, 8192, 256, "u4b8", 128) < s1
    # compute-bound at large M: with a peak in the model both formats hit it, and the speedup goes to 1
    assert roofline.ideal_speedup(8192, 8192, 8192, "u4b8", 128, read_gbs=4000, peak_tflops=500) == pytest.approx(1.0)


def test_lane_elements_are_the_lanes_b_fragments():
    """Every element of a 16×64 tile is fed by exactly one lane (the maps are a partition of the tile)."""
    owner = np.full((mt.TILE_K, mt.TILE_N), -1)
    for lane in range(mt.LANES):
        k, n = roofline.lane_elements(lane)
        assert (owner[k, n] == -1).all()
        owner[k, n] = lane
    assert (owner >= 0).all()


@pytest.mark.parametrize("bits", [4, 8])
def test_element_bytes_agree_with_the_packed_arrays(bits):
    """The byte offsets the load count uses are where pack_rows / the Marlin repack really put each element."""
    rng = np.random.default_rng()
    codes = rng.integers(0, 2 ** bits, size=(mt.TILE_K, mt.TILE_N))
    k, n = np.meshgrid(np.arange(mt.TILE_K), np.arange(mt.TILE_N), indexing="ij")
    for layout, packed, field_of in (
            ("gptq", pack_rows(codes, bits), lambda: k % (32 // bits)),
            ("marlin", mt.marlin_repack_codes(codes, bits),
             lambda: mt.marlin_kn_to_word_field(k, n, mt.TILE_N, bits)[1])):
        words = packed.view(np.uint32).ravel()[roofline.element_byte(layout, k, n, bits) // 4]
        assert np.array_equal((words >> (bits * field_of()).astype(np.uint32)) & (2 ** bits - 1), codes), layout


def test_load_counts_per_lane():
    four, eight = roofline.load_counts(4), roofline.load_counts(8)
    assert (four["marlin"] == 1).all() and (eight["marlin"] == 2).all()  # one (two) 16-byte loads: the whole share
    assert (four["gptq"] == 16).all() and (four["awq"] == 8).all() and (eight["gptq"] == 16).all()
    assert "<td>100.0%</td>" in roofline.load_table_html()._repr_html_()
    with pytest.raises(ValueError, match="unknown layout 'exl2'"):
        roofline.element_byte("exl2", 0, 0, 4)


def test_model_figures_draw_the_model():
    fig = roofline.render_traffic_model(4096, 4096, (1, 16))
    u8, u4, four = fig.axes[1].lines  # the two formats, then the 4× line
    assert np.allclose(four.get_ydata(), 4.0) and u4.get_label() == "u4b8 g128"
    assert np.allclose(u4.get_ydata(), [roofline.ideal_speedup(4096, 4096, m, "u4b8", 128) for m in (1, 16)])
    lanes = roofline.render_lane_loads(4, lane=5)
    assert "lane 5: 1 loads" in lanes.axes[2].get_title()
    assert figure_fingerprint(lanes) != figure_fingerprint(roofline.render_lane_loads(4, lane=6))


def test_measured_roofline_places_every_graph_cell():
    doc = gemm_doc()
    points = roofline.roofline_points(doc)
    assert len(points) == sum(r["launch"] == "graph" for r in doc["rows"])
    p = next(p for p in points if p["method"] == "ours" and p["m"] == 1 and p["wtype"] == "u4b8")
    moved = 2000.0 * 1e9 * 5e-6
    assert p["intensity"] == pytest.approx(2 * 4096 * 4096 / moved)
    assert p["tflops"] == pytest.approx(2 * 4096 * 4096 / 5e-6 / 1e12)
    doc["rows"].append(dict(doc["rows"][0], pdl=False, us=6.0))  # a variant of ours: not a point of its own
    assert roofline.roofline_points(doc) == points
    fig = roofline.render_roofline(doc)
    ax = fig.axes[0]
    assert sum(len(c.get_offsets()) for c in ax.collections) == len(points)
    assert [line.get_ydata()[0] for line in ax.lines[1:]] == [400.0, 600.0]  # the two tensor peaks


def test_speedup_against_ideal():
    doc = gemm_doc()
    doc["rows"] += [dict(r, launch="plain", us=r["us"] * 3) for r in doc["rows"] if r["method"] == "cublas"]
    (one, sixteen) = roofline.speedup_points(doc)  # against cuBLAS timed the same way, not its plain calls
    assert one["measured"] == pytest.approx(15.0 / 5.0) and sixteen["measured"] == pytest.approx(2.0)
    assert 3.5 < one["ideal"] < 4.0
    assert isinstance(roofline.render_speedup_vs_ideal(gemm_doc()), Figure)
    doc = gemm_doc()
    doc["rows"] = [r for r in doc["rows"] if r["method"] != "cublas"]
    assert roofline.speedup_points(doc) == []
    assert "no cells" in roofline.render_speedup_vs_ideal(doc).axes[0].texts[0].get_text()


def test_measured_charts_and_ratio_table():
    doc = gemm_doc()
    fig = perf.render_times(doc)
    labels = [line.get_label() for line in fig.axes[0].lines]
    assert labels == ["ours u4b8 g128 fp16", "vllm_marlin u4b8 g128 fp16", "cublas fp16", "ours u8b128 g128 fp16"]
    html = perf.ratio_summary_html(doc, split_m=8)._repr_html_()
    assert "<tr><td>u4b8 g128 fp16, graph</td><td>cublas</td><td>×3.00</td><td>×2.00</td><td>80%</td></tr>" in html
    assert "<tr><td>u8b128 g128 fp16, graph</td><td>vllm_marlin</td><td>—</td><td>—</td><td>90%</td></tr>" in html
    assert "×1.00 – ×1.20" in perf.ratio_summary_html(doc)._repr_html_()  # M = 1 and 16 together
    ratios = perf.render_ratios(doc)
    assert [ax.get_title() for ax in ratios.axes] == ["vllm_marlin time ÷ ours", "cublas time ÷ ours"]
    assert np.allclose(ratios.axes[1].lines[0].get_ydata(), [3.0, 2.0])
    repack = repack_doc()
    repack["rows"] += [dict(r, launch="plain", pct_copy=r["pct_copy"] / 2) for r in repack["rows"]]
    bars = perf.render_repack(repack).axes[0]
    assert sorted(round(p.get_width(), 6) for p in bars.patches) == [60.0, 90.0]  # the isolated calls only


def _moe_doc():
    doc = gemm_doc()
    rows = [dict(model="mixtral", experts=8, topk=2, n=14336, k=4096, m=m, wtype="u4b8", group=128, act="fp16",
                 launch="graph", method=method, us=us + m) for m in (1, 8) for method, us in (("ours", 20.0),
                                                                                            ("humming", 26.0))]
    return dict(doc, family="moe", rows=rows)


def test_notebook_07_runs_on_every_family_present_and_on_none(tmp_path, monkeypatch):
    """07's cells (magics left out) on a checkout with results for some families, then with none: nbval only ever
    runs it on the committed files, so the other case is run here."""
    import json
    import pathlib

    cells = json.loads((pathlib.Path(__file__).resolve().parents[2] / "notebooks" / "07_performance.ipynb")
                       .read_text())["cells"]
    code = ["\n".join(line for line in "".join(c["source"]).splitlines() if not line.startswith("%"))
            for c in cells if c["cell_type"] == "code"]
    (tmp_path / "pyproject.toml").write_text("")
    results = tmp_path / "bench" / "results"
    results.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    for docs in ((gemm_doc(), repack_doc(), _moe_doc()), ()):
        for path in results.glob("*.json"):
            path.unlink()
        for doc in docs:
            (results / f"{doc['family']}.json").write_text(json.dumps(doc))
        namespace = {}
        for source in code:
            exec(compile(source, "07_performance", "exec"), namespace)  # the notebook's own cells
        assert set(k for k, v in namespace["results"].items() if v is not None) == {d["family"] for d in docs}
