"""Quick clicks are never lost (issue 28, item 7): clicks fired faster than a run answers each change the page's
state at once, and the last request carries every mask (requests may coalesce). On /image four patch clicks 150 ms
apart masked only 2 patches; the same holds for token clicks on the text and speech pages."""
from __future__ import annotations

import json

from tests.browser.conftest import screenshot
from tests.browser.test_image_page import wait_idle

GAP_MS = 150
HOLD_MS = 60


def record_requests(page, path):
    bodies = []
    page.on("request", lambda r: bodies.append(json.loads(r.post_data)) if r.method == "POST" and r.url.endswith(path) else None)
    return bodies


def masked_tokens(body, op="mask_keys"):
    return sorted({t for iv in body.get("interventions", []) if iv["op"] == op for t in (iv.get("tokens") or [])})


def human_click(page, x, y, hold_ms=HOLD_MS):
    """A click as a finger makes it: the button held a moment (Playwright's click releases at once)."""
    page.mouse.move(x, y, steps=2)
    page.mouse.down()
    page.wait_for_timeout(hold_ms)
    page.mouse.up()


def test_image_mask_clicks_150ms_apart(page, page_log, live_server):
    bodies = record_requests(page, "/api/image/attention")
    page.goto(f"{live_server}/image")
    page.wait_for_selector("#overlay .nsewdrag", timeout=90_000)
    wait_idle(page)
    page.select_option("#click-mode", "mask")
    wait_idle(page)
    rows, cols = page.eval_on_selector("#overlay", "el => [el.data[0].z.length, el.data[0].z[0].length]")
    box = page.locator("#overlay .nsewdrag").first.bounding_box()
    patches = [(2, 3), (5, 8), (9, 4), (12, 11), (0, 0), (7, 13)]
    readouts, crosses = [], []
    for r, c in patches:
        human_click(page, box["x"] + (c + 0.5) / cols * box["width"], box["y"] + (r + 0.5) / rows * box["height"])
        # read at once, before any answer: the readout and the crosses drawn over the photo
        readouts.append(page.text_content("#query-readout").split("masked keys: ")[-1])
        crosses.append(page.evaluate("() => document.getElementById('overlay').data.find((t) => t.marker?.symbol === 'x-thin').x.length"))
        page.wait_for_timeout(GAP_MS - HOLD_MS)
    n = len(patches)
    assert readouts == [str(k + 1) for k in range(n)], readouts
    assert crosses == list(range(1, n + 1)), crosses
    wait_idle(page)
    assert f"masked keys: {n}" in page.text_content("#query-readout")
    tokens = masked_tokens(bodies[-1])
    prefix = 1  # dinov2-small: CLS, then the patches row by row
    assert tokens == sorted(prefix + r * cols + c for r, c in patches), bodies[-1]["interventions"]
    screenshot(page, "quick-clicks-image")
    page_log.check()
