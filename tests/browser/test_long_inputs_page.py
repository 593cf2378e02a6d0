"""Long inputs on the text page (issue 20), in Debian's Chromium with the real smollm2-135m: a part of the shipped long
sample opens with its overview (full_map_tokens lowered to 64 so that a few hundred tokens are "long" on this CPU),
a zoom loads an exact window with token labels, a clicked query row is drawn over every key, and the retrieval view
names the head that puts the most attention on a span."""
from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import quote

import pytest

from tests.browser.conftest import SERVER_PIDS, screenshot, serve_app

pytestmark = pytest.mark.slow  # a smollm2-135m server of its own and ~300-token views

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def long_server():
    # request_timeout_s raised: the cost estimate learns the model's speed from its own runs, and on a shared, loaded
    # 2-core machine a whole-sample first view measured so slow that the next request for the same (cached) run was
    # refused with 413 (the estimate is made before the cache is consulted)
    yield from serve_app({"ATTNLAB_FULL_MAP_TOKENS": "64", "ATTNLAB_DEFAULT_MODELS": '["smollm2-135m"]',
                          "ATTNLAB_REQUEST_TIMEOUT_S": "600"}, log_name="browser-long-server.log")


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
    outline = page.eval_on_selector("#atlas-retrieval", "el => el.layout.shapes[0]")
    assert (outline["x0"] + 0.5, outline["y0"] + 0.5) == (best["head"], best["layer"])  # the strongest head outlined
    screenshot(page, "long-03-row-retrieval")
    page.locator("#atlas-panel").screenshot(path=str(ROOT / "artifacts" / "screenshots" / "long-atlas-panel.png"))
    # a click on a retrieval cell shows that head: its overview (the same run: no new model run)
    page.evaluate(f"() => document.getElementById('atlas-retrieval').emit('plotly_click', {{points: [{{x: {best['head']}, y: {best['layer']}}}]}})")
    page.wait_for_function(f"() => document.getElementById('heatmap').layout.title.text.includes('layer {best['layer']}, head {best['head']}')",
                           timeout=60_000)
    assert page.input_value("#layer-select") == str(best["layer"]) and page.input_value("#head-select") == str(best["head"])

    # the continuation of a long input streams as for a short one (a few hundred tokens: the generate cost estimate
    # refuses thousands of prompt tokens on this loaded CPU, see the report of issue 20)
    page.fill("#max-new-tokens", "3")
    page.click("#generate-button")
    page.wait_for_function("() => ['done', 'error', 'stopped'].includes(document.getElementById('continuation').dataset.state)",
                           timeout=300_000)
    assert page.get_attribute("#continuation", "data-state") == "done", page.text_content("#status")
    assert page.locator("#continuation-base .gen-tok").count() == 3

    # the window's rows' entropy over all keys, beside it and in the entropy panel
    page.evaluate("""() => Plotly.relayout('heatmap', {'xaxis.range[0]': 10, 'xaxis.range[1]': 50,
                                                      'yaxis.range[0]': 60, 'yaxis.range[1]': 20})""")
    page.wait_for_function("() => document.getElementById('heatmap').dataset.atlas === 'window-labels'", timeout=60_000)
    strip = page.eval_on_selector("#heatmap", "el => ({x: Array.from(el.data[1].x), y: Array.from(el.data[1].y), axis: el.data[1].xaxis})")
    assert strip["axis"] == "x2" and strip["y"] == list(range(20, 60)) and all(h > 0 for h in strip["x"])
    assert page.eval_on_selector("#entropy-plot", "el => JSON.parse(el.dataset.rows)") == [20, 60]
    assert page.eval_on_selector("#entropy-plot", "el => Array.from(el.data[0].y)") == strip["x"]

    # an intervention on a long input (key 15 masked): the page runs a compare, the response names the run without it,
    # and a window can show P̂ − P, on a diverging scale symmetric around 0 (the masked key loses, the others gain)
    assert page.is_hidden("#atlas-show-box")
    page.locator("#token-strip .tok[data-index='15']").click()
    page.wait_for_function("() => !document.getElementById('atlas-show-box').hidden", timeout=300_000)
    # the compare keeps the zoomed window (issue 27); double-click's autorange goes back to the overview
    page.wait_for_function("() => document.getElementById('heatmap').dataset.atlas === 'window-labels'", timeout=60_000)
    page.evaluate("() => Plotly.relayout('heatmap', {'xaxis.autorange': true, 'yaxis.autorange': true})")
    page.wait_for_function("() => document.getElementById('heatmap').dataset.atlas === 'overview'", timeout=60_000)
    page.select_option("#atlas-show", "diff")
    # the overview shows P̂ − P too (the two runs' overviews subtracted), on the same diverging scale
    page.wait_for_function("() => document.getElementById('heatmap').dataset.show === 'diff'"
                           " && document.getElementById('heatmap').dataset.atlas === 'overview'", timeout=60_000)
    overview = page.eval_on_selector("#heatmap", """el => ({z: el.data[0].z.flat(), zmid: el.data[0].zmid,
        title: el.layout.title.text})""")
    assert overview["zmid"] == 0 and "P̂ − P" in overview["title"] and "zoom for" not in overview["title"]
    assert min(overview["z"]) < -1e-4 and max(overview["z"]) > 1e-4  # the masked key's blocks lose, others gain
    page.locator("#heatmap").screenshot(path=str(ROOT / "artifacts" / "screenshots" / "long-overview-difference.png"))
    page.evaluate("""() => Plotly.relayout('heatmap', {'xaxis.range[0]': 10, 'xaxis.range[1]': 50,
                                                      'yaxis.range[0]': 60, 'yaxis.range[1]': 20})""")
    page.wait_for_function("() => document.getElementById('heatmap').dataset.show === 'diff'"
                           " && document.getElementById('heatmap').dataset.atlas === 'window-labels'", timeout=60_000)
    diff = page.eval_on_selector("#heatmap", """el => ({z: el.data[0].z, zmin: el.data[0].zmin, zmax: el.data[0].zmax,
        zmid: el.data[0].zmid, scale: el.data[0].colorscale, lines: el.data.length, title: el.layout.title.text,
        maxAbs: Number(el.dataset.maxAbs)})""")
    values = [v for row in diff["z"] for v in row]
    assert min(values) < -1e-4 and max(values) > 1e-4  # both signs
    assert all(row[15 - 10] < 0 for row in diff["z"])  # every query row (20..59) lost its attention to key 15
    assert diff["zmid"] == 0 and diff["zmin"] == -diff["zmax"] == -diff["maxAbs"] and diff["scale"] == "RdBu"
    assert diff["lines"] == 4 and "P̂ − P" in diff["title"]  # the grey forbidden cells; the entropy of both runs' rows
    screenshot(page, "long-06-window-difference")
    page.locator("#heatmap").screenshot(path=str(ROOT / "artifacts" / "screenshots" / "long-window-difference.png"))
    assert not page_log.errors, page_log.errors




