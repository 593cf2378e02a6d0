"""Local and global layers on the text page (issue 29), in Debian's Chromium: a tiny random Gemma 3 (tests/tiny_models.py:
layer 0 local with a window of 8, layer 1 global; no download) served as an operator's model with full_map_tokens
lowered to 8, so that a sentence is a long input. The layer picker and the model view's rows name each layer's kind;
the long overview's title does too; on the local layer the overview, an exact window and the row plot draw the band's
edge (key i − 8) and the window is exactly 0 left of it; the global layer draws no edge and reaches past it."""
from __future__ import annotations

import json
import shutil
from urllib.parse import quote

import pytest

from tests.browser.conftest import screenshot, serve_app
from tests.tiny_models import build_text_model

TEXT = ("the cat sat on the mat because it was tired , the dog ran on the street . a big red car did not cross "
        "the small blue house , it was the capital of france")
OVERVIEW = "() => document.getElementById('heatmap').dataset.atlas === 'overview'"


@pytest.fixture(scope="module")
def gemma3_server(tmp_path_factory):
    folder = build_text_model("gemma3", tmp_path_factory.mktemp("models") / "tiny-gemma3")
    # a weights folder where a tiny Gemma 3 stands in for a prepared gemma3-270m: listed from its files, loaded on
    # first use (the real default models are not there: this server serves the tiny ones only)
    weights = tmp_path_factory.mktemp("weights")
    shutil.copytree(folder, weights / "gemma3-270m")
    (weights / "gemma3-270m" / "prepared.json").write_text(json.dumps({"source": "test", "licence": "test"}))
    yield from serve_app({"ATTNLAB_EXTRA_MODELS": json.dumps({"tiny-gemma3": str(folder)}),
                          "ATTNLAB_DEFAULT_MODELS": '["tiny-gemma3"]', "ATTNLAB_FULL_MAP_TOKENS": "8",
                          "ATTNLAB_OVERVIEW_BLOCKS": "12", "ATTNLAB_WEIGHTS_DIR": str(weights)},
                         "browser-server-gemma3.log")


def _band(page, selector="#heatmap"):
    return page.eval_on_selector(selector, "el => (el.layout.shapes || []).filter(s => s.name === 'band')")


def test_layer_kinds_and_the_window_band(page, page_log, gemma3_server):
    page.goto(f"{gemma3_server}/#m=tiny-gemma3&t={quote(TEXT)}&l=0&h=0")
    page.wait_for_function(OVERVIEW, timeout=120_000)
    n = page.locator("#token-strip .tok").count()
    assert n > 3 * 8  # a long input, several windows long
    options = page.eval_on_selector_all("#layer-select option", "els => els.map(e => e.textContent)")
    assert options == ["layer 0 · local 8", "layer 1 · global"]
    assert page.eval_on_selector("#heatmap", "el => el.layout.title.text").startswith("overview · layer 0 · local 8, head 0")
    assert page.text_content("#heatmap-title").startswith("layer 0 · local 8, head 0")
    page.wait_for_function("() => document.querySelectorAll('#modelview .axis').length >= 6", timeout=60_000)
    rows = page.eval_on_selector_all("#modelview .axis", "els => els.map(e => [e.textContent, e.title])")
    labels = {text: title for text, title in rows if text.startswith("L")}
    assert set(labels) == {"L0 ℓ", "L1 g"} and "window 8" in labels["L0 ℓ"] and "global" in labels["L1 g"]

    # the band's edge on the local layer's overview: the line key = query − 8 across the map
    (edge,) = _band(page)
    assert edge["x1"] - edge["x0"] == pytest.approx(edge["y1"] - edge["y0"]) and edge["y0"] - edge["x0"] == pytest.approx(8)
    # an exact window of the last rows over the first keys: its edge drawn, P exactly 0 left of it
    page.evaluate(f"""() => Plotly.relayout('heatmap', {{'xaxis.range[0]': 0, 'xaxis.range[1]': {n},
                                                      'yaxis.range[0]': {n}, 'yaxis.range[1]': {n - 12}}})""")
    page.wait_for_function("() => document.getElementById('heatmap').dataset.atlas?.startsWith('window')", timeout=60_000)
    window = page.eval_on_selector("#heatmap", "el => ({z: el.data[0].z, x: Array.from(el.data[0].x), y: Array.from(el.data[0].y)})")
    (edge,) = _band(page)
    for i, row in zip(window["y"], window["z"]):
        for j, p in zip(window["x"], row):
            if j <= i - 8:
                assert p == 0, (i, j, p)
        assert sum(p for j, p in zip(window["x"], row) if j > i - 8) == pytest.approx(1, abs=1e-3)
    assert edge["x0"] - edge["y0"] == pytest.approx(-8 + 0.5)  # between key i − 8 and i − 7, cells centred on indices
    # the last row over every key: a vertical edge at key n − 1 − 8 (+½), and the note under the title
    page.evaluate(f"() => document.getElementById('heatmap').emit('plotly_click', {{points: [{{y: {n - 1}.2, x: 3}}]}})")
    page.wait_for_function("() => (document.getElementById('atlas-row').data || []).length === 1", timeout=60_000)
    (row_edge,) = _band(page, "#atlas-row")
    assert row_edge["x0"] == pytest.approx(n - 1 - 8 + 0.5)
    assert "outside the 8-token window" in page.text_content("#atlas-row-title")
    screenshot(page, "local-global-01-local")

    # the global layer: named so, no edge, and its last row reaches keys a window behind
    page.select_option("#layer-select", "1")
    page.wait_for_function("() => document.getElementById('heatmap').layout.title.text.includes('layer 1 · global')",
                           timeout=60_000)
    page.wait_for_function("() => document.getElementById('heatmap').dataset.atlas?.startsWith('window')", timeout=60_000)
    assert _band(page) == []
    window = page.eval_on_selector("#heatmap", "el => ({z: el.data[0].z, x: Array.from(el.data[0].x), y: Array.from(el.data[0].y)})")
    far = sum(p for j, p in zip(window["x"], window["z"][-1]) if j <= window["y"][-1] - 8)
    assert far > 0
    page.evaluate(f"() => document.getElementById('heatmap').emit('plotly_click', {{points: [{{y: {n - 1}.2, x: 3}}]}})")
    page.wait_for_function("() => document.getElementById('atlas-row-title').textContent.startsWith('query')", timeout=60_000)
    page.wait_for_timeout(300)
    assert _band(page, "#atlas-row") == [] and "window" not in page.text_content("#atlas-row-title")
    screenshot(page, "local-global-02-global")
    page_log.check()


def test_a_listed_model_shows_its_parity_after_its_first_run(page, page_log, gemma3_server):
    """gemma3-270m here is listed from its files (no parity: it was not loaded); its first run loads and probes it,
    and the page then shows the probe's parity badge."""
    page.goto(f"{gemma3_server}/#m=gemma3-270m&t={quote('the cat sat on the mat')}")
    page.wait_for_function("() => document.getElementById('model-select').value === 'gemma3-270m'", timeout=60_000)
    page.wait_for_function("() => /tokens/.test(document.getElementById('status').textContent)", timeout=120_000)
    page.wait_for_selector("#parity-badge:not([hidden])", timeout=60_000)
    assert page.text_content("#parity-badge").startswith("parity ")
    assert page.eval_on_selector_all("#layer-select option", "els => els.map(e => e.textContent)") == [
        "layer 0 · local 8", "layer 1 · global"]
    page_log.check()
