"""The text page in Debian's Chromium: first view drawn, β slider redraws, token masks, effects."""
from __future__ import annotations

from tests.browser.conftest import plot_data, screenshot

HEATMAP = "#heatmap.js-plotly-plot"


def wait_for_heatmap(page):
    page.wait_for_function(
        "sel => { const el = document.querySelector(sel); return el && el.data && el.data.length && el.data[0].z; }",
        arg=HEATMAP, timeout=60_000,
    )


def set_slider(page, value):
    page.eval_on_selector("#beta-slider", "(el, v) => { el.value = v; el.dispatchEvent(new Event('input', {bubbles: true})); }", value)


def test_opens_with_the_example_drawn(page, page_log, live_server):
    page.goto(live_server + "/#m=minilm")
    wait_for_heatmap(page)
    z = plot_data(page, HEATMAP)
    n = len(z)
    assert n > 5 and all(abs(sum(row) - 1) < 1e-3 for row in z)
    tokens = page.locator("#token-strip .tok")
    assert tokens.count() == n
    assert page.locator("#modelview canvas").count() == 6 * 12
    assert page.locator("#headview svg line").count() > 0
    screenshot(page, "text-first-view")
    page_log.check()


def test_beta_slider_redraws_in_view_and_run_mode(page, page_log, live_server):
    page.goto(live_server + "/#m=minilm")
    wait_for_heatmap(page)
    before = plot_data(page, HEATMAP)
    page.select_option("#mode-select", "view")
    set_slider(page, "2")  # β = 100 β₀: rows close to one-hot
    page.wait_for_function("(sel) => Math.max(...document.querySelector(sel).data[0].z[1]) > 0.9", arg=HEATMAP)
    sharp = plot_data(page, HEATMAP)
    assert sharp != before
    assert all(max(row) > 0.9 for row in sharp)

    page.select_option("#mode-select", "run")
    set_slider(page, "-3")  # β = β₀/1000: nearly uniform, computed by the model this time
    page.wait_for_function("(sel) => { const z = document.querySelector(sel).data[0].z; return Math.max(...z[0]) < 1.5 / z.length; }",
                           arg=HEATMAP, timeout=30_000)
    page.wait_for_selector("#hidden-cosine-plot .scatterlayer .trace", timeout=30_000)
    assert "β" in page.inner_text("#beta-readout")
    screenshot(page, "text-beta-run-mode")
    page_log.check()


def test_clicking_a_token_masks_it_as_a_key(page, page_log, live_server):
    page.goto(live_server + "/#m=minilm")
    wait_for_heatmap(page)
    page.locator("#token-strip .tok").nth(3).click()
    page.wait_for_function("(sel) => document.querySelector(sel).data[0].z.every(row => row[3] === 0)", arg=HEATMAP, timeout=30_000)
    z = plot_data(page, HEATMAP)
    assert all(abs(sum(row) - 1) < 1e-3 for row in z)
    assert "masked" in page.locator("#token-strip .tok").nth(3).get_attribute("class")
    page.wait_for_function("() => document.querySelector('#output-effect').textContent.includes('cosine')", timeout=30_000)
    screenshot(page, "text-masked-key")
    page_log.check()


def test_a_512_token_text_draws_without_errors(page, page_log, live_server):
    """Long inputs once overflowed the call stack (Math.max over 262k values): the page must still draw."""
    from urllib.parse import quote

    text = " ".join(["the cat sat on a mat and"] * 120)  # far past the model's 512 tokens
    page.goto(f"{live_server}/#m=minilm&t={quote(text)}")
    page.wait_for_function("() => { const el = document.querySelector('#heatmap'); "
                           "return el && el.data && el.data[0] && el.data[0].z && el.data[0].z.length === 512; }",
                           timeout=90_000)
    page.wait_for_function("() => document.querySelector('#status').textContent.includes('truncated')", timeout=30_000)
    screenshot(page, "text-512-tokens")
    page_log.check()
