"""The language-model view of the text page on the real smollm2-135m (issue 11), in Debian's Chromium: type a
prompt, see " Paris" on top of the next-token distribution, a causal heatmap, the GQA groups and the parity
badge; drag β down on layers 10–12 in run mode and watch the prediction move (KL > 0, p(" Paris") down), then on
every layer; the two continuations, identical without interventions, differ with them; the position
selector; Stop aborts a running continuation; the view fits a phone."""
from __future__ import annotations

from urllib.parse import quote

from tests.browser.conftest import assert_fits_a_phone, masked_cells, phone_page, screenshot, shown_p
from tests.browser.test_text_page import HEATMAP, set_slider, wait_for_heatmap

PROMPT = "The capital of France is"


def wait_idle(page, timeout=120_000):
    page.wait_for_function("() => /tokens/.test(document.getElementById('status').textContent)", timeout=timeout)


def lm_output(page) -> dict:
    return page.eval_on_selector("#lm-output", "el => ({top: el.dataset.top, after: el.dataset.topAfter, kl: Number(el.dataset.kl)})")


def continuation(page) -> dict:
    return page.evaluate("""() => ({
        state: document.getElementById('continuation').dataset.state,
        differs: document.getElementById('continuation').dataset.differs,
        base: document.getElementById('continuation-base').textContent,
        intervened: document.getElementById('continuation-intervened').textContent,
        highlighted: document.querySelectorAll('#continuation-intervened .gen-tok.differs').length,
    })""")


def generate_and_wait(page):
    page.wait_for_function("() => !document.getElementById('generate-button').disabled", timeout=120_000)
    page.click("#generate-button")
    page.wait_for_function("() => document.getElementById('continuation').dataset.state === 'done'", timeout=300_000)


def open_prompt(page, live_server):
    page.goto(f"{live_server}/#m=smollm2-135m&t={quote(PROMPT)}")
    wait_for_heatmap(page)
    wait_idle(page)
    page.wait_for_function("() => document.getElementById('lm-output').dataset.top !== undefined", timeout=120_000)


def test_lm_journey_prediction_and_continuation_move_with_beta(page, page_log, live_server):
    open_prompt(page, live_server)
    assert page.input_value("#model-select") == "smollm2-135m"
    assert page.is_visible("#lm-panels") and not page.is_visible("#pair-box")
    assert lm_output(page)["top"] == " Paris"
    probs = page.eval_on_selector("#topk-plot", "el => el.data[0].x")
    assert probs == sorted(probs, reverse=True) and 0.5 < probs[0] < 1

    # The heatmap is causal: no attention above the diagonal, drawn grey as masked; every row sums to 1.
    z = shown_p(page)
    assert len(z) >= 5
    assert all(z[i][j] == 0 for i in range(len(z)) for j in range(i + 1, len(z)))
    assert all(abs(sum(row) - 1) < 1e-4 for row in z)
    assert sorted(map(tuple, masked_cells(page))) == [(i, j) for i in range(len(z)) for j in range(i + 1, len(z))]

    # Grouped-query attention (9 query heads, 3 K/V heads) and the parity figure of the load-time probe.
    note = page.inner_text("#gqa-note")
    assert "heads 0–2 share K/V head 0" in note and "heads 6–8 share K/V head 2" in note
    assert "K/V 1" in page.inner_text("#head-select option[value='4']")
    badge = page.inner_text("#parity-badge")
    assert page.is_visible("#parity-badge") and badge.startswith("parity ") and badge.endswith("vs eager")
    assert float(badge.split()[1]) <= 1e-4
    screenshot(page, "lm-01-first-view")

    # Without interventions the two continuations are the same greedy text.
    page.fill("#max-new-tokens", "6")
    generate_and_wait(page)
    plain = continuation(page)
    assert plain["base"] and plain["base"] == plain["intervened"] and plain["differs"] == "no" and plain["highlighted"] == 0

    # Run mode, β down to β₀/30 on every head of layers 10–12: the next token's distribution moves (KL > 0, the
    # probability of " Paris" drops) though " Paris" stays on top.
    page.select_option("#scope-select", "layers")
    page.fill("#beta-from", "10")
    page.dispatch_event("#beta-from", "change")
    page.fill("#beta-to", "12")
    page.dispatch_event("#beta-to", "change")
    set_slider(page, "-1.5")
    page.wait_for_function("() => Number(document.getElementById('lm-output').dataset.kl) > 0", timeout=300_000)
    wait_idle(page)
    out = lm_output(page)
    assert out["kl"] > 1e-3 and out["top"] == " Paris"
    effect = page.evaluate("() => Object.fromEntries([...document.querySelectorAll('#lm-effect dt')].map(dt => [dt.textContent, dt.nextElementSibling.textContent]))")
    assert "KL(before ‖ after)" in effect and float(effect["Δp of ␣Paris"]) < 0
    assert len(page.eval_on_selector("#topk-plot", "el => el.data")) == 2  # before and after
    assert "layer 10,11,12, all heads" in page.inner_text('#interventions-list .iv-row[data-key="beta"]')
    assert "bs=layers" in page.url and "br=10-12" in page.url
    screenshot(page, "lm-02-beta-layers-10-12")

    # The same β on every layer: the prediction collapses, and the continuation follows once the change
    # settles (it was asked for once): it now differs from the plain one.
    page.select_option("#scope-select", "all")
    page.wait_for_function("() => Number(document.getElementById('lm-output').dataset.kl) > 1", timeout=300_000)
    page.wait_for_function("() => document.getElementById('continuation').dataset.differs === 'yes'", timeout=300_000)
    wait_idle(page)
    assert lm_output(page)["after"] != " Paris"
    moved = continuation(page)
    assert moved["base"] == plain["base"] and moved["intervened"] != moved["base"] and moved["highlighted"] > 0
    screenshot(page, "lm-03-beta-all-layers")

    # The causal structure survives any β: still nothing above the diagonal.
    z = shown_p(page)
    assert all(z[i][j] == 0 for i in range(len(z)) for j in range(i + 1, len(z)))

    # The link restores the LM view: model, prompt, β and its scope, and the same prediction.
    kl = lm_output(page)["kl"]
    page.reload()
    wait_for_heatmap(page)
    page.wait_for_function("() => Number(document.getElementById('lm-output').dataset.kl) > 1", timeout=300_000)
    assert page.input_value("#model-select") == "smollm2-135m" and page.input_value("#text-input") == PROMPT
    assert page.input_value("#scope-select") == "all" and page.input_value("#beta-slider") == "-1.5"
    assert abs(lm_output(page)["kl"] - kl) < 1e-6 * max(1, kl)
    page_log.check()


