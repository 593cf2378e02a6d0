"""Quick clicks are never lost (issue 28, item 7): clicks fired faster than a run answers each change the page's
state at once, and the last request carries every mask (requests may coalesce). On /image four patch clicks 150 ms
apart masked only 2 patches; the same holds for token clicks on the text and speech pages."""
from __future__ import annotations

import json
import re

import pytest
from playwright.sync_api import TimeoutError as PlaywrightTimeout

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


def click_chips(page, selector, indices):
    """Human clicks on the chips `selector`[data-index=i], GAP_MS apart; what #mask-list / the chosen list read at once."""
    for i in indices:
        box = None
        while box is None:  # None while the page rebuilds the strip: look again
            box = page.locator(f"{selector}[data-index='{i}']").bounding_box()
        human_click(page, box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
        page.wait_for_timeout(GAP_MS - HOLD_MS)


def test_text_token_mask_clicks_150ms_apart(page, page_log, live_server):
    bodies = record_requests(page, "/api/text/attention")
    page.goto(live_server + "/#m=minilm")
    page.wait_for_function("() => /tokens/.test(document.getElementById('status').textContent)", timeout=120_000)
    picks = [1, 3, 5, 7, 2, 6]
    readouts = []
    for i in picks:
        click_chips(page, "#token-strip .tok", [i])
        readouts.append(page.text_content("#mask-list"))
    assert [len(re.findall(r"\b\d+:", text)) for text in readouts] == list(range(1, len(picks) + 1)), readouts
    page.wait_for_timeout(500)  # past any coalescing of changes into one request
    page.wait_for_function("() => /tokens/.test(document.getElementById('status').textContent)", timeout=120_000)
    assert masked_tokens(bodies[-1]) == sorted(picks), bodies[-1]["interventions"]
    assert sorted(int(i) for i in page.eval_on_selector_all("#token-strip .tok.masked", "els => els.map(e => e.dataset.index)")) == sorted(picks)
    page_log.check()


def test_speech_query_picks_150ms_apart_and_across_a_redraw(page, page_log, live_server):
    """The speech page's token clicks: decoder tokens chosen for a query perturbation that is on (each click re-runs);
    six 150 ms apart, then one whose button is held while a response is drawn (the chips were rebuilt under it)."""
    bodies = record_requests(page, "/api/audio/attention")
    page.goto(f"{live_server}/audio?sample")
    page.wait_for_function("() => document.body.dataset.ready === '1'", timeout=300_000)
    page.select_option("#perturb-target", "queries")
    page.click("#perturb-apply")
    views = page.get_attribute("body", "data-views")
    page.wait_for_function(f"() => document.body.dataset.views !== '{views}'", timeout=300_000)
    picks = [3, 5, 7, 9, 11, 13]
    readouts = []
    for i in picks:
        click_chips(page, "#perturb-tokens .tok", [i])
        readouts.append(page.text_content("#perturb-chosen"))
    assert [len(re.findall(r"\b\d+:", text)) for text in readouts] == list(range(1, len(picks) + 1)), readouts

    # press on token 15 while the run for the six picks is on its way (it starts 150 ms after the last click and
    # takes seconds), hold until it is drawn, release: still a click. (Under a quick server the run may be drawn
    # before the press; the click is then an ordinary one.)
    box = page.locator("#perturb-tokens .tok[data-index='15']").bounding_box()
    page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    views = page.get_attribute("body", "data-views")
    page.mouse.down()
    try:
        page.wait_for_function(f"() => document.body.dataset.views !== '{views}'", timeout=60_000)
    except PlaywrightTimeout:
        pass
    page.mouse.up()
    picks.append(15)
    assert len(re.findall(r"\b\d+:", page.text_content("#perturb-chosen"))) == len(picks), page.text_content("#perturb-chosen")
    page.wait_for_timeout(500)  # past the page's 150 ms coalescing of changes into one request
    page.wait_for_function("() => document.getElementById('status').textContent.includes('active')", timeout=300_000)
    runs = [b for b in bodies if b["interventions"]]  # (the page's second request, without interventions, is "before")
    last = [iv for iv in runs[-1]["interventions"] if iv["op"] == "perturb_queries"]
    assert last and sorted(last[0]["tokens"]) == sorted(picks), runs[-1]["interventions"]
    page_log.check()
