"""The "why?" panel of the text page (static/js/views/why.js) on the real smollm2-135m, in Debian's Chromium: on 40
random words repeated, click the induction head L18 H6's cell from a second-repeat word i to j = i − 39, press
"why?", and the panel draws the parts matrix, the two marginals (the key side led by the previous-token head L16 H0)
and the expansion of L16 H0 as chips whose first is the word before j. Its screenshot is the README's."""
from __future__ import annotations

from urllib.parse import quote

from tests.browser.conftest import SCREENSHOTS, screenshot
from tests.browser.test_lm_page import wait_idle
from tests.browser.test_text_page import wait_for_heatmap
from tests.integration.helpers import SMOLLM2

REPEAT, QUERY = 40, 60
KEY = QUERY - REPEAT + 1


def repeated_words() -> str:
    """40 seeded random lower-case words, each one smollm2 token with its leading space, written twice: 80 tokens."""
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2)
    words: list[str] = []
    for i in torch.randperm(40000, generator=torch.Generator().manual_seed(0)).tolist():
        word = tokenizer.decode([i])
        if (i >= 1000 and word.startswith(" ") and word[1:].isalpha() and word[1:].islower() and len(word) > 3
                and tokenizer(word)["input_ids"] == [i] and word not in words):
            words.append(word)
        if len(words) == REPEAT:
            break
    return "".join(words) * 2


def test_why_panel_explains_the_induction_head(page, page_log, live_server):
    text = repeated_words()
    page.goto(f"{live_server}/#m=smollm2-135m&l=18&h=6&t={quote(text)}")
    wait_for_heatmap(page)
    page.wait_for_function("() => /layer 18, head 6/.test(document.getElementById('heatmap-title').textContent)",
                           timeout=120_000)
    wait_idle(page)
    page.evaluate("([i, j]) => document.getElementById('heatmap').emit('plotly_click', {points: [{pointIndex: [i, j]}]})",
                  [QUERY, KEY])
    assert page.is_visible("#why-offer")
    page.click("#why-button")
    page.wait_for_function("() => { const el = document.getElementById('why-key-bars'); return el.data && el.data.length; }",
                           timeout=120_000)
    status = page.text_content("#why-status")
    assert "sum to" in status and "score" in status
    matrix = page.eval_on_selector("#why-matrix", "el => ({z: el.data[0].z, x: el.data[0].x, y: el.data[0].y})")
    assert "L16.H0" in matrix["x"] and len(matrix["z"]) == len(matrix["y"])
    # the key side's bars, largest |total| first from the top (drawn bottom-up), are led by the previous-token head
    bars = page.eval_on_selector("#why-key-bars", "el => ({x: el.data[0].x, y: el.data[0].y})")
    assert bars["y"][-1] == "L16.H0", bars
    chips = page.eval_on_selector_all("#why-expanded .why-expanded", "rows => rows.map(r => r.textContent)")
    previous = next(row for row in chips if row.startswith("L16.H0"))
    first = page.eval_on_selector("#why-expanded .why-expanded .why-source", "el => el.textContent")
    assert previous and first.startswith(f"{KEY - 1} (j-1):"), (chips, first)
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.add_style_tag(content=".topbar { position: static !important; }")  # the sticky bar would cover the panel
    page.locator("#why-panel").screenshot(path=str(SCREENSHOTS / "why-panel.png"))
    screenshot(page, "why-page")
    page_log.check()
