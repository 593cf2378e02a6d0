"""What the text page shows must be true (issue 18), in Debian's Chromium against the real models: the
continuation stream when one side ends first, the softmax panel's row for a causal model (chosen with the
dropdown, the keyboard path), β scoped to a layer range shown only where it applies, no false "also masked"
warning, and the text page opening on the language model."""
from __future__ import annotations

from urllib.parse import quote

from tests.browser.conftest import screenshot
from tests.browser.test_lm_page import continuation, generate_and_wait, wait_idle
from tests.browser.test_text_page import set_slider, wait_for_heatmap

HEATMAP = "#heatmap.js-plotly-plot"
PROMPT = "The capital of France is"
# The heatmap's P (its hover values where the colours are on another scale, e.g. log₁₀ P).
SHOWN_P = "() => { const t = document.getElementById('heatmap').data[0]; return t.customdata || t.z; }"


def open_lm(page, live_server, text=PROMPT, extra=""):
    page.goto(f"{live_server}/#m=smollm2-135m&t={quote(text)}{extra}")
    wait_for_heatmap(page)
    wait_idle(page)


def softmax_row(page) -> list[float]:
    return page.eval_on_selector("#softmax-bars", "el => el.data[0].y")


def shown_p(page) -> list[list[float]]:
    return page.evaluate(SHOWN_P)


def close(a, b, tol=2e-4) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= tol for x, y in zip(a, b))


def test_continuation_goes_on_when_one_side_ends_first(page, page_log, live_server):
    """Chat on: the plain side ends at <|im_end|> after 8 tokens; with layer 0 ablated the other side keeps
    writing newlines. The page once crashed there ("reading 'slice'") and blanked the panel."""
    open_lm(page, live_server, "What is the capital of France?", "&chat=1")
    page.fill("#max-new-tokens", "14")
    generate_and_wait(page)
    plain = continuation(page)
    assert "Paris" in plain["base"] and plain["differs"] == "no"
    # Ablate every head of layer 0 with "follow changes" on: the continuation is generated again.
    assert page.is_checked("#auto-generate")
    page.select_option("#ablate-scope", "layer")
    page.check("#ablate-toggle")
    page.wait_for_function("() => document.getElementById('continuation').dataset.state === 'running'", timeout=300_000)
    page.wait_for_function("() => ['done', 'error'].includes(document.getElementById('continuation').dataset.state)", timeout=300_000)
    assert page_log.errors == [] and page.get_attribute("#continuation", "data-state") == "done", (page_log.errors, page.inner_text("#status"))
    moved = continuation(page)
    assert moved["differs"] == "yes"
    assert "Paris" in moved["base"] and page.locator("#continuation-base .gen-end").count() == 1
    base_tokens = page.locator("#continuation-base .gen-tok").count()
    ablated = page.locator("#continuation-intervened .gen-tok")
    assert ablated.count() == 14 > base_tokens  # the ablated side went on after the plain one ended
    # its newline tokens are spelled out, not blank
    assert all(t.strip() for t in ablated.all_inner_texts()), ablated.all_inner_texts()
    assert "ended after" in page.inner_text("#continuation-status")
    screenshot(page, "truth-continuation-one-side-ended")
    page_log.check()


def test_softmax_panel_defaults_to_the_last_row_of_a_causal_map(page, page_log, live_server):
    """Row 0 of a causal map sees one key: p = 1 says nothing. An encoder's default stays row 0."""
    open_lm(page, live_server)
    n = len(shown_p(page))
    page.wait_for_selector("#softmax-bars.js-plotly-plot")
    assert page.input_value("#softmax-query") == str(n - 1)
    assert close(softmax_row(page), shown_p(page)[n - 1]) and max(softmax_row(page)) < 1
    page.select_option("#model-select", "minilm")
    page.wait_for_function("() => document.getElementById('lm-panels').hidden", timeout=60_000)
    wait_idle(page)
    page.wait_for_function("() => document.getElementById('softmax-query').value === '0'")
    page_log.check()


def test_softmax_dropdown_shows_the_chosen_row_of_a_causal_map(page, page_log, live_server):
    open_lm(page, live_server)
    page.wait_for_selector("#softmax-bars.js-plotly-plot")
    page.select_option("#layer-select", "5")
    page.wait_for_function("() => document.getElementById('heatmap-title').textContent.startsWith('layer 5, head 0')")
    wait_idle(page)
    for row in (4, 2, 1):  # the keyboard path: the dropdown, not a click on the heatmap
        page.select_option("#softmax-query", str(row))
        page.wait_for_function("r => document.getElementById('softmax-query').value === String(r)", arg=row)
        page.wait_for_timeout(200)  # the panel redraws on the change event
        p = softmax_row(page)
        assert close(p, shown_p(page)[row]), (row, p, shown_p(page)[row])
        assert all(v == 0 for v in p[row + 1:]) and abs(sum(p) - 1) < 1e-5
        assert f"q={row}" in page.url  # the page's query follows the dropdown (share link, token strip)
        assert "query" in page.get_attribute(f'#token-strip .tok[data-index="{row}"]', "class").split()
    page_log.check()


