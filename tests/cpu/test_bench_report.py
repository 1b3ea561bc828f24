"""bench/report.py and the results reader: schema errors name the file and key; tables hold ratios and ceilings."""
from __future__ import annotations

import copy
import importlib.util
import json
import pathlib

import pytest

from bench_fixture import gemm_doc, host_doc, repack_doc
from workbench.render import bench

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_report", ROOT / "bench" / "report.py")
report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(report)


def _write(folder: pathlib.Path, doc: dict) -> pathlib.Path:
    path = folder / f"{doc['family']}.json"
    path.write_text(json.dumps(doc))
    return path


def test_a_valid_file_loads_and_a_missing_one_is_none(tmp_path):
    _write(tmp_path, gemm_doc())
    assert bench.load_family(tmp_path, "gemm") == gemm_doc()
    assert bench.load_family(tmp_path, "moe") is None
    assert list(bench.load_results(tmp_path)) == list(bench.FAMILIES)
    with pytest.raises(ValueError, match="unknown benchmark family 'gemms'"):
        bench.load_family(tmp_path, "gemms")


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["rows"][2].pop("us"), r"gemm.json: rows\[2\] lacks the required key 'us'"),
    (lambda d: d["rows"][0].update(m="1"), r"gemm.json: rows\[0\]\['m'\] must be an integer, got '1'"),
    (lambda d: d["rows"][1].update(gbs=True), r"rows\[1\]\['gbs'\] must be a number, got True"),
    (lambda d: d["rows"][1].update(launch="eager"),
     r"rows\[1\]\['launch'\] is 'eager', not one of graph, plain, isolated"),
    (lambda d: d["rows"][0].update(us=0.0), r"rows\[0\]\['us'\] must be a positive time"),
    (lambda d: d["meta"].pop("nvcc"), r"gemm.json: meta lacks the required key 'nvcc'"),
    (lambda d: d["meta"]["ceilings"].update(read_gbs=None), r"meta\['ceilings'\]\['read_gbs'\] must be a number"),
    (lambda d: d["meta"].update(date="1 Dec 2026"), r"meta\['date'\] must be YYYY-MM-DD"),
    (lambda d: d.update(schema=2), r"schema 2; this reader knows schema 1"),
    (lambda d: d.update(family="moe"), r"holds family 'moe', expected 'gemm'"),
    (lambda d: d.pop("rows"), r"the document lacks the required key 'rows'"),
])
def test_schema_errors_name_the_file_and_the_key(tmp_path, edit, message):
    doc = gemm_doc()
    edit(doc)
    (tmp_path / "gemm.json").write_text(json.dumps(doc))
    with pytest.raises(bench.ResultsSchemaError, match=message) as info:
        bench.load_family(tmp_path, "gemm")
    assert str(tmp_path / "gemm.json") in str(info.value)


def test_null_ceilings_for_tensor_peaks_are_allowed_and_bad_json_is_named(tmp_path):
    doc = gemm_doc()
    doc["meta"]["ceilings"].update(mma_tflops=None, cublas_tflops=None)
    assert bench.validate_results(doc, "x") is doc
    cpu = host_doc()  # a CPU-only run has no bandwidth ceilings; only the GPU families must carry them
    cpu["meta"]["ceilings"] = dict.fromkeys(cpu["meta"]["ceilings"])
    assert bench.validate_results(cpu, "x") is cpu and "No device ceilings." in bench.describe_run(cpu)
    assert bench.compare_cells(cpu)[0]["pct_read"] is None
    (tmp_path / "moe.json").write_text("{not json")
    with pytest.raises(bench.ResultsSchemaError, match="moe.json: not valid JSON"):
        bench.load_family(tmp_path, "moe")


def test_cells_compare_like_for_like_and_baselines_by_shape():
    cells = bench.compare_cells(gemm_doc())
    by = {(c["row"]["m"], c["row"]["wtype"], c["row"]["launch"]): c for c in cells}
    assert len(cells) == 5
    one = by[(1, "u4b8", "graph")]
    assert one["ratios"] == {"vllm_marlin": pytest.approx(6.0 / 5.0), "cublas": pytest.approx(15.0 / 5.0)}
    assert one["pct_read"] == pytest.approx(80.0)  # 2000 of 2500 GB/s
    # plain launches of ours: no plain peer row, so the graph one is the one there is
    assert by[(1, "u4b8", "plain")]["ratios"]["cublas"] == pytest.approx(15.0 / 6.25)
    # vLLM's Marlin ran u4b8 only: no ratio for u8b128; cuBLAS is a baseline and still counts
    assert by[(1, "u8b128", "graph")]["ratios"] == {"cublas": pytest.approx(1.5)}
    assert by[(16, "u4b8", "graph")]["ratios"]["vllm_marlin"] == pytest.approx(1.0)


def test_cells_of_a_family_without_shape_keys_pair_on_the_common_identity():
    (cell,) = bench.compare_cells(host_doc())
    assert cell["ratios"] == {"vllm_marlin": pytest.approx(2.0)} and cell["pct_read"] is None


