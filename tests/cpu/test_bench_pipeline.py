"""bench/bench_pipeline.py on a few MB: it writes its checkpoint, measures in fresh processes, checks that every
configuration wrote the same bytes, and writes results in the shared schema (bench/results, HELPERS)."""
from __future__ import annotations

import importlib.util
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bench():
    spec = importlib.util.spec_from_file_location("bench_pipeline", os.path.join(ROOT, "bench", "bench_pipeline.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_bench_writes_rows_in_the_results_schema(tmp_path):
    out = tmp_path / "pipeline.json"
    assert _bench().main(["--tiny", "--no-gpu", "--workers", "1", "--write-modes", "mmap", "--workdir", str(tmp_path / "work"),
                          "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["schema"] == 1 and result["family"] == "pipeline"
    meta = result["meta"]
    for key in ("gpu", "sms", "date", "commit", "torch", "cupy", "nvcc", "ceilings", "method", "peers"):
        assert key in meta
    assert meta["ceilings"]["copy_gbs"] > 0 and meta["ceilings"]["read_gbs"] > 0
    (row,) = result["rows"]
    assert row["method"] == "ours" and row["path"] == "cpu" and row["workers"] == 1 and row["identical_to_first"]
    assert row["us"] > 0 and row["gbs"] > 0 and row["source_bytes"] == meta["method"]["sources"]["cpu"]["source_bytes"]
    assert 0 < row["peak_rss_bytes"] - row["baseline_rss_bytes"] <= row["memory_bound_bytes"]
    assert row["write_mode"] == "mmap" and set(row["stage_s"]) == {"read", "convert", "write"}
    assert not os.listdir(tmp_path / "work")  # the checkpoint and outputs are removed
