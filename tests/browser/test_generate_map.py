"""Attention while the model writes, on the text page (issue 39) with the real smollm2-135m in Debian's Chromium: a
continuation with "Italy" masked grows one map row per new token for the shown head on each side, the masked key is
exactly 0 in every intervened row and not in the plain ones, a click on a row draws that token's row as bars, and
"why?" on it opens the attribution of that generated query; on a phone the page still does not scroll sideways."""
from __future__ import annotations

from urllib.parse import quote

from tests.browser.conftest import assert_fits_a_phone, phone_page, screenshot
from tests.browser.test_lm_page import generate_and_wait, wait_idle
from tests.browser.test_text_page import wait_for_heatmap

PROMPT = "The capital of France is Paris. The capital of Italy is"
ITALY = 10  # the token index of " Italy" in smollm2-135m's tokens of PROMPT


def open_masked(page, live_server):
    page.goto(f"{live_server}/#m=smollm2-135m&t={quote(PROMPT)}&l=18&h=6&mk={ITALY}&ms=all")
    wait_for_heatmap(page)
    wait_idle(page)
    page.fill("#max-new-tokens", "6")


def test_the_map_grows_a_row_per_token_and_why_opens_on_a_generated_token(page, page_log, live_server):
    open_masked(page, live_server)
    assert page.evaluate("() => document.getElementById('token-strip').textContent").count("Italy") >= 1
    generate_and_wait(page)
    maps = page.evaluate("""() => ['gen-map-base', 'gen-map-intervened'].map((id) => {
        const el = document.getElementById(id);
        return {rows: Number(el.dataset.rows), z: el.data[0].z, x: el.data[0].x};
    })""")
    base, intervened = maps
    tokens = page.evaluate("() => document.querySelectorAll('#continuation-intervened .gen-tok').length")
    assert intervened["rows"] == tokens == len(intervened["z"]) and base["rows"] >= 1
    assert "Italy" in intervened["x"][ITALY]
    prompt = sum(v is not None for v in intervened["z"][0])  # row 0: the prompt's P keys (rows are padded with null)
    assert prompt == 12
    for s, row in enumerate(intervened["z"]):  # row s: P + s keys, then empty cells
        values = [v for v in row if v is not None]
        assert len(values) == prompt + s and abs(sum(values) - 1) < 1e-4
        assert values[ITALY] == 0.0  # masked, exactly, at every step
    assert all(row[ITALY] > 0 for row in base["z"])

    page.evaluate("() => document.getElementById('gen-map-intervened').emit('plotly_click', {points: [{pointIndex: [2, null]}]})")
    page.wait_for_selector("#gen-row:not([hidden])")
    bars = page.eval_on_selector("#gen-row", "el => el.data[0].y")
    assert len(bars) == prompt + 2 and abs(sum(bars) - 1) < 1e-4 and bars[ITALY] == 0.0
    page.click("#gen-why-button")
    page.wait_for_function("() => /layer 18, head 6/.test(document.getElementById('why-title').textContent)")
    page.wait_for_function("() => document.getElementById('why-matrix').data", timeout=300_000)
    assert f": {prompt + 1} (" in page.text_content("#why-title")  # "…: 13 (.) → 0 (The)": the query of new token 2
    screenshot(page, "generate-map")
    page_log.check()


def test_the_growing_maps_fit_a_phone(browser, live_server):
    with phone_page(browser) as page:
        open_masked(page, live_server)
        generate_and_wait(page)
        page.wait_for_selector("#gen-attention:not([hidden])")
        assert_fits_a_phone(page)
