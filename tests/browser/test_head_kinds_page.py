"""The model view coloured by a head score (issue 30 item 2, issue 29 item 3) on the real smollm2-135m in Chromium:
sink mass from the attention response, then induction from POST /api/text/head_scores with each head's label on its
cell (layer 18 head 6 labelled induction), and a click on a coloured head opens it."""
from __future__ import annotations

import json

from tests.browser.conftest import SCREENSHOTS, screenshot
from tests.browser.test_lm_page import open_prompt


def grid_cells(page) -> list[dict]:
    return page.eval_on_selector_all("#modelview canvas", """els => els.map(c => ({
        layer: Number(c.dataset.layer), head: Number(c.dataset.head), score: c.dataset.score, label: c.dataset.label,
        pixel: Array.from(c.getContext('2d').getImageData(2, 2, 1, 1).data.slice(0, 3))}))""")


def test_model_view_coloured_by_sink_mass_then_induction(page, page_log, live_server):
    open_prompt(page, live_server)
    thumbnails = grid_cells(page)
    assert len(thumbnails) == 30 * 9 and all(c["score"] is None for c in thumbnails)

    page.select_option("#modelview-colour", "sink_mass")
    page.wait_for_function("() => document.getElementById('modelview').dataset.colour === 'sink_mass'")
    sink = page.evaluate("""async () => (await (await fetch('/api/text/attention', {method: 'POST',
        headers: {'Content-Type': 'application/json'}, body: JSON.stringify({model: 'smollm2-135m',
        text: 'The capital of France is', layers: [0], heads: [0]})})).json()).sink_mass""")
    cells = grid_cells(page)
    assert len(cells) == 30 * 9
    for cell in cells:
        assert float(cell["score"]) == sink[cell["layer"]][cell["head"]]  # the server's number, as JSON gave it
    # the colour follows the score: the head with the most sink mass is drawn lighter than the one with the least
    by_score = sorted(cells, key=lambda c: float(c["score"]))
    assert sum(by_score[-1]["pixel"]) > sum(by_score[0]["pixel"])

    page.select_option("#modelview-colour", "induction")
    page.wait_for_function("() => document.getElementById('modelview').dataset.colour === 'induction'", timeout=180_000)
    scores = json.loads(page.evaluate("""async () => JSON.stringify(await (await fetch('/api/text/head_scores', {
        method: 'POST', headers: {'Content-Type': 'application/json'},
        body: JSON.stringify({model: 'smollm2-135m', text: null})})).json())"""))
    cells = {(c["layer"], c["head"]): c for c in grid_cells(page)}
    for (layer, head), cell in cells.items():
        assert float(cell["score"]) == scores["scores"]["induction"][layer][head]
        assert cell["label"] == (scores["labels"][layer][head] or "")
    assert cells[(18, 6)]["label"] == "induction" and cells[(16, 0)]["label"] == "previous_token"
    assert "thresholds" in page.inner_text("#modelview-colour-status")
    screenshot(page, "model-view-induction")
    panel = page.locator("section.panel", has=page.locator("#modelview"))
    panel.screenshot(path=str(SCREENSHOTS / "model-view-induction-panel.png"))  # the grid alone, to look at

    page.click('#modelview canvas[data-layer="18"][data-head="6"]')  # opens the head, as the thumbnails do
    page.wait_for_function("() => document.querySelector('#modelview canvas.selected')?.dataset.layer === '18'")
    selected = page.eval_on_selector("#modelview canvas.selected", "c => [c.dataset.layer, c.dataset.head]")
    assert selected == ["18", "6"]
    assert page.input_value("#layer-select") == "18" and page.input_value("#head-select") == "6"
    page_log.check()
