"""On the P̂ − P map a masked key's column is told apart from "no change" (issue 56 §9), in Chromium on the real
server: a key mask restored from the link, the difference figure draws that column's cells in a colour of their own
(an overlay trace named "masked") with a legend entry, only where P̂ = 0 by the mask and P was not, and nowhere else.
RdBu's middle (P̂ − P ≈ 0) is what a masked key whose P was small looked like before."""
from __future__ import annotations

from tests.browser.conftest import screenshot
from tests.browser.test_text_lab import DIFF, wait_for_heatmap, wait_idle

MASKED = 3


def test_a_masked_column_is_drawn_apart_from_no_change(page, page_log, live_server):
    page.goto(f"{live_server}/#m=minilm&t=the+cat+sat+on+the+mat+because+it+was+tired&l=2&h=1&mk={MASKED}&ms=all")
    wait_for_heatmap(page)
    wait_idle(page)
    page.wait_for_function("sel => (document.querySelector(sel)?.data ?? []).length > 1", arg=DIFF, timeout=60_000)
    traces = page.eval_on_selector(DIFF, "el => el.data.map(t => ({name: t.name, type: t.type, z: t.z ?? null, "
                                         "showlegend: t.showlegend ?? null}))")
    diff = traces[0]["z"]
    [overlay] = [t for t in traces if t["name"] == "masked"]
    cells = {(i, j) for i, row in enumerate(overlay["z"]) for j, v in enumerate(row) if v == 1}
    rows = len(diff)
    assert cells == {(i, MASKED) for i in range(rows)}, cells  # every query row of the masked key, nothing else
    assert all(diff[i][MASKED] < 0 for i in range(rows))  # P̂ − P = −P there: the cells lost all their attention
    legend = [t for t in traces if t["showlegend"] and "masked" in (t["name"] or "")]
    assert legend and "no change" in legend[0]["name"], traces
    page.locator("#diff-heatmap").scroll_into_view_if_needed()
    page.locator("#diff-heatmap").screenshot(path=str(screenshot(page, "diff-masked-column-page").parent
                                                     / "diff-masked-column.png"))
    page_log.check()