def test_position_selector_and_stop(page, page_log, live_server):
    open_prompt(page, live_server)
    # The prediction after an earlier position ("The capital" → next token) is another distribution.
    last_top = lm_output(page)["top"]
    page.select_option("#position-select", "1")
    page.wait_for_function("() => document.getElementById('lm-output-title').textContent.startsWith('after position 1')", timeout=120_000)
    assert lm_output(page)["top"] != last_top
    assert "pos=1" in page.url

    # The lab's perturbation with n = 2 samples on a decoder: the next-token KL comes with its spread.
    page.select_option("#position-select", "")
    page.fill("#perturb-sigma", "5")
    page.dispatch_event("#perturb-sigma", "change")
    page.fill("#perturb-samples", "2")
    page.dispatch_event("#perturb-samples", "change")
    page.select_option("#perturb-scope", "all")
    page.click("#perturb-apply")
    page.wait_for_function("() => /n = 2 samples/.test(document.getElementById('effect-summary').textContent)", timeout=300_000)
    wait_idle(page)
    kl_row = page.evaluate("() => [...document.querySelectorAll('#lm-effect dt')].find(dt => dt.textContent.startsWith('KL')).nextElementSibling.textContent")
    assert "nats ±" in kl_row and lm_output(page)["kl"] > 0
    page.click("#perturb-remove")  # off again
    page.wait_for_function("() => document.getElementById('interventions-list').textContent.includes('none')", timeout=300_000)
    wait_idle(page)

    # The chat template wraps the prompt as a user turn: more tokens, the template's own among them.
    n_plain = page.locator("#token-strip .tok").count()
    page.check("#chat-toggle")
    page.wait_for_function(f"() => document.querySelectorAll('#token-strip .tok').length > {n_plain}", timeout=300_000)
    wait_idle(page)
    assert "chat=1" in page.url and any("im_start" in t for t in page.locator("#token-strip .tok").all_inner_texts())
    page.uncheck("#chat-toggle")
    page.wait_for_function(f"() => document.querySelectorAll('#token-strip .tok').length === {n_plain}", timeout=300_000)
    wait_idle(page)

    # Stop aborts a running continuation.
    page.fill("#max-new-tokens", page.get_attribute("#max-new-tokens", "max"))
    page.click("#generate-button")
    page.wait_for_function("() => document.querySelectorAll('#continuation-base .gen-tok').length >= 1", timeout=120_000)
    page.click("#stop-button")
    page.wait_for_function("() => document.getElementById('continuation').dataset.state === 'stopped'", timeout=30_000)
    shown = len(page.query_selector_all("#continuation-base .gen-tok"))
    page.wait_for_timeout(1500)
    assert len(page.query_selector_all("#continuation-base .gen-tok")) == shown < int(page.get_attribute("#max-new-tokens", "max"))
    page_log.check()


def test_lm_view_on_a_phone(browser, live_server):
    with phone_page(browser) as page:
        open_prompt(page, live_server)
        page.fill("#max-new-tokens", "4")
        generate_and_wait(page)
        assert_fits_a_phone(page)
        screenshot(page, "lm-04-phone")
