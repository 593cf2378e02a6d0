"""Patching over a set of prompt pairs on the text page with the real smollm2-135m, in Debian's Chromium: two pairs
pasted as lines, the scan's progress over both, then each head's mean effect, the AtP* estimate beside it, the
error-bar strip of the top heads with every pair's value, and the rank agreement table."""
from __future__ import annotations

import json
from urllib.parse import quote

from tests.browser.conftest import SCREENSHOTS
from tests.float32 import f32_bound

LINES = "The capital of France is | The capital of Italy is\nThe capital of Spain is | The capital of Italy is | Madrid | Rome"


def test_a_set_of_two_pairs_shows_means_spread_and_agreement(live_server, page, page_log):
    page.goto(f"{live_server}/#m=smollm2-135m&t={quote('The capital of France is')}&l=5&h=0")
    page.wait_for_function("() => !document.getElementById('patching-panel').hidden", timeout=120_000)
    assert page.is_hidden("#patch-lines-box")
    # the template form: its slots filled from each filler line, answers with their leading space
    page.select_option("#patch-source", "template")
    assert page.is_visible("#patch-template-box") and page.is_hidden("#patch-pair-box")
    page.fill("#patch-template", "The {what} of {country} is")
    page.fill("#patch-fillers", "capital, France | capital, Italy | Paris | Rome\ncapital, Spain | capital, Italy")
    fields = page.evaluate("async () => (await import('/static/js/views/patchset.js')).setRequestFields()")
    assert fields == {"template": {"text": "The {what} of {country} is", "fillers": [
        {"clean": {"what": "capital", "country": "France"}, "corrupt": {"what": "capital", "country": "Italy"},
         "answer": " Paris", "wrong": " Rome"},
        {"clean": {"what": "capital", "country": "Spain"}, "corrupt": {"what": "capital", "country": "Italy"}}]}}
    page.fill("#patch-fillers", "France | Italy")
    page.click("#patch-run")
    assert "2 values (what, country)" in page.text_content("#patch-error")  # said on the page, nothing sent
    page.select_option("#patch-source", "lines")
    assert page.is_visible("#patch-lines-box") and page.is_hidden("#patch-pair-box")
    page.fill("#patch-set-lines", LINES)
    with page.expect_response(lambda r: r.url.endswith("/api/text/patching"), timeout=300_000) as answer:
        page.click("#patch-run")
        page.wait_for_function("() => Number(document.getElementById('patching-panel').dataset.progress || 0) > 0",
                               timeout=300_000)
        page.wait_for_function("() => document.getElementById('patching-panel').dataset.state === 'done'",
                               timeout=300_000)
    sent = json.loads(answer.value.request.post_data)
    assert sent["pairs"][1] == {"clean": "The capital of Spain is", "corrupt": "The capital of Italy is",
                                "answer": " Madrid", "wrong": " Rome"}
    assert sent["answer"] == " Paris" and "clean" not in sent
    assert page.eval_on_selector("#patching-panel", "e => e.dataset.progress") == str(2 * (30 * 9 + 1))
    assert page.is_visible("#patch-set-results") and page.is_hidden("#patch-results")
    shown = page.eval_on_selector("#patch-set-heatmap", "e => e.data[0].z")
    assert len(shown) == 30 and len(shown[0]) == 9
    # the strip: the 12 heads of largest |mean| from the heatmap, each mean the average of the two pairs' values
    # drawn beside it, the spread their sample std (the API tests check the numbers against single-pair scans)
    strip = page.eval_on_selector("#patch-set-strip", "e => e.data.map(t => ({name: t.name, x: t.x, y: t.y, "
                                  "err: t.error_y ? t.error_y.array : null}))")
    assert [t["name"] for t in strip] == ["mean ± std", "each pair", "AtP*"]
    mean, pairs = strip[0], strip[1]
    assert len(mean["y"]) == 12 and len(pairs["y"]) == 24
    ranked = sorted((abs(v), l, h) for l, row in enumerate(shown) for h, v in enumerate(row) if v is not None)[::-1]
    assert mean["x"] == [f"L{l} h{h}" for _, l, h in ranked[:12]]
    for i, label in enumerate(mean["x"]):
        first, second = pairs["y"][i], pairs["y"][12 + i]
        assert pairs["x"][i] == pairs["x"][12 + i] == label
        # the server's float32 mean of the two pairs, at their scale
        assert abs(mean["y"][i] - (first + second) / 2) <= f32_bound(2, max(abs(first), abs(second)))
        assert abs(mean["err"][i] - abs(first - second) / 2 ** 0.5) < 1e-5
    assert any(e > 0 for e in mean["err"])
    rows = page.eval_on_selector_all("#patch-set-agreement tbody tr", "rs => rs.map(r => r.dataset.estimate)")
    assert rows == ["atp_star", "atp", "head_output"]
    status = page.text_content("#patch-status")
    assert "2 pairs" in status and "AtP* ρ" in status
    # the other estimate on the right
    page.select_option("#patch-set-estimate-name", "atp")
    page.wait_for_function("() => document.getElementById('patch-set-estimate').layout.title.text.startsWith('AtP:')")
    page.locator("#patching-panel").scroll_into_view_if_needed()
    page.locator("#patching-panel").screenshot(path=str(SCREENSHOTS / "patching-set.png"))
    page_log.check()
