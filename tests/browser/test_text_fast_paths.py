"""The text page's fast paths (issue 7): the first heatmap is painted before plotly.js is evaluated, a
slider repaints only the heatmap's cells until input settles, and run-mode drags ask for the slice only."""
from __future__ import annotations

import json

from tests.browser.conftest import plot_data, screenshot
from tests.browser.test_text_page import HEATMAP, set_slider, wait_for_heatmap

CELLS = "#heatmap > canvas.fast-cells"
# Mean colour of the fast-paint canvas (its pixels are one per cell), to tell two paints apart.
CANVAS_MEAN = """sel => { const c = document.querySelector(sel); const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
                          let s = 0; for (let i = 0; i < d.length; i += 4) s += d[i] + 2 * d[i + 1] + 3 * d[i + 2]; return s / (d.length / 4); }"""


def test_first_heatmap_is_painted_before_plotly_arrives(page, page_log, live_server):
    page.goto(live_server + "/#m=minilm")
    wait_for_heatmap(page)
    first, figure = (page.evaluate(f"() => performance.getEntriesByName('{m}')[0].startTime")
                     for m in ("attnlab:first-heatmap", "attnlab:heatmap-figure"))
    assert first < figure
    assert page.evaluate(f"() => document.querySelector('{CELLS}').hidden")  # Plotly's drawing replaced it
    assert page.locator("#heatmap .preview-note").count() == 0
    page_log.check()


def test_view_mode_drag_repaints_cells_then_plotly_catches_up(page, page_log, live_server):
    page.goto(live_server + "/#m=minilm")
    wait_for_heatmap(page)
    page.select_option("#mode-select", "view")
    page.wait_for_timeout(500)
    before = plot_data(page, HEATMAP)
    page.evaluate("() => { window.__events = []; document.querySelector('#heatmap').addEventListener('attnlab:heatmap', e => window.__events.push(e.detail)); }")
    set_slider(page, "1.5")
    # Right after the move: the cells canvas shows the new map, Plotly still holds the old one.
    assert page.evaluate("() => window.__events.at(-1).painted") is True
    assert not page.evaluate(f"() => document.querySelector('{CELLS}').hidden")
    sharp_mean = page.evaluate(CANVAS_MEAN, CELLS)
    assert plot_data(page, HEATMAP) == before
    set_slider(page, "-1.5")
    assert page.evaluate(CANVAS_MEAN, CELLS) != sharp_mean
    # Once input settles, Plotly shows the re-normalised map and the canvas is hidden again.
    page.wait_for_function(f"() => document.querySelector('{CELLS}').hidden", timeout=10_000)
    flat = plot_data(page, HEATMAP)
    assert flat != before and all(abs(sum(row) - 1) < 1e-3 for row in flat)
    assert max(max(row) for row in flat) < max(max(row) for row in before)  # β = β₀/31.6: flatter rows
    page_log.check()


def test_run_mode_drag_asks_for_the_slice_then_the_full_view(page, page_log, live_server):
    page.goto(live_server + "/#m=minilm")
    wait_for_heatmap(page)
    bodies = []
    page.on("request", lambda r: bodies.append(json.loads(r.post_data)) if r.url.endswith("/api/text/attention") else None)
    set_slider(page, "0.8")
    page.wait_for_function("() => document.getElementById('heatmap-title').textContent.includes('β = ')", timeout=10_000)
    page.wait_for_function(f"() => document.querySelector('{CELLS}') && document.querySelector('{CELLS}').hidden", timeout=30_000)
    page.wait_for_function("() => document.querySelector('#effect-summary').textContent.includes('TV at')", timeout=30_000)
    drag, full = bodies[0], bodies[-1]
    assert drag["interventions"][0]["op"] == "temperature"
    assert drag["compare"] is False and drag["thumbnail_size"] is None  # the slice only while dragging
    assert full["compare"] is True and full["include_base"] is True and full["interventions"] == drag["interventions"]
    assert all(b["encoding"] == "f32" for b in bodies)
    screenshot(page, "text-run-mode-settled")
    page_log.check()


def test_colour_scale_follows_the_maps_max_or_stays_at_one(page, page_log, live_server):
    """Long inputs spread attention thin: by default the colour scale tops at the map's max, not at 1."""
    from urllib.parse import quote

    page.goto(f"{live_server}/#m=minilm&t={quote(' '.join(['the cat sat on a mat and'] * 12))}")
    wait_for_heatmap(page)
    top = "() => document.querySelector('#heatmap')._fullData[0].zmax"
    z = plot_data(page, HEATMAP)
    assert page.evaluate(top) == max(max(row) for row in z) and page.evaluate(top) < 1  # the max of the drawn numbers
    page.select_option("#zscale", "fixed")
    page.wait_for_function(f"() => ({top})() === 1", timeout=10_000)
    screenshot(page, "text-colour-scale-fixed")
    page_log.check()
