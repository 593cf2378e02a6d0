"""The long view, third round (issue 28 items 3–4, issue 27's "keeps your place" and ETA), in Debian's Chromium with
the real smollm2-135m on a server whose full_map_tokens is 64 (a few hundred tokens are "long" on this CPU): the first
view's job shows its time left, the overview offers log and per-row colour scales and the menu says which is drawn,
a compare after an intervention re-asks the same window, row and retrieval span of the new run, and a failed
retrieval is said under the map."""
from __future__ import annotations

import json
import re
from pathlib import Path
from urllib.parse import quote

import pytest

from tests.browser.conftest import screenshot, serve_app

pytestmark = pytest.mark.slow  # a smollm2-135m server of its own and long views

ROOT = Path(__file__).resolve().parents[2]

WATCH_ETA = """document.addEventListener('DOMContentLoaded', () => {
    window.__eta = [];
    const node = document.getElementById('run-progress-eta');
    new MutationObserver(() => window.__eta.push(node.textContent)).observe(node, {childList: true, characterData: true, subtree: true});
});"""


@pytest.fixture(scope="module")
def long_server():
    yield from serve_app({"ATTNLAB_FULL_MAP_TOKENS": "64", "ATTNLAB_DEFAULT_MODELS": '["smollm2-135m"]',
                          "ATTNLAB_REQUEST_TIMEOUT_S": "600"}, log_name="browser-long-round3-server.log")


def test_long_view_scales_eta_and_keeps_its_place_across_a_compare(page, page_log, long_server):
    text = (ROOT / "static" / "samples" / "long-sample.txt").read_text()[:1200]  # about 300 tokens
    page.add_init_script(WATCH_ETA)
    page.goto(f"{long_server}/#m=smollm2-135m&t={quote(text)}")
    page.wait_for_function("() => document.getElementById('heatmap').dataset.atlas === 'overview'", timeout=300_000)
    # the first view was a job: its time left was shown while it ran (issue 27)
    etas = page.evaluate("() => window.__eta")
    assert any(re.search(r"about \d+ s left|finishing|jobs? ahead", t) for t in etas), etas

    # colour: a causal map's default is the log scale, and the overview is drawn on it (not linear under a "log" label)
    assert not page.is_disabled("#zscale") and page.input_value("#zscale") == "log"
    drawn = page.eval_on_selector("#heatmap", """el => ({scale: el.dataset.scale, stops: el.data[0].colorscale,
        zmax: el.data[0].zmax, text: el.data[0].text[1][0]})""")
    # colours at log-spaced values of P: the ramp's middle colour sits at a small fraction of the largest P
    stops = [s[0] for s in drawn["stops"]]
    assert drawn["scale"] == "log" and stops == sorted(stops) and stops[5] < 0.05 and float(drawn["text"]) > 0
    assert page.eval_on_selector("#zscale option[value='fixed']", "o => o.disabled")
    page.select_option("#zscale", "row")
    page.wait_for_function("() => document.getElementById('heatmap').dataset.scale === 'row'", timeout=30_000)
    row_max = page.eval_on_selector("#heatmap", "el => el.data[0].z.map(r => Math.max(...r))")
    assert all(m in (0, 1) for m in row_max) and max(row_max) == 1  # m / m is exactly 1

    # the controls under the map: the row plot's note on a line of its own (it ran into "the map shows" before:
    # "click a query row of the the map shows map"), number boxes sized to a few digits
    box = lambda sel: page.eval_on_selector(sel, "e => { const r = e.getBoundingClientRect(); return {top: r.top, bottom: r.bottom, width: r.width}; }")
    assert box("#atlas-row-title")["top"] >= box("#atlas-row-scope")["bottom"]
    assert all(box(f"#atlas-span-{k}")["width"] <= 90 for k in ("from", "to", "row"))

    # a window, a query row and a retrieval span
    page.evaluate("""() => Plotly.relayout('heatmap', {'xaxis.range[0]': 10, 'xaxis.range[1]': 50,
                                                      'yaxis.range[0]': 60, 'yaxis.range[1]': 20})""")
    page.wait_for_function("() => document.getElementById('heatmap').dataset.atlas === 'window-labels'", timeout=120_000)
    window = page.get_attribute("#heatmap", "data-window")
    assert page.get_attribute("#heatmap", "data-scale") == "row"
    page.evaluate("() => document.getElementById('heatmap').emit('plotly_click', {points: [{y: 200.2, x: 3}]})")
    page.wait_for_function("() => document.getElementById('atlas-row').dataset.row === '200'", timeout=120_000)
    page.fill("#atlas-span-from", "40")
    page.fill("#atlas-span-to", "70")
    page.click("#atlas-span-go")
    page.wait_for_function("() => document.getElementById('atlas-retrieval').dataset.best", timeout=120_000)
    run = page.get_attribute("#heatmap", "data-run")
    span = page.get_attribute("#atlas-retrieval", "data-span")
    assert json.loads(span) == {"row": 200, "from": 40, "to": 70}

    # an intervention (mask key 5): a compare, a new run of the same tokens; the window, row and span stay
    page.click("#token-strip .tok[data-index='5']")
    page.wait_for_function(f"""() => {{ const el = document.getElementById('heatmap');
        return el.dataset.run !== '{run}' && el.dataset.atlas === 'window-labels'; }}""", timeout=300_000)
    new_run = page.get_attribute("#heatmap", "data-run")
    assert page.get_attribute("#heatmap", "data-window") == window
    page.wait_for_function(f"""() => document.getElementById('atlas-row').dataset.run === '{new_run}'
        && document.getElementById('atlas-retrieval').dataset.run === '{new_run}'""", timeout=120_000)
    assert page.get_attribute("#atlas-row", "data-row") == "200"
    assert page.get_attribute("#atlas-retrieval", "data-span") == span
    assert page.is_visible("#atlas-row") and page.is_visible("#atlas-retrieval")
    screenshot(page, "round3-long-kept-place")

    # a retrieval the server refuses: said under the map, beside its controls
    page.route("**/row", lambda route: route.fulfill(status=404, content_type="application/json",
                                                     body=json.dumps({"detail": "no run " + new_run})))
    page.click("#atlas-span-go")
    page.wait_for_function("() => !document.getElementById('atlas-error').hidden", timeout=60_000)
    said = page.text_content("#atlas-error")
    # the server's own words (issue 38 item 5: a run never held is not "evicted from the server's cache")
    assert "retrieval" in said and "no run " + new_run in said and "evicted" not in said and "Run again" in said
    page_log.errors = [e for e in page_log.errors if "status of 404" not in e]  # the refusal this test sent
    page_log.check()
