"""What the text page shows must be true (issue 18), in Debian's Chromium against the real models: the
continuation stream when one side ends first, the softmax panel's row for a causal model (chosen with the
dropdown, the keyboard path), β scoped to a layer range shown only where it applies, no false "also masked"
warning, and the text page opening on the language model."""
from __future__ import annotations

import math
from urllib.parse import quote

from tests.browser.conftest import masked_cells, screenshot, shown_p
from tests.browser.test_lm_page import continuation, generate_and_wait, wait_idle
from tests.browser.test_text_page import set_slider, wait_for_heatmap

HEATMAP = "#heatmap.js-plotly-plot"
PROMPT = "The capital of France is"


def open_lm(page, live_server, text=PROMPT, extra=""):
    page.goto(f"{live_server}/#m=smollm2-135m&t={quote(text)}{extra}")
    wait_for_heatmap(page)
    wait_idle(page)


def softmax_row(page) -> list[float]:
    return page.eval_on_selector("#softmax-bars", "el => el.data[0].y")


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


def test_a_layer_box_being_typed_in_keeps_what_was_typed_when_the_page_redraws(page, page_log, live_server):
    """The β range's boxes mirror the store on every change. One the user is typing in keeps what they typed: a store
    change landing between the typing and the box's change event (a response, a slider move) wrote the old end back
    into it, and the change then committed that (seen in the suite: layers 0–12 for a typed 10–12)."""
    page.goto(f"{live_server}/#m=minilm")
    wait_for_heatmap(page)
    wait_idle(page)
    page.select_option("#scope-select", "layers")
    page.fill("#beta-from", "3")  # typed: the box has the focus, its change event has not fired yet
    set_slider(page, "-1")  # meanwhile the store changes
    page.dispatch_event("#beta-from", "change")
    page.fill("#beta-to", "5")
    page.dispatch_event("#beta-to", "change")
    page.wait_for_function("() => /[#&]br=3-5(&|$)/.test(location.hash)", timeout=30_000)
    assert page.input_value("#beta-from") == "3" and page.input_value("#beta-to") == "5"
    wait_idle(page)
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


def test_truncation_is_said_next_to_the_text_box_with_tokens_kept_and_dropped(page, page_log, live_server):
    text = " ".join(["the cat sat on a mat and"] * 300)  # 2,100 words: far past minilm's 512 tokens
    page.goto(f"{live_server}/#m=minilm&t={quote(text)}")
    page.wait_for_selector("#truncation-note:not([hidden])", timeout=120_000)
    note = page.inner_text("#truncation-note")
    kept, dropped = (int(page.get_attribute("#truncation-note", f"data-{k}")) for k in ("kept", "dropped"))
    assert kept == 512 and dropped > 1000, (kept, dropped)
    assert "512 tokens kept" in note and f"{dropped:,} of {kept + dropped:,} dropped" in note
    # where the note sits: right under the text box, not only in the status bar
    box, under = (page.locator(sel).bounding_box() for sel in ("#text-input", "#truncation-note"))
    assert 0 <= under["y"] - (box["y"] + box["height"]) < 60
    # a short text clears it
    page.fill("#text-input", "A short sentence.")
    page.click("#run-button")
    page.wait_for_selector("#truncation-note", state="hidden", timeout=60_000)
    page_log.check()