def _server_cpu_seconds(url: str) -> float:
    """utime + stime of the server process serving `url` (this test's own server, started by serve_app)."""
    fields = Path(f"/proc/{SERVER_PIDS[url]}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
PROGRESS_SHOWN = "() => !document.getElementById('run-progress').hidden && Number(document.getElementById('run-progress').dataset.progress) >= 1"


def test_whole_sample_progress_panels_head_view_and_view_beta(page, page_log, long_server):
    """The whole ~3,000-token sample: layer progress while it runs, then the overview and the panels that work at any
    length (model view, head summaries, received over the context, next token); a zoomed window's head view; view-mode
    β re-fetches the shown window at that β (the server re-normalises, no model run)."""
    sample = (ROOT / "static" / "samples" / "long-sample.txt").read_text()
    page.goto(f"{long_server}/#m=smollm2-135m&t={quote(sample)}")
    page.wait_for_function(PROGRESS_SHOWN, timeout=300_000)
    bar = page.eval_on_selector("#run-progress", "el => ({text: el.textContent, total: Number(el.dataset.total)})")
    assert bar["total"] == 30 and "of 30" in bar["text"]  # smollm2-135m's 30 layers
    screenshot(page, "long-04-progress")
    page.wait_for_function("() => document.getElementById('heatmap').dataset.atlas === 'overview'", timeout=600_000)
    assert page.is_hidden("#run-progress")
    n = page.evaluate("() => document.getElementById('heatmap').data[0].z.length")
    assert n > 8
    page.wait_for_function("() => document.getElementById('received-plot').dataset.n", timeout=60_000)
    received = page.eval_on_selector("#received-plot", "el => ({n: Number(el.dataset.n), y: Array.from(el.data[0].y), top: Number(el.dataset.top)})")
    assert received["n"] > 2500 and abs(sum(received["y"]) - 1) < 1e-3
    assert received["y"][received["top"]] == max(received["y"])
    assert page.locator("#modelview canvas").count() == 30 * 9  # every layer × head's thumbnail
    assert page.eval_on_selector("#summary-entropy", "el => (el.data || []).length") > 0
    assert page.eval_on_selector("#lm-output", "el => el.dataset.top") != ""
    assert "full_map_tokens" in page.text_content("#headview") or "zoom" in page.text_content("#headview")

    # a window: exact P with labels, and the head view of that window
    page.evaluate("""() => Plotly.relayout('heatmap', {'xaxis.range[0]': 2860, 'xaxis.range[1]': 2900,
                                                      'yaxis.range[0]': 2920, 'yaxis.range[1]': 2880})""")
    page.wait_for_function("() => document.getElementById('heatmap').dataset.atlas === 'window-labels'", timeout=60_000)
    before = page.eval_on_selector("#heatmap", "el => el.data[0].z")
    assert page.eval_on_selector("#headview", "el => JSON.parse(el.dataset.window || 'null')") == {"rows": [2880, 2920], "cols": [2860, 2900]}
    assert page.locator("#headview svg line").count() > 0

    # view-mode β: the same window, re-normalised by the server at the new β
    page.select_option("#mode-select", "view")
    page.evaluate("() => { const s = document.getElementById('beta-slider'); s.value = '0.6'; s.dispatchEvent(new Event('input')); }")
    page.wait_for_function("() => document.getElementById('heatmap').dataset.beta", timeout=60_000)
    page.wait_for_function("() => document.getElementById('heatmap').dataset.atlas === 'window-labels'", timeout=60_000)
    after = page.eval_on_selector("#heatmap", "el => ({z: el.data[0].z, beta: Number(el.dataset.beta), title: el.layout.title.text})")
    assert len(after["z"]) == len(before) and "view β" in after["title"]
    assert after["beta"] > 0.125  # 10^0.6 × β₀ (β₀ = 1/8 for head_dim 64)
    changed = max(abs(a - b) for ra, rb in zip(after["z"], before) for a, b in zip(ra, rb))
    assert changed > 1e-3, "the window did not change with β"
    # sharper at a larger β: each row's largest share grows (the causal zeros stay zero)
    assert sum(max(r) for r in after["z"]) > sum(max(r) for r in before)
    screenshot(page, "long-05-window-view-beta")
    page.locator("#heatmap").screenshot(path=str(ROOT / "artifacts" / "screenshots" / "long-window-view-beta.png"))
    # the colour menu names the scale the overview and windows are drawn on (log, per row or linear: issue 28)
    assert not page.is_disabled("#zscale") and page.get_attribute("#heatmap", "data-scale") == page.input_value("#zscale")

    assert not page_log.errors, page_log.errors


def test_cancel_stops_a_long_run(page, page_log, long_server):
    """Cancel while a long first view runs: the fetch is aborted, the page says so, and the server stops the run at its
    next layer (its log says after how many layers) instead of finishing its 30."""
    sample = (ROOT / "static" / "samples" / "long-sample.txt").read_text()
    page.goto(f"{long_server}/#m=smollm2-135m&t={quote(sample[:600])}")
    page.wait_for_function("() => document.getElementById('heatmap').dataset.atlas === 'overview'", timeout=300_000)
    page.fill("#text-input", sample[:9000] + " Cancel this one.")  # not cached: a fresh run
    page.click("#run-button")
    page.wait_for_function(PROGRESS_SHOWN, timeout=300_000)
    busy_before = _server_cpu_seconds(long_server)
    page.wait_for_timeout(2000)
    busy_rate = (_server_cpu_seconds(long_server) - busy_before) / 2  # CPU seconds per second while the run works
    shown = page.eval_on_selector("#run-progress", "el => Number(el.dataset.progress)")
    assert shown < 25, f"the run was nearly done ({shown} of 30 layers): cancelling it proves little"
    page.click("#run-cancel")
    page.wait_for_function("() => document.getElementById('status').textContent.startsWith('cancelled')", timeout=10_000)
    assert "of 30" in page.text_content("#status")
    assert page.is_hidden("#run-progress")
    assert page.eval_on_selector("#heatmap", "el => el.dataset.atlas") == "overview"  # the previous input stays
    page.wait_for_timeout(1500)  # the layer in progress ends; the next layer's check stops the run
    after = _server_cpu_seconds(long_server)
    page.wait_for_timeout(3000)
    spent = _server_cpu_seconds(long_server) - after
    print(f"\nrunning: {busy_rate:.2f} CPU-s/s; in the 3 s after Cancel (+1.5 s): {spent:.2f} CPU-s")
    # the server's share of a machine that two busy test workers share: 0.27 CPU-s/s was seen while it worked
    assert busy_rate > 0.15, "the run was not working: the test proves nothing"
    assert spent < 0.25 * busy_rate * 3, (spent, busy_rate)  # it would have kept working for seconds more
    assert not page_log.errors, page_log.errors
