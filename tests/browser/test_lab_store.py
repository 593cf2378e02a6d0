"""The lab's store (static/js/lab/store.js, issue 32 item 7) and the text page's effect panel (issue 28 item 9), in
Chromium: the store's change event; the analysis panels follow the model the store announces (no watching of `hidden`
attributes); the effect panel folds its figures away until an intervention is used; its labels ("top before") keep
one line at 1280 and 1024 px, also beside a value with a long unbreakable token."""
from __future__ import annotations

from urllib.parse import quote

from tests.browser.conftest import screenshot

PROMPT = "The capital of France is"


def _ready(page, url):
    page.goto(f"{url}/#m=smollm2-135m&t={quote(PROMPT)}")
    page.wait_for_function("() => document.getElementById('lm-output').dataset.top !== undefined", timeout=300_000)


def test_store_change_event(page, page_log, live_server):
    page.goto(f"{live_server}/guide")
    result = page.evaluate("""async () => {
        const { createLabStore } = await import('/static/js/lab/store.js');
        const store = createLabStore(), seen = [];
        const stop = store.subscribe((e) => seen.push([e.what, e.settle, e.run, e.state === store.state]));
        store.state.masks.tokens.add(3);
        store.changed('masks');
        store.changed('beta', { settle: 150 });
        store.setModel({ id: 'm', output: 'next_token' });
        stop();
        store.changed('perturb');  // not heard: unsubscribed
        return { seen, model: store.model.id, masks: [...store.state.masks.tokens], beta: store.state.beta.logRatio };
    }""")
    assert result == {"seen": [["masks", 0, True, True], ["beta", 150, True, True], ["model", 0, False, True]],
                    "model": "m", "masks": [3], "beta": 0}
    page_log.check()


def test_analysis_panels_follow_the_model_from_the_store(page, page_log, live_server):
    _ready(page, live_server)
    hidden = lambda: page.evaluate(  # noqa: E731
        "() => ['patching-panel', 'lens-panel', 'faith-panel'].map(id => document.getElementById(id).hidden)")
    assert hidden() == [False, False, False]
    page.select_option("#model-select", "minilm")  # a sentence encoder: no next token, faithfulness only
    page.wait_for_function("() => document.getElementById('patching-panel').hidden", timeout=60_000)
    assert hidden() == [True, True, False]
    page.select_option("#model-select", "smollm2-135m")
    page.wait_for_function("() => !document.getElementById('patching-panel').hidden", timeout=60_000)
    assert hidden() == [False, False, False]
    page_log.check()


def test_effect_panel_folded_until_used_and_labels_on_one_line(page, page_log, live_server):
    _ready(page, live_server)
    page.wait_for_function("() => /no interventions active/.test(document.getElementById('effect-summary').textContent)",
                           timeout=60_000)
    folded = page.eval_on_selector("#effect-panel", "e => e.getBoundingClientRect().height")
    assert folded < 200, folded  # before: about 890 px of empty figures at 1400 px, 1,200 at 1024
    assert "Active interventions: none" in page.inner_text("#interventions-list")

    page.click("#token-strip .tok[data-index='1']")  # mask a key: the effect panel lists the next token before/after
    page.wait_for_function("() => [...document.querySelectorAll('#output-effect dt')].some(d => d.textContent === 'top before')",
                           timeout=300_000)
    used = page.eval_on_selector("#effect-panel", "e => e.getBoundingClientRect().height")
    assert used > 500, used
    # the figures drawn while folded fit the panel once it opens (not Plotly's default 700 px); Plotly.Plots.resize
    # redraws after its own short timer, so wait a moment for it rather than reading the first frame
    widths_js = """() => ['hidden-cosine-plot', 'tv-plot'].map(id => {
        const el = document.getElementById(id); return [el.getBoundingClientRect().width, el.querySelector('.main-svg').getBoundingClientRect().width]; })"""
    try:
        page.wait_for_function(f"() => ({widths_js})().every(([box, svg]) => Math.abs(box - svg) < 2)", timeout=5_000)
    except Exception:
        pass  # the assertion below says what was drawn
    widths = page.evaluate(widths_js)
    assert all(abs(box - svg) < 2 for box, svg in widths), widths

    # each label's line boxes (a Range over its text), not the grid row's height, which a wrapped value sets
    lines = """() => [...document.querySelectorAll('#output-effect dt')].map(d => {
        const range = document.createRange(); range.selectNodeContents(d);
        return [d.textContent, new Set([...range.getClientRects()].map(r => Math.round(r.top))).size]; })"""
    for width in (1280, 1024):
        page.set_viewport_size({"width": width, "height": 1000})
        page.wait_for_timeout(300)
        counted = dict(page.evaluate(lines))
        assert counted["top before"] == 1 and counted["top after"] == 1, (width, counted)
        # a value holding a long token without spaces (as a long word or URL-like token is shown) must not squeeze the
        # labels: before 39170f3 "next token after position 4: KL(before ‖ after)" took 7 lines, one word a line
        page.evaluate("""() => { const dd = [...document.querySelectorAll('#output-effect dt')]
            .find(d => d.textContent === 'top before').nextElementSibling;
            dd.dataset.real ??= dd.textContent; dd.textContent = '"' + 'x'.repeat(60) + '" 0.5, ' + dd.dataset.real; }""")
        counted = dict(page.evaluate(lines))
        assert counted["top before"] == 1 and max(counted.values()) <= 2, (width, counted)
        page.evaluate("""() => { for (const dd of document.querySelectorAll('#output-effect dd[data-real]')) dd.textContent = dd.dataset.real; }""")
        header = page.eval_on_selector("#effect-panel h2", "e => e.getBoundingClientRect().height")
        assert header < 40, (width, header)  # the heading keeps one line too
    screenshot(page, "text-effect-panel-1024")
    page_log.check()
