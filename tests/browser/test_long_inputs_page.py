"""Long inputs on the text page (issue 20), in Debian's Chromium with the real smollm2-135m: a part of the shipped long
sample opens with its overview (full_map_tokens lowered to 64 so that a few hundred tokens are "long" on this CPU),
a zoom loads an exact window with token labels, a clicked query row is drawn over every key, and the retrieval view
names the head that puts the most attention on a span."""
from __future__ import annotations

from pathlib import Path
from urllib.parse import quote

import pytest

from tests.browser.conftest import screenshot, serve_app

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def long_server():
    yield from serve_app({"ATTNLAB_FULL_MAP_TOKENS": "64", "ATTNLAB_DEFAULT_MODELS": '["smollm2-135m"]'},
                         log_name="browser-long-server.log")


def test_long_sample_overview_zoom_row_and_retrieval(page, page_log, long_server):
    sample = (ROOT / "static" / "samples" / "long-sample.txt").read_text()
    text = sample[:1200]  # about 300 tokens, with the fact about the key near the start
    page.goto(f"{long_server}/#m=smollm2-135m&t={quote(text)}")
    page.wait_for_function("() => document.getElementById('heatmap').dataset.atlas === 'overview'", timeout=300_000)
    overview = page.eval_on_selector("#heatmap", "el => ({z: el.data[0].z, note: document.getElementById('atlas-note').textContent})")
    assert len(overview["z"]) > 8 and "over full_map_tokens" in overview["note"]
    page.wait_for_function("() => document.getElementById('lm-output').dataset.top !== undefined", timeout=60_000)
    screenshot(page, "long-01-overview")

    # zoom to a window narrow enough for token labels: exact P from the server, causal zeros above the diagonal
    page.evaluate("""() => Plotly.relayout('heatmap', {'xaxis.range[0]': 10, 'xaxis.range[1]': 50,
                                                      'yaxis.range[0]': 60, 'yaxis.range[1]': 20})""")
    page.wait_for_function("() => document.getElementById('heatmap').dataset.atlas === 'window-labels'", timeout=60_000)
    window = page.eval_on_selector("#heatmap", """el => ({z: el.data[0].z, x: Array.from(el.data[0].x), y: Array.from(el.data[0].y),
                                                           ticks: el.layout.xaxis.ticktext})""")
    assert window["x"][0] == 10 and window["x"][-1] == 49 and window["y"][0] == 20 and window["y"][-1] == 59
    for i, row in zip(window["y"], window["z"]):
        assert all(p == 0 for j, p in zip(window["x"], row) if j > i)
    assert window["ticks"] and window["ticks"][0].startswith("10:")
    screenshot(page, "long-02-window")
    page.locator("#heatmap").screenshot(path=str(ROOT / "artifacts" / "screenshots" / "long-window-heatmap.png"))

    # a query row over every key: sums to 1 over the whole context
    page.evaluate("() => document.getElementById('heatmap').emit('plotly_click', {points: [{y: 200.2, x: 3}]})")
    page.wait_for_function("() => (document.getElementById('atlas-row').data || []).length > 0", timeout=60_000)
    row = page.eval_on_selector("#atlas-row", "el => Array.from(el.data[0].y)")
    assert abs(sum(row) - 1) < 1e-3 and all(p == 0 for p in row[201:])

    # the retrieval view: attention mass per layer × head on the fact's span, from the last token
    page.select_option("#atlas-row-scope", "layer")
    page.fill("#atlas-span-from", "40")
    page.fill("#atlas-span-to", "70")
    page.click("#atlas-span-go")
    page.wait_for_function("() => document.getElementById('atlas-retrieval').dataset.best", timeout=60_000)
    best = page.eval_on_selector("#atlas-retrieval", "el => JSON.parse(el.dataset.best)")
    mass = page.eval_on_selector("#atlas-retrieval", "el => el.data[0].z")
    assert 0 < best["mass"] <= 1 and best["mass"] == max(max(r) for r in mass)
    screenshot(page, "long-03-row-retrieval")
    page.locator("#atlas-panel").screenshot(path=str(ROOT / "artifacts" / "screenshots" / "long-atlas-panel.png"))
    assert not page_log.errors, page_log.errors
