"""The layout explorer in a real browser: JupyterLab + headless Chromium, driven by Playwright.

The first test opens a copy of notebooks/explorer.ipynb (autosave would rewrite the original), runs every cell,
checks that the widgets rendered (no "Loading widget..."), moves the k slider with the keyboard and checks that the
highlighted word changes, and saves a screenshot under artifacts/ (git-ignored; CI keeps it). The second runs the
README's five-minute walk and opens the explorer notebook it writes, on the walk's repacked layer.
"""
from __future__ import annotations

import contextlib
import os
import re

from workbench.formats.marlin_tile import marlin_kn_to_word_field

ARTIFACTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "artifacts")


def _word_text(page) -> str:
    return page.locator(".wb-layout-explorer .wb-word").first.inner_text()


@contextlib.contextmanager
def _page(chromium, height: int):
    """A page of a headless Chromium driven by Playwright; the browser is closed on leaving."""
    from playwright.sync_api import sync_playwright

    executable, args = chromium
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable, args=args, headless=True)
        try:
            yield browser.new_page(viewport={"width": 1500, "height": height})
        finally:
            browser.close()


def _open_and_run_all(page, base: str, token: str, notebook: str) -> None:
    """Open ``notebook`` in JupyterLab, wait for its kernel, run every cell (returns without waiting for them)."""
    page.goto(f"{base}/lab/tree/{notebook}?token={token}")
    page.wait_for_function("window.jupyterapp !== undefined", timeout=60_000)
    page.wait_for_selector(".jp-NotebookPanel .jp-Notebook", timeout=60_000)
    page.wait_for_function(
        "() => { const w = window.jupyterapp.shell.currentWidget;"
        " return w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel"
        " && w.sessionContext.session.kernel.status === 'idle'; }", timeout=60_000)
    page.evaluate("window.jupyterapp.commands.execute('notebook:run-all-cells')")


def test_layout_explorer_renders_and_reacts(jupyter_lab, copy_notebook, chromium):
    base, token, root = jupyter_lab
    name = copy_notebook("explorer.ipynb", root)
    os.makedirs(ARTIFACTS, exist_ok=True)
    with _page(chromium, height=1100) as page:
        _open_and_run_all(page, base, token, name)
        page.wait_for_selector(".wb-layout-explorer .wb-word", timeout=90_000)
        page.wait_for_selector(".wb-index-inspector .wb-inspector", timeout=90_000)
        assert page.get_by_text("Loading widget...").count() == 0
        before = _word_text(page)
        assert re.fullmatch(r"word \d+, field \d+", before), before
        word, field = marlin_kn_to_word_field(5, 70, 128, 4)  # the notebook opens at (k=5, n=70), K=32, N=128
        assert before == f"word {int(word)}, field {int(field)}", before

        # move the k slider one step with the keyboard, as a person would
        handle = page.locator(".wb-layout-explorer .widget-slider .noUi-handle").first
        handle.click()
        handle.press("ArrowRight")
        page.wait_for_function(
            "(old) => { const e = document.querySelector('.wb-layout-explorer .wb-word');"
            " return e && e.innerText !== old; }", arg=before, timeout=30_000)
        after = _word_text(page)
        word, field = marlin_kn_to_word_field(6, 70, 128, 4)  # k 5 -> 6 at n = 70: a different lane's word
        assert after == f"word {int(word)}, field {int(field)}", after
        news = page.get_by_role("button", name="No", exact=True)  # JupyterLab's news opt-in toast
        if news.count():
            news.first.click()
        page.screenshot(path=os.path.join(ARTIFACTS, "layout_explorer.png"), full_page=True)
        page.locator(".wb-layout-explorer").first.screenshot(
            path=os.path.join(ARTIFACTS, "layout_explorer_widget.png"))


def test_explorer_on_the_readme_walks_repacked_layer(jupyter_lab, chromium):
    """The README's walk, run verbatim in the server's directory, then its second step: JupyterLab on the notebook
    that `workbench explore` wrote. The stored-word table must show the word the repacked checkpoint holds."""
    import readme_walk
    from workbench.explore import layer_explorer

    base, token, root = jupyter_lab
    done = readme_walk.run_walk(root)
    assert [p.returncode for p in done] == [0] * len(readme_walk.walk_commands()), done[-1].stderr
    notebook = readme_walk.walk_blocks()[1][0].split()[-1]  # "jupyter lab explore.ipynb"
    marlin_dir = readme_walk.walk_commands()[2].split("--out", 1)[1].split()[0]
    layer = readme_walk.walk_commands()[4].split("--layer", 1)[1].split()[0]
    expected = layer_explorer(root / marlin_dir, layer)  # the same object, built here: what the page must show
    os.makedirs(ARTIFACTS, exist_ok=True)
    with _page(chromium, height=1200) as page:
        _open_and_run_all(page, base, token, notebook)
        page.wait_for_selector(".wb-layer-explorer .wb-stored", timeout=90_000)
        assert page.get_by_text("Loading widget...").count() == 0
        assert layer in page.locator(".wb-layer-explorer").first.inner_text()
        stored = page.locator(".wb-layer-explorer .wb-stored").first
        e = expected.element(5, 70)  # where the explorer opens
        assert f"0x{e['value']:08x}" in stored.inner_text(), stored.inner_text()

        handle = page.locator(".wb-layer-explorer .widget-slider .noUi-handle").first  # the k slider
        handle.click()
        handle.press("ArrowRight")
        page.wait_for_function(
            "() => { const e = document.querySelector('.wb-layer-explorer .wb-stored');"
            " return e && e.innerText.includes('(k=6, n=70)'); }", timeout=30_000)
        e = expected.element(6, 70)
        assert f"0x{e['value']:08x}" in stored.inner_text(), stored.inner_text()
        page.locator(".wb-layer-explorer").first.screenshot(
            path=os.path.join(ARTIFACTS, "layer_explorer_walk.png"))