def test_colour_scales_for_long_causal_maps_and_the_share_link(page, page_log, live_server):
    """P[0, 0] = 1 in every causal map, so "this map's max" always tops out at 1 (a dark triangle at 512
    tokens); the LM opens on a log scale, and per-row and rows ≥ k scales are offered; all go into the link."""
    text = " ".join(["The cat sat on the mat and looked at the door."] * 12)  # ~140 tokens
    open_lm(page, live_server, text)
    assert page.input_value("#zscale") == "log" and "zs=log" in page.url
    p = shown_p(page)
    z = page.evaluate("() => document.getElementById('heatmap').data[0].z")
    assert p[0][0] == 1 and abs(z[5][2] - math.log10(max(p[5][2], 1e-4))) < 1e-5
    ticks = page.evaluate("() => document.getElementById('heatmap').data[0].colorbar.ticktext")
    assert ticks[-1] == "1" and "0.01" in ticks
    page.select_option("#zscale", "max")
    page.wait_for_function("() => document.getElementById('heatmap').dataset.scale === 'max'")
    assert page.evaluate("() => document.getElementById('heatmap')._fullData[0].zmax") == 1  # the complaint
    page.select_option("#zscale", "row")
    page.wait_for_function("() => document.getElementById('heatmap').dataset.scale === 'row'")
    z = page.evaluate("() => document.getElementById('heatmap').data[0].z")
    assert all(max(row) == 1 for row in z)  # each row to its own max: m / m is exactly 1
    page.select_option("#zscale", "rowsk")
    page.fill("#zscale-k", "8")
    page.dispatch_event("#zscale-k", "change")
    page.wait_for_function("() => /zk=8/.test(location.hash)")
    zmax = page.evaluate("() => document.getElementById('heatmap')._fullData[0].zmax")
    assert zmax == max(max(row) for row in p[8:]) and zmax < 1  # the max of the shown numbers
    # the P̂ − P figure and its menu are folded with the effect panel until an intervention is used (issue 28): the
    # choice made there still goes into the link
    page.eval_on_selector("#diff-kind", "el => { el.value = 'ratio'; el.dispatchEvent(new Event('change')); }")
    page.wait_for_function("() => /dk=ratio/.test(location.hash)")
    # The link restores both choices.
    page.reload()
    wait_for_heatmap(page)
    wait_idle(page)
    assert page.input_value("#zscale") == "rowsk" and page.input_value("#zscale-k") == "8"
    assert page.input_value("#diff-kind") == "ratio"
    assert page.evaluate("() => document.getElementById('heatmap')._fullData[0].zmax") == zmax  # the same run again
    page_log.check()


def test_masked_cells_drawn_grey_and_a_decoders_causality_built_in(page, page_log, live_server):
    open_lm(page, live_server)
    n = len(shown_p(page))
    assert sorted(map(tuple, masked_cells(page))) == [(i, j) for i in range(n) for j in range(i + 1, n)]
    legend = page.evaluate("() => document.getElementById('heatmap').layout.annotations.map(a => a.text).join(' ')")
    assert "causal" in legend and "built into this decoder" in legend
    # The causal control: ticked, not a control the user could untick, and says why.
    assert page.is_checked("#causal-toggle") and page.is_disabled("#causal-toggle")
    assert page.is_visible("#causal-builtin") and "decoder" in page.inner_text("#causal-builtin")
    # An encoder has no built-in mask: a masked key is a grey column, and causal is the user's control.
    page.goto(f"{live_server}/#m=minilm")
    page.reload()  # a new hash alone does not reload the page
    wait_for_heatmap(page)
    wait_idle(page)
    assert masked_cells(page) == [] and page.is_enabled("#causal-toggle") and not page.is_checked("#causal-toggle")
    assert page.is_hidden("#causal-builtin")
    page.click('#token-strip .tok[data-index="3"]')
    page.wait_for_function("() => document.getElementById('heatmap').dataset.masked !== '0'", timeout=60_000)
    n = len(shown_p(page))
    assert sorted(map(tuple, masked_cells(page))) == [(i, 3) for i in range(n)]
    screenshot(page, "truth-masked-key-grey")
    page_log.check()


def test_white_space_tokens_are_spelled_out_on_every_chip(page, page_log, live_server):
    open_lm(page, live_server, "Dear Sam,\n\nThe  cat\tsat.\n")
    page.wait_for_selector("#perturb-tokens .tok")
    for strip in ("#token-strip .tok", "#perturb-tokens .tok"):
        texts = page.locator(strip).all_inner_texts()
        assert texts and all(t.strip() for t in texts), (strip, texts)
        assert any("\\n" in t for t in texts), texts  # a newline token reads "\n", as in the next-token panel
    labels = page.evaluate("() => document.getElementById('heatmap').data[0].x")
    assert all(label.split(":", 1)[1].strip() for label in labels), labels
    page_log.check()


def test_per_figure_png_names_follow_the_model_shown(page, page_log, live_server):
    page.goto(f"{live_server}/#m=minilm")
    wait_for_heatmap(page)
    wait_idle(page)
    page.select_option("#model-select", "smollm2-135m")
    page.wait_for_function("() => document.getElementById('topk-plot').data", timeout=120_000)
    with page.expect_download() as dl:
        page.click('[data-png-for="topk-plot"] .export-png')
    assert dl.value.suggested_filename == "attnlab-smollm2-135m-topk-plot.png"
    page_log.check()


