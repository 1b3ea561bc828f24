"""The benchmark charts of notebook 07, headless, on small synthetic documents in each script's schema."""
import json

from workbench.render import perf


def _gemm_doc():
    rows = []
    for m in (1, 2, 4, 8, 16, 32, 64):
        for method, us in (("cuBLAS fp16 (torch.matmul)", 10.0), ("tinygemm bf16 (W4 g128)", 2.0 * m),
                           ("marlin u4b8 g128 fp16", 5.0), ("marlin u4b8 g128 bf16", 5.0 + m / 16),
                           ("marlin fe4m3fn chan fp16", 8.0)):
            rows.append({"k": 4096, "n": 4096, "m": m, "method": method, "us": us, "gbs": 1000.0,
                         "speedup_vs_fp16": 10.0 / us})
    return {"meta": {"gpu": "TEST", "commit": "abc", "copy_gbs": 4000.0}, "rows": rows}


def test_gemm_chart_and_bars():
    doc = _gemm_doc()
    fig = perf.render_gemm_times(doc)
    assert len([ax for ax in fig.axes if ax.lines]) == 1
    html = perf.gemm_bars_html(doc)._repr_html_()
    assert "×2.00 – ×2.00" in html  # INT4 vs fp16 at M <= 16: 10 / 5
    assert "×1.25 – ×1.25" in html  # FP8: 10 / 8
    assert "<td>1, 2</td>" in html  # tinygemm (2·M µs) beats 5 + M/16 µs only at M = 1, 2
    assert "plain" not in html


def test_gemm_bars_with_plain_launches_beside():
    """bench_gemm's "(plain launch)" rows: their ranges in brackets after the programmatic ones; not in the chart."""
    doc = _gemm_doc()
    doc["rows"] += [dict(r, method=r["method"] + " (plain launch)", us=r["us"] + 1.0,
                         speedup_vs_fp16=10.0 / (r["us"] + 1.0))
                    for r in doc["rows"] if r["method"] in ("marlin u4b8 g128 fp16", "marlin fe4m3fn chan fp16")]
    html = perf.gemm_bars_html(doc)._repr_html_()
    assert "×2.00 – ×2.00 [plain ×1.67 – ×1.67]" in html and "×1.25 – ×1.25 [plain ×1.11 – ×1.11]" in html
    labels = [line.get_label() for line in perf.render_gemm_times(doc).axes[0].lines]
    assert not any("plain" in label for label in labels) and "marlin u4b8 g128 fp16" in labels


def test_repack_and_moe_charts(tmp_path):
    repack = {"rows": [{"transform": t, "shape": "64x128", "fraction_of_copy": f} for t, f in
                       (("gptq_marlin_repack u4", 0.9), ("awq_marlin_repack u4", 0.2), ("direct u4 sweep", 0.5))]}
    fig = perf.render_repack_bandwidth(repack)
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["gptq_marlin_repack u4", "awq_marlin_repack u4"]
    moe = {"rows": [{"config": "x", "experts": 8, "k": 128, "n": 128, "top_k": 2, "m": m, "method": meth,
                     "pct_copy": p} for m in (1, 8) for meth, p in (("fused", 30.0), ("batched", 5.0))]}
    assert len(perf.render_moe_bandwidth(moe).axes[0].lines) == 3  # two paths + the bar
    (tmp_path / "r.json").write_text(json.dumps(moe))
    assert perf.load_result(tmp_path, "r.json") == moe and perf.load_result(tmp_path, "missing.json") is None


def test_repack_ab_chart():
    rows = [{"shape": "8x8", "path": p, "variant": v, "fraction_of_copy": f}
            for p, v, f in (("awq u4", "old staged", 0.2), ("awq u4", "new ktpt=1", 0.85), ("awq u4", "new ktpt=2", 0.8),
                            ("act-order u4", "old staged", 0.1), ("act-order u4", "new ktpt=2", 0.26))]
    ax = perf.render_repack_ab({"rows": rows}).axes[0]
    widths = sorted(round(p.get_width(), 6) for p in ax.patches)
    assert widths == [10.0, 20.0, 26.0, 85.0]  # before and the best new shape per path


def test_ablation_chart_one_bar_per_variant_and_cell():
    rows = [{"k": 8, "n": 64, "m": m, "label": "marlin u4b8 g128 fp16", "variant": v, "us": us, "grid_kind": g}
            for m in (1, 16) for v, us in (("base", 10.0 + m), ("sinkfinish", 6.0 + m)) for g in ("policy", "aligned")]
    ax = perf.render_ablation({"rows": rows}).axes[0]
    assert sorted(round(p.get_width(), 6) for p in ax.patches) == [7.0, 11.0, 22.0, 26.0]  # policy rows only
    assert [t.get_text() for t in ax.get_yticklabels()] == ["u4b8 g128 fp16 8×64 M=1", "u4b8 g128 fp16 8×64 M=16"]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["base", "sinkfinish"]
