"""The notebooks are committed executed: nbval never compares a cell that has no stored execution (tooling.md)."""
from __future__ import annotations

import json
import pathlib

import pytest

NOTEBOOKS = pathlib.Path(__file__).resolve().parents[2] / "notebooks"
EXPECTED = ["00_tour", "01_gptq_awq_packing", "02_marlin_tile", "03_scales_zero_points", "04_fp8_block_fp8",
            "05_act_order_moe", "06_accuracy", "07_performance", "explorer"]
IGNORE = "# NBVAL_IGNORE_OUTPUT"


def _cells(name: str) -> list[dict]:
    return [c for c in json.loads((NOTEBOOKS / f"{name}.ipynb").read_text())["cells"] if c["cell_type"] == "code"]


def test_the_numbered_notebooks_exist():
    assert sorted(p.stem for p in NOTEBOOKS.glob("*.ipynb")) == EXPECTED


@pytest.mark.parametrize("name", EXPECTED)
def test_every_code_cell_was_executed_in_order_without_errors(name):
    cells = _cells(name)
    counts = [c["execution_count"] for c in cells]
    assert None not in counts, f"{name}: unexecuted cells would never be compared by nbval"
    assert counts == list(range(1, len(cells) + 1)), f"{name}: executed out of order: {counts}"
    for c in cells:
        assert all(o["output_type"] != "error" for o in c["outputs"]), f"{name}: a stored error output"
        assert all(o.get("name") != "stderr" for o in c["outputs"]), f"{name}: stderr differs between machines"


@pytest.mark.parametrize("name", EXPECTED)
def test_ignored_cells_are_few_and_facts_are_asserted(name):
    """An ignored cell's facts must be checked elsewhere: most cells assert something, and at most half are ignored."""
    cells = _cells(name)
    sources = ["".join(c["source"]) for c in cells]
    ignored = sum(s.splitlines()[0].strip() == IGNORE for s in sources if s)
    assert ignored <= max(1, len(cells) // 2)
    assert any("assert " in s for s in sources), f"{name} asserts nothing"
