"""Browser journey on /luong: the alignment heatmap and the Transformer's heads are drawn from the served answer, and
masking source characters (clicks on them) changes the alignment and the output, with the effect shown."""
from __future__ import annotations

from tests.browser.conftest import screenshot

TEXT = "the 3rd of March 2021"


def wait_drawn(pg, score: str, mask: str):
    pg.wait_for_function(
        "([s, m]) => { const d = document.body.dataset; return d.luongScore === s && d.luongMask === m && !d.luongBusy }",
        arg=[score, mask], timeout=120_000)


def alignment(pg):
    return pg.eval_on_selector("#luong-alignment", "el => el.data[0].z")


def test_the_page_draws_the_alignment_and_a_mask_changes_it(live_server, page, page_log):
    page.goto(f"{live_server}/luong")
    wait_drawn(page, "dot", "")
    assert page.input_value("#luong-text") == TEXT
    z = alignment(page)
    page.select_option("#luong-score", "location")
    wait_drawn(page, "location", "")
    assert alignment(page) != z
    page.select_option("#luong-score", "dot")
    wait_drawn(page, "dot", "")
    assert alignment(page) == z
    assert len(z[0]) == len(TEXT) and len(z) >= 10
    assert all(abs(sum(row) - 1) < 1e-6 for row in z)
    assert page.locator("#luong-alignment g.hm image, #luong-alignment .hm").count() >= 1  # drawn, not only data
    heads = page.eval_on_selector("#transformer-heads", "el => el.data.length")
    assert heads >= 2 and page.locator("#transformer-heads g.hm image, #transformer-heads .hm").count() >= 2
    output = page.inner_text("#luong-output")
    assert "No intervention" in page.inner_text("#luong-effect")
    screenshot(page, "luong-open")

    year = [TEXT.index("2021") + i for i in range(4)]
    for i, pos in enumerate(year):
        page.click(f"#luong-source button[data-pos='{pos}']")
        wait_drawn(page, "dot", ",".join(map(str, year[: i + 1])))
    masked = alignment(page)
    assert all(row[s] == 0 for row in masked for s in year)
    assert masked != z
    assert page.locator("#luong-source button.masked").count() == 4
    effect = page.inner_text("#luong-effect")
    assert "masked" in effect and "the output changed" in effect
    assert page.inner_text("#luong-output") != output
    assert page.eval_on_selector("#luong-effect-plot", "el => el.data.length") == 3

    page.click(f"#luong-source button[data-pos='{year[0]}']")  # unmask one again
    wait_drawn(page, "dot", ",".join(map(str, year[1:])))
    page.click("#luong-reset")
    wait_drawn(page, "dot", "")
    assert alignment(page) == z
    screenshot(page, "luong-reset")
    page_log.check()
