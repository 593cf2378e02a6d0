"""Issue 20: "dinov2-small at 896 px (4,097 tokens) opens with an overview and zooms into windows", on the image page
in Debian's Chromium with the real dinov2-small and the default limits (max_image_tokens 4,097, full_map_tokens_image
1,025). The page asks for the shown head's overview and every head's query row; the token × token map zooms into an
exact window with patch labels, and a clicked query row is drawn over all 4,097 keys.

request_timeout_s is raised for this server only: on the shared 2-core CI machine under load a 4,097-token first view
(the run and its rollout) took minutes, and the cost estimate, measured from the 224 px run, would refuse it."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.browser.conftest import screenshot, serve_app

pytestmark = pytest.mark.slow  # a dinov2-small server of its own and an 896 px image

ROOT = Path(__file__).resolve().parents[2]
SLOW_MS = 900_000


@pytest.fixture(scope="module")
def image_server():
    yield from serve_app({"ATTNLAB_DEFAULT_MODELS": '["dinov2-small"]', "ATTNLAB_REQUEST_TIMEOUT_S": "900"},
                         log_name="browser-long-image-server.log")


def test_image_at_896_px_opens_with_an_overview_and_zooms_into_a_window(page, page_log, image_server):
    page.goto(f"{image_server}/image")
    page.wait_for_function("() => /224 px · 257 tokens/.test(document.getElementById('status').textContent)",
                           timeout=SLOW_MS)
    assert page.is_hidden("#atlas-section")  # a short image: full maps, no overview
    sizes = page.eval_on_selector_all("#size-select option", "els => els.map(e => [e.value, e.textContent])")
    assert ["4", "896 px (interpolated), long: overview + windows"] in sizes, sizes

    page.select_option("#size-select", "4")
    page.wait_for_function("""() => document.getElementById('atlas-map').dataset.atlas === 'overview'
        && /896 px · 4097 tokens/.test(document.getElementById('status').textContent)""", timeout=SLOW_MS)
    overview = page.eval_on_selector("#atlas-map", "el => ({rows: el.data[0].z.length, cols: el.data[0].z[0].length})")
    assert 100 <= overview["rows"] <= 128 and overview["cols"] == overview["rows"]  # ≤ overview_blocks a side
    overlay = page.eval_on_selector("#overlay", "el => [el.data[0].z.length, el.data[0].z[0].length]")
    assert overlay == [64, 64]
    # the grid shows every layer × head from /row: 12 layers × 6 heads of 64 × 64 patches, one-cell gaps
    grid = page.eval_on_selector("#model-grid", "el => [el.data[0].z.length, el.data[0].z[0].length]")
    assert grid == [12 * 65 - 1, 6 * 65 - 1]
    assert "4,097 tokens" in page.text_content("#atlas-title")
    screenshot(page, "long-image-01-overview")

    # zoom: an exact window of P from the server, patch labels once it is narrow
    page.evaluate("""() => Plotly.relayout('atlas-map', {'xaxis.range[0]': 1, 'xaxis.range[1]': 41,
                                                         'yaxis.range[0]': 41, 'yaxis.range[1]': 1})""")
    page.wait_for_function("() => document.getElementById('atlas-map').dataset.atlas === 'window-labels'",
                           timeout=SLOW_MS)
    window = page.eval_on_selector("#atlas-map", """el => ({z: el.data[0].z.map(r => Array.from(r)), x: Array.from(el.data[0].x),
                                                           ticks: el.layout.xaxis.ticktext})""")
    assert window["x"][0] == 1 and window["x"][-1] == 40 and window["ticks"][0] == "1:p(0,0)"
    assert all(0 <= sum(row) <= 1 + 1e-5 for row in window["z"]) and max(max(r) for r in window["z"]) > 0
    page.locator("#atlas-section").screenshot(path=str(ROOT / "artifacts" / "screenshots" / "long-image-window.png"))

    # a clicked query row over all 4,097 keys sums to 1
    page.evaluate("() => document.getElementById('atlas-map').emit('plotly_click', {points: [{y: 20.2, x: 3}]})")
    page.wait_for_function("() => (document.getElementById('atlas-row').data || []).length > 0", timeout=SLOW_MS)
    row = page.eval_on_selector("#atlas-row", "el => Array.from(el.data[0].y)")
    assert len(row) == 4097 and abs(sum(row) - 1) < 1e-3
    screenshot(page, "long-image-02-window-row")
    page_log.check()
