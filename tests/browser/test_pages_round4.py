"""What the pages show, fourth round (issue 38), in Debian's Chromium:
- the standalone export draws a run with a temperature at the run's β: its heading and slider say so, and a nudge of
  the slider moves from that map (attnlab.Lab → result.to_html, tiny random Llama; no download);
- on a long input the Softmax panel no longer shows the previous input's row: it says it has none;
- the causal triangle and the area beyond a local layer's window edge are grey on long overviews and windows;
- a box drag of a few pixels on a long overview is a zoom, not a click;
- a job's count-down is smoothed and its total is the accepted event's.
The long maps use a tiny random Gemma 3 (local layer 0 with a window of 8, global layer 1) at full_map_tokens 8."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from attnlab import Lab, Temperature
from tests.browser.conftest import SCREENSHOTS, screenshot
from tests.browser.test_standalone_export import HEATMAP, shown, wait_drawn
from tests.tiny_models import build_text_model

ROOT = Path(__file__).resolve().parents[2]
TEXT = "the cat sat on the mat because it was tired"


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    folder = build_text_model("llama", tmp_path_factory.mktemp("round4") / "llama")
    (ROOT / "artifacts").mkdir(exist_ok=True)
    with Lab.start(settings={"default_models": ["lm"], "extra_models": {"lm": str(folder)}},
                   log=ROOT / "artifacts" / "round4-lab-server.log") as started:
        yield started


def open_offline(browser, path):
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.route("**/*", lambda r: r.continue_() if r.request.url.startswith(("file:", "data:", "blob:")) else r.abort())
    pg.goto(path.as_uri())
    return context, pg, errors


def causal_softmax(S: np.ndarray, beta: float) -> np.ndarray:
    n = S.shape[-1]
    logits = np.where(np.tril(np.ones((n, n), dtype=bool)), beta * S.astype(np.float64), -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    return p / p.sum(-1, keepdims=True)


def test_export_of_a_run_with_a_temperature_says_and_moves_from_the_runs_beta(lab, browser, tmp_path):
    """Temperature(0.5, layers=[1]) → to_html(layer=1, head=0): the file draws P at β = 0.5 and its heading, readout
    and slider say β = 0.5; one slider step is β = 0.5·10^0.01 from the saved scores (a small change of that map, not
    the jump back to β₀ and beyond); layer 0, which the temperature does not cover, is at β₀."""
    run_beta = 0.5
    result = lab.attention(TEXT, "lm", interventions=[Temperature(run_beta, layers=[1])], include_scores=True)
    P = np.asarray(result.attention, dtype=np.float64)  # (L, H, T, T)
    S = np.asarray(result.scores, dtype=np.float64)
    beta0 = result.response["native_beta"]
    assert abs(beta0 - run_beta) > 0.1  # the run's β is not β₀ (tiny Llama: 1/√8)
    np.testing.assert_allclose(causal_softmax(S[1, 0], run_beta), P[1, 0], atol=1e-5)  # the run's map is at 0.5
    path = result.to_html(tmp_path / "run-beta.html", layer=1, head=0)

    context, pg, errors = open_offline(browser, Path(path))
    try:
        wait_drawn(pg, layer="1", head="0")
        assert float(pg.eval_on_selector(HEATMAP, "el => el.dataset.beta")) == pytest.approx(run_beta)
        title = pg.eval_on_selector(HEATMAP, "el => el.layout.title.text")
        assert "layer 1, head 0 · β = 0.5000" in title, title
        readout = pg.inner_text(".ae-controls .ae-mono")
        assert readout.startswith("β = 0.5000") and "the run's temperature" in readout, readout
        np.testing.assert_array_equal(np.array(shown(pg), dtype=np.float32), P[1, 0].astype(np.float32))  # the run's P
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        pg.screenshot(path=str(SCREENSHOTS / "export-run-beta-0.5.png"))

        pg.focus("[data-role=beta]")
        pg.keyboard.press("ArrowRight")  # one step: log₁₀(β / the run's β) = 0.01
        nudged = run_beta * 10 ** 0.01
        pg.wait_for_function(f"Math.abs(Number(document.querySelector('{HEATMAP}').dataset.beta) - {nudged}) < 1e-9",
                             timeout=20_000)
        pg.wait_for_timeout(400)  # the slider's last Plotly redraw (150 ms after it rests)
        after = np.array(shown(pg))
        np.testing.assert_allclose(after, causal_softmax(S[1, 0], nudged), atol=1e-5)
        assert np.abs(after - P[1, 0]).max() < 0.05  # a nudge moves the drawn map a little
        assert "the run's β = 0.5000" in pg.inner_text(".ae-controls .ae-mono")

        pg.click("[data-role=beta-reset]")
        pg.select_option("[data-role=layer]", "0")  # layer 0 ran at β₀
        wait_drawn(pg, layer="0", head="0")
        assert float(pg.eval_on_selector(HEATMAP, "el => el.dataset.beta")) == pytest.approx(beta0)
        assert "(native β₀)" in pg.inner_text(".ae-controls .ae-mono")
        assert errors == []
    finally:
        context.close()


# ---- long maps on a tiny Gemma 3 ---------------------------------------------------------------------------------
from tests.browser.test_local_global_layers import OVERVIEW, TEXT as LONG_TEXT, gemma3_server  # noqa: E402,F401

SHORT = "the cat sat on the mat"  # under full_map_tokens (8): a full map, with scores for the Softmax panel


def test_softmax_panel_follows_the_input_after_the_long_sample(page, page_log, gemma3_server):  # noqa: F811
    """A short prompt fills the Softmax panel with its last query row; the long sample (a long input: no full scores)
    then leaves no row of the short prompt there: the panel says it has no row, and why."""
    from urllib.parse import quote

    page.goto(f"{gemma3_server}/#m=tiny-gemma3&t={quote(SHORT)}&l=0&h=0")
    page.wait_for_function("() => document.getElementById('softmax-query')?.options.length > 0", timeout=120_000)
    short_rows = page.eval_on_selector_all("#softmax-query option", "els => els.map(e => e.textContent)")
    assert any(row.endswith("mat") for row in short_rows) and len(short_rows) <= 8, short_rows
    assert "log n = " in page.text_content("#softmax-readout")
    page.click("#long-sample-button")
    page.wait_for_function(OVERVIEW, timeout=120_000)
    page.wait_for_function("() => document.getElementById('softmax-readout').dataset.empty === '1'", timeout=60_000)
    readout = page.text_content("#softmax-readout")
    assert "no query row" in readout and "long input" in readout and "log n" not in readout, readout
    assert page.locator("#softmax-query option").count() == 0
    assert page.eval_on_selector("#softmax-bars", "el => (el.data || []).length") == 0  # the old row's bars are gone
    page.locator("#softmax-panel").scroll_into_view_if_needed()
    screenshot(page, "round4-softmax-after-long-sample")
    page.locator("#softmax-panel").screenshot(path=str(SCREENSHOTS / "round4-softmax-panel-long.png"))
    # the score vector still works without an input
    page.select_option("#softmax-source", "vector")
    page.wait_for_function("() => !document.getElementById('softmax-readout').dataset.empty", timeout=10_000)
    assert "log n = 1.609" in page.text_content("#softmax-readout")  # the 5-entry default vector
    page_log.check()


def grey_cells(page) -> dict:
    """The heatmap's forbidden-cell trace as {(row value, col value)} and the main trace's axes."""
    return page.eval_on_selector("#heatmap", """el => {
      const grey = el.data.find(t => t.name === 'forbidden');
      const main = el.data[0];
      const cells = [];
      if (grey) grey.z.forEach((row, i) => row.forEach((v, j) => { if (v === 1) cells.push([grey.y[i], grey.x[j]]); }));
      return {cells, x: Array.from(main.x), y: Array.from(main.y), colour: grey?.colorscale?.[0]?.[1] ?? null,
              legend: (el.layout.annotations || []).map(a => a.text).join(' ')};
    }""")


def test_forbidden_cells_are_grey_on_long_overviews_and_windows(page, page_log, gemma3_server):  # noqa: F811
    """Local layer 0 (window 8) of a long input: on the overview, the blocks above the diagonal and those wholly
    beyond the window's edge are grey; on an exact window every cell with key j > query i or j ≤ i − 8 is grey and
    no other; the global layer 1 greys only the causal triangle."""
    from urllib.parse import quote

    page.goto(f"{gemma3_server}/#m=tiny-gemma3&t={quote(LONG_TEXT)}&l=0&h=0")
    page.wait_for_function(OVERVIEW, timeout=120_000)
    edges = page.evaluate("""() => { const el = document.getElementById('heatmap');
      const x = Array.from(el.data[0].x); return x; }""")
    overview = grey_cells(page)
    assert overview["colour"] == "#c3c7cf" and "forbidden" in overview["legend"]
    assert overview["cells"], "no grey block on a causal overview"
    mids = sorted(set(edges))
    upper = [(y, x) for y, x in overview["cells"] if x > y]
    lower = [(y, x) for y, x in overview["cells"] if x < y]
    assert upper and lower  # the causal triangle and the blocks beyond the window's edge
    assert all(x - y > 0 for y, x in upper) and all(y - x > 8 for y, x in lower)
    assert len(mids) > 3
    screenshot(page, "round4-long-overview-grey")
    page.locator("#heatmap").screenshot(path=str(SCREENSHOTS / "round4-long-overview-grey-heatmap.png"))

    n = page.locator("#token-strip .tok").count()
    page.evaluate(f"""() => Plotly.relayout('heatmap', {{'xaxis.range[0]': 0, 'xaxis.range[1]': 30,
                                                      'yaxis.range[0]': 30, 'yaxis.range[1]': 0}})""")
    page.wait_for_function("() => document.getElementById('heatmap').dataset.atlas?.startsWith('window')", timeout=60_000)
    window = grey_cells(page)
    expected = {(i, j) for i in window["y"] for j in window["x"] if j > i or j <= i - 8}
    assert {tuple(c) for c in window["cells"]} == expected
    z = page.eval_on_selector("#heatmap", "el => el.data[0].z")
    assert all(p == 0 for i, row in zip(window["y"], z) for j, p in zip(window["x"], row) if (i, j) in expected)
    screenshot(page, "round4-long-window-grey")
    page.locator("#heatmap").screenshot(path=str(SCREENSHOTS / "round4-long-window-grey-heatmap.png"))

    page.select_option("#layer-select", "1")  # global: only the causal triangle
    page.wait_for_function("() => document.getElementById('heatmap').dataset.atlas?.startsWith('window')"
                           " && document.getElementById('heatmap').layout.title.text.includes('global')", timeout=60_000)
    window = grey_cells(page)
    assert {tuple(c) for c in window["cells"]} == {(i, j) for i in window["y"] for j in window["x"] if j > i}
    assert n > 30
    page_log.check()


def test_a_small_box_drag_on_a_long_overview_loads_its_window(page, page_log, gemma3_server):  # noqa: F811
    """A drag of 6 × 6 px (under Plotly's 8 px click threshold) and one of 40 × 12 px (under its 20 px box threshold
    in one direction: Plotly zooms the other axis alone) each load the exact window of the box drawn, at once."""
    from urllib.parse import quote

    page.goto(f"{gemma3_server}/#m=tiny-gemma3&t={quote(LONG_TEXT * 3)}&l=1&h=0")
    page.wait_for_function(OVERVIEW, timeout=120_000)
    page.locator("#heatmap").scroll_into_view_if_needed()
    page.wait_for_timeout(300)
    area = page.eval_on_selector("#heatmap", """el => { const r = el.querySelector(".nsewdrag[data-subplot='xy']").getBoundingClientRect();
      return {x: r.x, y: r.y, w: r.width, h: r.height}; }""")
    n = page.locator("#token-strip .tok").count()

    def drag(x0, y0, dx, dy):
        page.mouse.move(x0, y0)
        page.mouse.down()
        page.mouse.move(x0 + dx / 2, y0 + dy / 2, steps=3)
        page.mouse.move(x0 + dx, y0 + dy, steps=3)
        page.mouse.up()

    x0, y0 = area["x"] + area["w"] * 0.3, area["y"] + area["h"] * 0.6
    drag(x0, y0, 6, 6)
    page.wait_for_function("() => document.getElementById('heatmap').dataset.window", timeout=30_000)
    w = page.eval_on_selector("#heatmap", "el => JSON.parse(el.dataset.window)")
    per_px = n / area["w"]
    assert 1 <= w["cols"][1] - w["cols"][0] <= 6 * per_px + 2 and 1 <= w["rows"][1] - w["rows"][0] <= 6 * per_px * area["w"] / area["h"] + 2
    assert abs(w["cols"][0] - 0.3 * n) <= 2
    assert page.eval_on_selector("#atlas-row", "el => el.hidden")  # no row plot: the drag was not a click

    # a fresh overview for the second drag (the page loaded again: Plotly's autorange back to the overview is left
    # out here, it timed out in the whole suite's run and is followed up in the issue)
    page.goto("about:blank")
    page.goto(f"{gemma3_server}/#m=tiny-gemma3&t={quote(LONG_TEXT * 3)}&l=1&h=0")
    page.wait_for_function(OVERVIEW, timeout=120_000)
    page.locator("#heatmap").scroll_into_view_if_needed()
    page.wait_for_timeout(300)
    drag(x0, y0, 40, 12)
    page.wait_for_function("() => document.getElementById('heatmap').dataset.window", timeout=30_000)
    w = page.eval_on_selector("#heatmap", "el => JSON.parse(el.dataset.window)")
    rows = w["rows"][1] - w["rows"][0]
    assert rows < n / 4, w  # the box's rows, not every row of the map
    assert abs((w["cols"][1] - w["cols"][0]) - 40 * per_px) <= 2
    page_log.check()


def test_the_count_down_is_smoothed_and_the_total_is_the_accepted_events(page, page_log, gemma3_server):  # noqa: F811
    """static/js/views/jobs.js jobClock replayed on its own clock: a patch-set whose batches came at an uneven pace
    (the estimate from the first rates was 115 s, then 1,217 s, then 26 s) counts down without a jump of more than a
    factor of 2 per event, ends near the truth, and keeps the accepted event's total when a progress event says
    another."""
    page.goto(f"{gemma3_server}/guide")
    replay = page.evaluate("""async () => {
      const { jobClock } = await import('/static/js/views/jobs.js');
      let t = 0;
      const clock = jobClock(() => {}, { now: () => t });
      const shown = [];
      const seconds = () => { const m = clock.text().match(/about ([\\d,]+) s left/); return m ? Number(m[1].replace(/,/g, '')) : 0; };
      clock.event({ accepted: true, eta_s: 120, queue_position: 0, total: 30 });
      shown.push(seconds());
      // (ms, progress): a fast first batch, a slow second, then an even pace of 2 s a batch
      const events = [[1000, 1], [1300, 2], [8000, 3], [12000, 5], [16000, 7]];
      for (let k = 8; k <= 30; k++) events.push([16000 + 2000 * (k - 7), k]);
      const totals = [];
      for (const [ms, progress] of events) {
        t = ms;
        clock.event({ progress, total: progress > 10 ? 60 : 30 });  // a server that changed its total mid-job
        totals.push(clock.total({ progress, total: progress > 10 ? 60 : 30 }));
        shown.push(seconds());
      }
      clock.stop();
      return { shown, totals };
    }""")
    shown = replay["shown"]
    assert shown[0] == 120
    for before, after in zip(shown, shown[1:-1]):
        if before and after:
            assert 0.5 <= after / before <= 2, shown
    assert set(replay["totals"]) == {30}
    assert shown[-1] == 0  # done: "finishing…"
    # near the end the pace (2 s a batch) rules: 5 batches left is about 10 s
    assert abs(shown[-6] - 10) <= 4, shown
    page_log.check()
