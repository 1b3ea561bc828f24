"""An exercise and the fixed explorer flow in a real browser (JupyterLab + headless Chromium, driven by Playwright).

1. Opens a copy of notebooks/01_gptq_awq_packing.ipynb, runs it, answers one exercise wrongly and then rightly by
   rewriting the exercise cell, and checks the checker's feedback each time.
2. Opens a copy of notebooks/explorer.ipynb, runs it, sets K = 128, types k = 100, picks group size 32 and
   shrinks K to 16: the explorer must show the word of the clamped position and no error.
Screenshots go to artifacts/ (git-ignored).
"""
from __future__ import annotations

import json
import os

from workbench.formats.marlin_tile import marlin_kn_to_word_field

ARTIFACTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "artifacts")
KERNEL_IDLE = ("() => { const w = window.jupyterapp.shell.currentWidget;"
               " return w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel"
               " && w.sessionContext.session.kernel.status === 'idle'; }")


def _open_and_run(page, base, token, name):
    page.goto(f"{base}/lab/tree/{name}?token={token}")
    page.wait_for_function("window.jupyterapp !== undefined", timeout=60_000)
    page.wait_for_selector(".jp-NotebookPanel .jp-Notebook", timeout=60_000)
    page.wait_for_function(KERNEL_IDLE, timeout=60_000)
    page.evaluate("window.jupyterapp.commands.execute('notebook:run-all-cells')")


def _run_cell_with_source(page, index: int, source: str) -> None:
    """Replace cell ``index``'s source through JupyterLab's model (no typing: no auto-closed brackets) and run it."""
    page.evaluate(
        "([i, src]) => { const nb = window.jupyterapp.shell.currentWidget.content;"
        " nb.widgets[i].model.sharedModel.setSource(src); nb.activeCellIndex = i; }", [index, source])
    page.evaluate("window.jupyterapp.commands.execute('notebook:run-cell')")


def _feedback_of(page, index: int, previous: str = "") -> str:
    page.wait_for_function(
        "([i, old]) => { const c = window.jupyterapp.shell.currentWidget.content.widgets[i].node"
        ".querySelector('.wb-feedback'); return c && c.innerText !== old; }", arg=[index, previous], timeout=60_000)
    return page.evaluate(
        "(i) => window.jupyterapp.shell.currentWidget.content.widgets[i].node.querySelector('.wb-feedback').innerText",
        index)


def test_an_exercise_gives_feedback_in_the_browser(jupyter_lab, copy_notebook, chromium):
    from playwright.sync_api import sync_playwright

    base, token, root = jupyter_lab
    executable, args = chromium
    name = copy_notebook("01_gptq_awq_packing.ipynb", root)
    cells = json.loads((root / name).read_text())["cells"]
    index = next(i for i, c in enumerate(cells) if 'check("01.decode"' in "".join(c["source"]))
    os.makedirs(ARTIFACTS, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable, args=args, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            _open_and_run(page, base, token, name)
            first = _feedback_of(page, index)
            assert first == "✗ 01.decode: not answered yet: replace the placeholder with your answer", first
            page.wait_for_function(KERNEL_IDLE, timeout=90_000)
            _run_cell_with_source(page, index, 'check("01.decode", [8, 7, 6, 5, 4, 3, 2, 1])')
            wrong = _feedback_of(page, index, first)
            assert wrong.startswith("✗ 01.decode: reversed"), wrong
            _run_cell_with_source(page, index, 'check("01.decode", [1, 2, 3, 4, 5, 6, 7, 8])')
            right = _feedback_of(page, index, wrong)
            assert right == "✓ 01.decode: correct", right
            page.screenshot(path=os.path.join(ARTIFACTS, "exercise_feedback.png"), full_page=False)
        finally:
            browser.close()


def _word_text(page) -> str:
    return page.locator(".wb-layout-explorer .wb-word").first.inner_text()


def _wait_for_word(page, k: int, n: int, size_n: int = 128) -> str:
    """Wait until the explorer names the word of (k, n) (every change is a kernel round trip); returns the text."""
    word, field = marlin_kn_to_word_field(k, n, size_n, 4)
    expected = f"word {int(word)}, field {int(field)}"
    page.wait_for_function(
        "(want) => { const e = document.querySelector('.wb-layout-explorer .wb-word');"
        " return e && e.innerText === want; }", arg=expected, timeout=30_000)
    return _word_text(page)


def _wait_for_path(page, text: str) -> None:
    page.wait_for_function(
        "(t) => { const e = document.querySelector('.wb-layout-explorer .wb-path');"
        " return e && e.innerText.includes(t); }", arg=text, timeout=30_000)


def test_shrinking_k_under_a_group_size_keeps_the_explorer_consistent(jupyter_lab, copy_notebook, chromium):
    from playwright.sync_api import sync_playwright

    base, token, root = jupyter_lab
    executable, args = chromium
    name = copy_notebook("explorer.ipynb", root)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable, args=args, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1500, "height": 1100})
            _open_and_run(page, base, token, name)
            page.wait_for_selector(".wb-layout-explorer .wb-word", timeout=90_000)
            dropdowns = page.locator(".wb-layout-explorer .widget-dropdown select")  # format, K, N, group, colour
            # run-all ends at the notebook's last cell and JupyterLab leaves cells out of view unrendered: bring the
            # first explorer back before reading it
            page.locator(".wb-layout-explorer").first.scroll_into_view_if_needed()
            _wait_for_word(page, 5, 70)  # the notebook opens at (k=5, n=70), K=32, N=128
            dropdowns.nth(1).select_option(label="128")
            _wait_for_path(page, "K=128 N=128 group_size=-1")  # the k slider now reaches 127
            readout = page.locator(".wb-layout-explorer .widget-slider .widget-readout").first  # k, typed in
            readout.click()
            page.keyboard.press("Control+A")
            page.keyboard.type("100")
            page.keyboard.press("Enter")
            _wait_for_word(page, 100, 70)
            dropdowns.nth(3).select_option(label="32")
            _wait_for_path(page, "K=128 N=128 group_size=32")
            dropdowns.nth(1).select_option(label="16")  # K = 16: k clamps to 15, the group size falls back to -1
            _wait_for_path(page, "K=16 N=128 group_size=-1")
            _wait_for_word(page, 15, 70)
            assert page.locator(".wb-layout-explorer .wb-error").count() == 0
            assert "(k=15, n=70)" in page.locator(".wb-layout-explorer .wb-path").first.inner_text()
            page.locator(".wb-layout-explorer").first.screenshot(
                path=os.path.join(ARTIFACTS, "layout_explorer_shrunk_k.png"))
        finally:
            browser.close()