def test_report_writes_tables_between_the_markers_only(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    for doc in (gemm_doc(), repack_doc(), host_doc()):
        _write(results, doc)
    page = tmp_path / "BENCHMARKS.md"
    page.write_text(f"# Benchmarks\n\nintro\n\n{report.BEGIN}\nold tables\n{report.END}\n\n## After\n")
    assert report.main(["--results", str(results), "--page", str(page), "--check"]) == 1
    assert report.main(["--results", str(results), "--page", str(page)]) == 0
    text = page.read_text()
    assert text.startswith("# Benchmarks\n\nintro\n\n") and text.endswith(f"{report.END}\n\n## After\n")
    assert "old tables" not in text
    assert "| M | format, launch | ours µs | GB/s | % of read | × vllm_marlin | × cublas |" in text
    assert "| 1 | u4b8 g128 fp16, graph | 5.00 | 2000 | 80% | ×1.20 | ×3.00 |" in text
    assert "| 1 | u8b128 g128 fp16, graph | 10.0 | 2250 | 90% | — | ×1.50 |" in text
    assert "**down: K × N = 4096 × 4096**" in text
    assert "| gptq_marlin_repack | 64 | 128 | u4b8 | 2.00 | 1800 | 72% | 90% | ×1.50 |" in text
    assert "| call | inputs | ours µs | × vllm_marlin |" in text and "| gemm | cupy | 11.0 | ×2.00 |" in text
    assert "streaming read 2500 GB/s" in text and "vllm_marlin = vllm-project/vllm@v0.1" in text
    assert "No results for moe" in text and "No results for pipeline" in text
    assert report.main(["--results", str(results), "--page", str(page), "--check"]) == 0


def test_report_refuses_a_page_without_markers_and_a_broken_file(tmp_path, capsys):
    page = tmp_path / "BENCHMARKS.md"
    page.write_text("# Benchmarks\n")
    assert report.main(["--results", str(tmp_path), "--page", str(page)]) == 2
    assert "must hold the markers" in capsys.readouterr().err
    page.write_text(f"{report.BEGIN}\n{report.END}\n")
    doc = copy.deepcopy(gemm_doc())
    del doc["rows"][0]["layer"]
    _write(tmp_path, doc)
    assert report.main(["--results", str(tmp_path), "--page", str(page)]) == 2
    assert "rows[0] lacks the required key 'layer'" in capsys.readouterr().err
    assert page.read_text() == f"{report.BEGIN}\n{report.END}\n"  # untouched


def test_the_committed_page_has_the_markers_and_committed_results_follow_the_schema():
    report.splice((ROOT / "BENCHMARKS.md").read_text(), "")
    for family, doc in bench.load_results(ROOT / "bench" / "results").items():
        assert doc is None or doc["family"] == family


def test_report_orders_default_launch_then_variants_then_plain_and_names_variants(tmp_path):
    doc = gemm_doc()
    doc["rows"] += [dict(r, pdl=False, us=r["us"] * 1.2) for r in doc["rows"]
                    if r["method"] == "ours" and r["launch"] == "graph" and r["wtype"] == "u4b8"]
    doc["rows"].insert(0, doc["rows"].pop(1))  # a plain row first: the order must not follow the file's
    results = tmp_path / "results"
    results.mkdir()
    _write(results, doc)
    page = tmp_path / "BENCHMARKS.md"
    page.write_text(f"{report.BEGIN}\n{report.END}\n")
    assert report.main(["--results", str(results), "--page", str(page)]) == 0
    labels = [line.split(" | ")[1] for line in page.read_text().splitlines() if line.startswith("| 1 ")
              or line.startswith("| 16 ")]
    assert labels == ["u4b8 g128 fp16, graph"] * 2 + ["u4b8 g128 fp16 no-PDL, graph"] * 2 + \
        ["u4b8 g128 fp16, plain"] * 2 + ["u8b128 g128 fp16, graph"]
    assert "**K × N" not in page.read_text() and "**down: K × N = 4096 × 4096**" in page.read_text()
    assert bench.group_title("gemm", {"layer": "4096x4096", "k": 4096, "n": 4096}) == "K × N = 4096 × 4096"


def test_torch_models_tables_format_the_measured_agreement_and_the_fp16_time():
    """The decoder rows' teacher-forced agreement with eager (a record) and the fp16 nn.Linear time (a float) are
    columns of their kind's table, formatted by the render; a row without them reads "—", and a kind whose rows
    carry neither (host) gets no such column."""
    doc = host_doc()
    doc["family"] = "torch_models"
    agree = {"cos_min": 0.9999987, "max_abs": 0.00271, "logit_absmax": 2.1, "top1_equal": 0.99}
    doc["rows"] = [
        {"cell": "decoder", "wtype": "u4b8", "launch": "plain", "compiled": "no", "method": "ours", "us": 3496.2,
         "fp16_us": 3098.5},
        {"cell": "decoder", "wtype": "u4b8", "launch": "graph", "compiled": "no", "method": "ours", "us": 435.7,
         "fp16_us": 407.7, "logits_equal_eager": True, "vs_eager": dict(agree, cos_min=1.0, max_abs=0.0)},
        {"cell": "decoder", "wtype": "u4b8", "launch": "plain", "compiled": "inductor default", "method": "ours",
         "us": 2088.6, "fp16_us": 1274.9, "logits_equal_eager": False, "vs_eager": agree},
        {"cell": "host", "call": "MarlinLinear.forward", "method": "ours", "us": 18.75}]
    text = "\n".join(report.family_section("torch_models", bench.validate_results(doc, "x")))
    assert ("| wtype | launch | compiled | vs eager: logits, teacher-forced | fp16 nn.Linear µs | ours µs |"
            in text)
    assert "| u4b8 | graph | no | bitwise equal | 407.7 | 435.7 |" in text
    assert "| u4b8 | plain | inductor default | cos min 0.999999, max abs 0.0027 | 1274.9 | 2088.6 |" in text
    assert "| u4b8 | plain | no | — | 3098.5 | 3496.2 |" in text
    assert "| call | ours µs |" in text and "| MarlinLinear.forward | 18.8 |" in text
