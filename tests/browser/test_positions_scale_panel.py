"""Positions off and the 1/√d panel on the text page (minilm), in Debian's Chromium: the Positions control re-runs the
model with the op listed in the effect panel; "scores of this head" draws the histogram with the theory's curve and
the counting lines; the permutation check prints max |Δ| with positions off far below the one with positions on."""
from __future__ import annotations

import re

from tests.browser.conftest import screenshot
from tests.browser.test_lm_page import wait_idle
from tests.browser.test_text_page import wait_for_heatmap


def test_positions_control_and_the_scale_panel(page, page_log, live_server):
    page.goto(f"{live_server}/#m=minilm&l=1&h=2")
    wait_for_heatmap(page)
    wait_idle(page)
    page.click("#positions-toggle")
    page.wait_for_function("() => /positions off @ the input embeddings/.test("
                           "document.getElementById('effect-panel').textContent)", timeout=120_000)
    wait_idle(page)
    assert "positions off" in page.text_content("#effect-panel")

    page.click("#scale-button")
    page.wait_for_function("() => (document.getElementById('scale-histogram').data || []).length === 2",
                           timeout=120_000)
    bars = page.eval_on_selector("#scale-histogram", "el => el.data[0].y.reduce((a, b) => a + b, 0)")
    n_tokens = int(re.search(r"N = (\d+) tokens", page.text_content("#scale-count-maps")).group(1))
    assert bars == n_tokens**2  # an encoder: every pair
    assert "589,824 weights" in page.text_content("#scale-count-textbook")  # 4 · 384²
    assert "layer 1, head 2" in page.text_content("#scale-histogram")

    page.fill("#perm-seed", "2")
    page.click("#perm-button")
    page.wait_for_function("() => /positions on/.test(document.getElementById('perm-result').textContent)",
                           timeout=120_000)
    found = re.search(r"= (\S+) with positions off, (\S+) with positions on", page.text_content("#perm-result"))
    off, on = float(found.group(1)), float(found.group(2))
    assert off <= 1e-5 < 0.05 < on
    screenshot(page, "positions-scale-panel")
    page_log.check()
