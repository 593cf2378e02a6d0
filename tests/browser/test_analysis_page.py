"""The patching scan on the text page with the real smollm2-135m, in Debian's Chromium: run a scan of every head
(France/Paris against Italy/Rome) and watch its progress, click the best head's cell, and see the corrupted prompt's
next token move from " Rome" to " Paris"; then the logit lens and the faithfulness chart."""
from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import quote

import numpy as np
import pytest

from tests.browser.conftest import screenshot, serve_app

ROOT = Path(__file__).resolve().parents[2]

PROMPT = "The capital of France is"


def test_scan_click_a_cell_and_see_the_next_token_shift(live_server, page, page_log):
    page.goto(f"{live_server}/#m=smollm2-135m&t={quote(PROMPT)}&l=5&h=0")
    page.wait_for_function("() => !document.getElementById('patching-panel').hidden", timeout=120_000)
    assert page.is_hidden("#patch-shift")
    page.click("#patch-run")
    # progress arrives while the scan runs (270 heads in batches), then the result
    page.wait_for_function("() => Number(document.getElementById('patching-panel').dataset.progress || 0) > 0",
                           timeout=300_000)
    page.wait_for_function("() => document.getElementById('patching-panel').dataset.state === 'done'", timeout=300_000)
    assert page.eval_on_selector("#patching-panel", "e => e.dataset.progress") == "270"
    status = page.text_content("#patch-status")
    assert "best head" in status and "ρ" in status
    # click the strongest cell of the heatmap, as a user would: at its centre on the plot
    cell = page.evaluate("""() => {
        const z = document.getElementById('patch-heatmap').data[0].z;
        let best = [0, 0, -Infinity];
        z.forEach((row, l) => row.forEach((v, h) => { if (v !== null && v > best[2]) best = [l, h, v]; }));
        return {layer: best[0], head: best[1], effect: best[2], layers: z.length, heads: z[0].length};
    }""")
    # the plot area (rows L0 at the top, columns h0 on the left): the centre of the cell
    page.locator("#patch-heatmap").scroll_into_view_if_needed()
    box = page.locator("#patch-heatmap .nsewdrag").first.bounding_box()  # in the viewport's coordinates
    x = box["x"] + box["width"] * (cell["head"] + 0.5) / cell["heads"]
    y = box["y"] + box["height"] * (cell["layer"] + 0.5) / cell["layers"]
    assert cell["effect"] > 0.1
    page.mouse.click(x, y)
    page.wait_for_function("() => document.getElementById('patch-shift').dataset.state === 'done'", timeout=120_000)
    shift = page.eval_on_selector("#patch-shift", "e => ({cell: e.dataset.cell, before: e.dataset.topBefore, after: e.dataset.topAfter, kl: Number(e.dataset.kl)})")
    assert shift["cell"] == f"{cell['layer']},{cell['head']}"
    assert shift["before"] == " Rome" and shift["after"] == " Paris" and shift["kl"] > 0.1
    assert page.is_visible("#patch-shift-table")
    screenshot(page, "analysis-patching")

    page.click("#lens-run")
    page.wait_for_function("() => document.getElementById('lens-panel').dataset.state === 'done'", timeout=120_000)
    assert page.eval_on_selector("#lens-panel", "e => e.dataset.lastTop") == " Paris"
    # the value-weighted map mode of the heatmap: the first token (an attention sink) gets less of each row
    page.wait_for_function("() => document.getElementById('heatmap').data", timeout=120_000)
    sink = "() => document.getElementById('heatmap').data[0].z.slice(1).map(r => r[0]).reduce((a, b) => a + b, 0)"
    before = page.evaluate(sink)
    with page.expect_response(lambda r: r.url.endswith("/api/text/attention") and "value_norm" in (r.request.post_data or "")):
        page.select_option("#weighting-select", "value_norm")
    page.wait_for_function(f"() => ({sink})() < {before} - 0.05", timeout=60_000)
    assert "value-weighted" in page.inner_text("#heatmap-title")  # the heading says what the map is
    page.click("#faith-run")
    page.wait_for_function("() => document.getElementById('faith-panel').dataset.state === 'done'", timeout=300_000)
    assert page.eval_on_selector("#faith-panel", "e => e.dataset.best")
    page_log.check()