def test_gaussian_page_at_390_px(browser, live_server):
    """The attention grid spans its rows and no more; axis titles clear of the tick labels; the layers' head
    circles each get a full-width panel; no mode bar over titles or colour bars; "1 head", not "1 heads"."""
    context = browser.new_context(viewport={"width": 390, "height": 844})
    page = context.new_page()
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        page.goto(f"{live_server}/gaussian")
        page.wait_for_function("() => document.getElementById('attention-plot')._fullLayout?.yaxis?.range", timeout=60_000)
        page.wait_for_function("() => document.querySelector('#conv-readout').textContent.includes('max |error|')")
        page.wait_for_timeout(500)
        rows, cols = page.evaluate("() => { const z = document.getElementById('attention-plot').data[0].z; return [z.length, z[0].length]; }")
        y, x = page.evaluate("() => { const L = document.getElementById('attention-plot')._fullLayout; return [L.yaxis.range, L.xaxis.range]; }")
        assert [round(v, 6) for v in y] == [rows - 0.5, -0.5] and [round(v, 6) for v in x] == [-0.5, cols - 0.5], (y, x)
        gap = page.evaluate("""() => { const root = document.getElementById('attention-plot');
            const title = root.querySelector('.g-xtitle text').getBoundingClientRect();
            const ticks = [...root.querySelectorAll('.xtick text')].map(t => t.getBoundingClientRect().bottom);
            return title.top - Math.max(...ticks); }""")
        assert gap >= 0, f"the x-axis title overlaps its tick labels by {-gap:.1f} px"
        panels = page.evaluate("""() => { const L = document.getElementById('centers-plot')._fullLayout;
            return Object.keys(L).filter(k => /^xaxis\\d*$/.test(k)).map(k => L[k]._length); }""")
        assert len(panels) >= 2 and min(panels) >= 250, panels  # stacked: each layer at the figure's width
        bars = page.evaluate("() => [...document.querySelectorAll('.js-plotly-plot')].map(el => [el.id, el._context.displayModeBar])")
        assert bars and all(shown is False for _, shown in bars), bars
        page.select_option("#conv-kernel", "1")
        page.wait_for_function("() => document.querySelector('#conv-readout').textContent.startsWith('1 head ·')")
        screenshot(page, "truth-gaussian-390")
        assert errors == []
    finally:
        context.close()


def test_image_page_upload_error_clears_and_the_size_list_follows_the_model(page, page_log, live_server):
    from tests.browser.test_image_page import wait_idle as wait_image

    page.goto(f"{live_server}/image")
    wait_image(page)
    native = page.evaluate("() => [...document.getElementById('size-select').options].map(o => o.textContent)")
    assert native and native[0].endswith("px (native)")
    page.set_input_files("#file-input", {"name": "notes.txt", "mimeType": "text/plain", "buffer": b"hello"})
    page.wait_for_selector("#upload-error:not([hidden])")
    # a later run that succeeds (an example photo) takes the refusal off the screen
    page.click("#sample-buttons button[data-sample='fashion-sneaker.png']")
    page.wait_for_function("() => /vit-fashion.*tokens/.test(document.getElementById('status').textContent)", timeout=120_000)
    assert page.is_hidden("#upload-error")
    fashion = page.evaluate("() => [...document.getElementById('size-select').options].map(o => o.textContent)")
    assert fashion != native
    # Right after a switch back, before the answer: the sizes of the model now chosen, not the previous one's.
    during = page.evaluate("""() => { const s = document.getElementById('model-select'); s.value = 'dinov2-small';
        s.dispatchEvent(new Event('change')); const z = document.getElementById('size-select');
        return [[...z.options].map(o => o.textContent), z.disabled]; }""")
    assert during == [[native[0]], True], during
    page.wait_for_function("() => /dinov2-small.*tokens/.test(document.getElementById('status').textContent)", timeout=120_000)
    assert page.is_enabled("#size-select") and page.evaluate("() => document.getElementById('size-select').options[0].textContent") == native[0]
    page_log.check()