def test_beta_on_a_layer_range_is_shown_only_where_it_applies(page, page_log, live_server):
    open_lm(page, live_server)
    native = page.evaluate("() => document.getElementById('heatmap-title').textContent.split('β = ')[1]")
    page.select_option("#scope-select", "layers")
    page.fill("#beta-from", "10")
    page.dispatch_event("#beta-from", "change")
    page.fill("#beta-to", "12")
    page.dispatch_event("#beta-to", "change")
    set_slider(page, "-2")  # β = β₀/100
    page.wait_for_function("() => document.getElementById('interventions-list').textContent.includes('temperature')", timeout=120_000)
    wait_idle(page)
    page.wait_for_selector("#beta-scope-note:not([hidden])")
    # Layer 0 is outside the range: it runs at β₀, and every place that shows a β says so.
    title = page.inner_text("#heatmap-title")
    assert title.startswith("layer 0, head 0") and title.endswith(f"β = {native}"), title
    assert "layers 10–12" in page.inner_text("#beta-scope-note")
    last = len(shown_p(page)) - 1
    assert close(softmax_row(page), shown_p(page)[last])  # not re-drawn at the range's β
    assert f"β = {native}" in page.inner_text("#softmax-readout")
    # Jump to the first changed layer: there the slider's β is the head's β.
    page.click("#beta-scope-jump")
    page.wait_for_function("() => document.getElementById('heatmap-title').textContent.startsWith('layer 10, head 0')", timeout=120_000)
    wait_idle(page)
    assert page.is_hidden("#beta-scope-note")
    title = page.inner_text("#heatmap-title")
    assert not title.endswith(f"β = {native}") and abs(float(title.split("β = ")[1]) - float(native) / 100) < 1e-6
    page.wait_for_function(f"() => document.getElementById('softmax-readout').textContent.includes('{title.split('β = ')[1]}')")
    assert close(softmax_row(page), shown_p(page)[last], tol=1e-3)  # softmax(β Ŝ) at the head's β is the server's P
    page_log.check()


def test_a_masked_key_alone_says_nothing_about_perturbing(page, page_log, live_server):
    page.goto(f"{live_server}/#m=minilm")
    wait_for_heatmap(page)
    wait_idle(page)
    page.click('#token-strip .tok[data-index="3"]')
    page.wait_for_function("() => /TV at/.test(document.getElementById('effect-summary').textContent)", timeout=60_000)
    wait_idle(page)
    assert "also masked" not in page.inner_text("#effect-summary")
    assert page.is_hidden("#perturb-note")
    # Keys chosen for a perturbation that is not on yet: the panel says what it would do, the summary nothing.
    page.click('#perturb-tokens .tok[data-index="3"]')
    page.wait_for_selector("#perturb-note:not([hidden])")
    assert "would change nothing" in page.inner_text("#perturb-note")
    assert "also masked" not in page.inner_text("#effect-summary")
    page.click("#perturb-apply")
    page.wait_for_function("() => /also masked/.test(document.getElementById('effect-summary').textContent)", timeout=60_000)
    assert "changes nothing" in page.inner_text("#perturb-note")
    page_log.check()


def test_text_page_opens_on_the_language_model_and_the_example_follows_the_model(page, page_log, live_server):
    page.goto(live_server + "/")
    wait_for_heatmap(page)
    wait_idle(page)
    page.wait_for_function("() => document.getElementById('lm-output').dataset.top", timeout=120_000)
    assert page.input_value("#model-select") == "smollm2-135m"
    assert page.is_visible("#lm-panels") and page.is_enabled("#generate-button")
    assert page.get_attribute("#lm-output", "data-top") == " Rome"
    lm_text = page.input_value("#text-input")
    # minilm is one choice away; the example follows the model while the text is an example …
    page.select_option("#model-select", "minilm")
    page.wait_for_function("() => document.getElementById('lm-panels').hidden", timeout=60_000)
    wait_idle(page)
    assert page.input_value("#text-input") not in ("", lm_text) and page.inner_text("#text-label") == "Sentence"
    assert page.locator("#modelview canvas").count() == 6 * 12
    page.select_option("#model-select", "smollm2-135m")
    page.wait_for_function("() => !document.getElementById('lm-panels').hidden", timeout=60_000)
    wait_idle(page)
    assert page.input_value("#text-input") == lm_text
    # … and stays when the user has typed their own.
    page.fill("#text-input", "My own words here.")
    page.select_option("#model-select", "minilm")
    page.wait_for_function("() => document.getElementById('lm-panels').hidden", timeout=60_000)
    assert page.input_value("#text-input") == "My own words here."
    page_log.check()