def test_residual_scan_click_a_cell_and_see_the_next_token_shift(live_server, page, page_log):
    """A residual-scan cell is clickable like a head cell: the patch_residual of that (layer, position) from the clean
    prompt is applied to the corrupted one. The last position after a late layer carries the answer: " Paris"."""
    page.goto(f"{live_server}/#m=smollm2-135m&t={quote(PROMPT)}&l=5&h=0")
    page.wait_for_function("() => !document.getElementById('patching-panel').hidden", timeout=120_000)
    page.select_option("#patch-scan", "residual")
    page.click("#patch-run")
    page.wait_for_function("() => document.getElementById('patching-panel').dataset.state === 'done'", timeout=300_000)
    cell = page.evaluate("""() => {
        const plot = document.getElementById('patch-heatmap'), z = plot.data[0].z;
        // the last layer's cell at the last position (effect 1: everything the unembedding reads there)
        return {layer: z.length - 1, position: z[0].length - 1, effect: z[z.length - 1][z[0].length - 1],
                layers: z.length, positions: z[0].length};
    }""")
    assert cell["effect"] > 0.9
    page.locator("#patch-heatmap").scroll_into_view_if_needed()
    box = page.locator("#patch-heatmap .nsewdrag").first.bounding_box()
    page.mouse.click(box["x"] + box["width"] * (cell["position"] + 0.5) / cell["positions"],
                     box["y"] + box["height"] * (cell["layer"] + 0.5) / cell["layers"])
    page.wait_for_function("() => document.getElementById('patch-shift').dataset.state === 'done'", timeout=120_000)
    shift = page.eval_on_selector("#patch-shift", "e => ({cell: e.dataset.cell, kind: e.dataset.kind, before: e.dataset.topBefore, after: e.dataset.topAfter, kl: Number(e.dataset.kl)})")
    assert shift["kind"] == "residual" and shift["cell"] == f"{cell['layer']},{cell['position']}"
    assert shift["before"] == " Rome" and shift["after"] == " Paris" and shift["kl"] > 0.1
    assert "residual stream after L" in page.text_content("#patch-shift-title")
    screenshot(page, "analysis-residual-patch")
    page_log.check()


@pytest.fixture(scope="module")
def long_server():
    yield from serve_app({"ATTNLAB_FULL_MAP_TOKENS": "64", "ATTNLAB_DEFAULT_MODELS": '["smollm2-135m"]'},
                         log_name="browser-long-value-server.log")


def test_value_weighting_applies_to_a_long_inputs_overview_and_windows(page, page_log, long_server):
    """Over full_map_tokens the map mode still applies: the overview is the value-weighted one, and a zoomed exact
    window is asked for and drawn value-weighted (equal to the API's window of the same run)."""
    text = (ROOT / "static" / "samples" / "long-sample.txt").read_text()[:600]  # about 150 tokens: long at 64
    page.goto(f"{long_server}/#m=smollm2-135m&t={quote(text)}")
    page.wait_for_function("() => document.getElementById('heatmap').dataset.atlas === 'overview'", timeout=300_000)
    page.select_option("#zscale", "max")  # the linear scale: the drawn z is P itself (a causal map opens on log₁₀ P)
    page.wait_for_function("() => document.getElementById('heatmap').dataset.scale === 'max'", timeout=30_000)
    sink = "() => document.getElementById('heatmap').data[0].z.map(r => r[0]).reduce((a, b) => a + b, 0)"
    before = page.evaluate(sink)
    page.select_option("#weighting-select", "value_norm")
    page.wait_for_function("() => document.getElementById('heatmap').layout.title.text.includes('value-weighted')",
                           timeout=300_000)
    assert page.evaluate(sink) < before - 0.1  # the first token's blocks (an attention sink) lose weight
    assert "value-weighted" in page.inner_text("#heatmap-title")
    with page.expect_request(lambda r: "/window" in r.url) as request:
        page.evaluate("""() => Plotly.relayout('heatmap', {'xaxis.range[0]': 0, 'xaxis.range[1]': 40,
                                                          'yaxis.range[0]': 60, 'yaxis.range[1]': 20})""")
    body = json.loads(request.value.post_data)
    assert body["weighting"] == "value_norm"
    page.wait_for_function("() => document.getElementById('heatmap').dataset.atlas === 'window-labels'", timeout=60_000)
    drawn = page.eval_on_selector("#heatmap", "el => ({z: el.data[0].z, title: el.layout.title.text})")
    assert "value-weighted" in drawn["title"]
    run_id = request.value.url.split("/api/runs/")[1].split("/")[0]
    api = page.evaluate("""async ([id, body]) => (await (await fetch(`/api/runs/${id}/window`, {method: 'POST',
        headers: {'Content-Type': 'application/json'}, body: JSON.stringify({...body, encoding: 'json'})})).json()).attention""",
                        [run_id, body])
    # the drawn window is the API's float32 numbers: equal once both are read as float32
    assert np.array_equal(np.array(api, dtype=np.float32), np.array(drawn["z"], dtype=np.float32))
    page.locator("#heatmap").screenshot(path=str(ROOT / "artifacts" / "screenshots" / "long-value-window.png"))
    page_log.check()
