"""The notebooks are committed executed: nbval never compares a cell that has no stored execution (tooling.md)."""
from __future__ import annotations

import json
import pathlib

import pytest

NOTEBOOKS = pathlib.Path(__file__).resolve().parents[2] / "notebooks"
EXPECTED = ["00_tour", "01_gptq_awq_packing", "02_marlin_tile", "03_scales_zero_points", "04_fp8_block_fp8",
            "05_act_order_moe", "06_accuracy", "07_performance", "08_registers_teaching_kernel", "09_pytorch",
            "10_microscaling", "explorer"]
# the teaching notebooks: every figure fingerprinted, exercises at the end (07 draws measured results, which change
# with every benchmark run: its model figure is fingerprinted, its last cell checks the measured ones; 09 shows the
# torch surface, not a format)
TEACHING = [name for name in EXPECTED if name not in ("07_performance", "09_pytorch", "explorer")]
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
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


@pytest.mark.parametrize("name", TEACHING)
def test_every_figure_is_fingerprinted_in_its_cell(name):
    """nbval does not compare images: each cell that shows a figure asserts the hash of the data it draws."""
    for c in _cells(name):
        if any("image/png" in o.get("data", {}) for o in c["outputs"]):
            assert "assert_fingerprint(" in "".join(c["source"]), f"{name}: a figure without a fingerprint"


@pytest.mark.parametrize("name", EXPECTED)
def test_every_widget_cell_is_followed_by_an_assertion_on_its_state(name):
    """Widget outputs are ignored by nbval (and not compared at all): the next cell must assert what they show."""
    cells = _cells(name)
    for i, c in enumerate(cells):
        if any(WIDGET_VIEW in o.get("data", {}) for o in c["outputs"]):
            assert "".join(c["source"]).splitlines()[0].strip() == IGNORE
            assert i + 1 < len(cells) and "assert " in "".join(cells[i + 1]["source"]), \
                f"{name}: widget cell {i} has no assertion after it"
            text = [o["data"].get("text/plain", "") for o in c["outputs"] if WIDGET_VIEW in o.get("data", {})]
            assert all("VBox(" not in "".join(t) for t in text), f"{name}: widget cell {i} shows a VBox repr"


@pytest.mark.parametrize("name", TEACHING)
def test_teaching_notebooks_end_with_checked_exercises(name):
    nb = json.loads((NOTEBOOKS / f"{name}.ipynb").read_text())
    headings = [i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "markdown"
                and "".join(c["source"]).startswith("## Exercise")]
    assert len(headings) == 1, f"{name}: one Exercise section"
    exercises = [c for c in nb["cells"][headings[0]:] if c["cell_type"] == "code" and "check(" in "".join(c["source"])]
    assert 2 <= len(exercises) <= 4, f"{name}: {len(exercises)} exercises"
    solution = nb["cells"][-1]
    assert "check_solution" in "".join(solution["source"]) and solution["metadata"]["jupyter"]["source_hidden"]
    assert "assert all(f.ok for f in feedback)" in "".join(solution["source"])


@pytest.mark.parametrize("name", EXPECTED)
def test_no_maintainers_asides_in_teaching_text(name):
    text = "\n".join("".join(c["source"]) for c in json.loads((NOTEBOOKS / f"{name}.ipynb").read_text())["cells"])
    for aside in ("spec §", "round 1", "round 2", "NOTES_gemm", "warp step"):
        assert aside not in text, f"{name} mentions {aside!r}"
