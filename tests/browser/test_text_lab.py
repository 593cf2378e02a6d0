"""The text page as a laboratory (issue 5), in Debian's Chromium: perturb and see the effect change,
masks/ablation with scopes and resets, head summaries, the softmax panel, export, and a shareable URL
that restores the same view. Every test also checks: no console errors, nothing fetched from outside."""
from __future__ import annotations

import json
import math

from tests.browser.conftest import plot_data, screenshot

HEATMAP = "#heatmap.js-plotly-plot"
DIFF = "#diff-heatmap.js-plotly-plot"


def wait_for_heatmap(page):
    page.wait_for_function(
        "sel => { const el = document.querySelector(sel); return el && el.data && el.data.length && el.data[0].z; }",
        arg=HEATMAP, timeout=60_000,
    )


def wait_idle(page):
    """The page's status line shows the token count once a load has finished (not 'running…')."""
    page.wait_for_function("() => /tokens/.test(document.getElementById('status').textContent)", timeout=60_000)


def set_number(page, selector, value):
    page.fill(selector, str(value))
    page.dispatch_event(selector, "change")


def set_slider(page, value):
    page.eval_on_selector("#beta-slider", "(el, v) => { el.value = v; el.dispatchEvent(new Event('input', {bubbles: true})); }", value)


def controls(page) -> dict:
    return page.evaluate("""() => ({
        layer: document.getElementById('layer-select').value,
        head: document.getElementById('head-select').value,
        beta: document.getElementById('beta-slider').value,
        mode: document.getElementById('mode-select').value,
        masks: document.getElementById('mask-list').textContent,
        maskScope: document.getElementById('mask-scope').value,
        perturbTarget: document.getElementById('perturb-target').value,
        perturbChosen: document.getElementById('perturb-chosen').textContent,
        sigma: document.getElementById('perturb-sigma').value,
        samples: document.getElementById('perturb-samples').value,
        perturbOn: document.getElementById('perturb-apply').textContent,
        list: document.getElementById('interventions-list').textContent,
        text: document.getElementById('text-input').value,
    })""")


def close(a, b, tol=1e-6):
    return len(a) == len(b) and all(abs(x - y) <= tol for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def test_perturb_export_and_reload_restores_the_view(page, page_log, live_server, tmp_path):
    page.goto(live_server + "/#m=minilm")
    wait_for_heatmap(page)
    wait_idle(page)
    assert "no interventions" in page.inner_text("#effect-summary")

    # Select layer 2, head 3 from the sortable summary table: the selection follows everywhere.
    page.click('#summary-table tr[data-layer="2"][data-head="3"]')
    page.wait_for_function("() => document.getElementById('heatmap-title').textContent.startsWith('layer 2, head 3')", timeout=30_000)
    wait_idle(page)
    assert page.input_value("#layer-select") == "2" and page.input_value("#head-select") == "3"
    P = plot_data(page, HEATMAP)

    # Perturb key 4 (σ = 3): the effect appears, and only column 4 moves in each row (SPEC §4).
    j = 4
    page.click(f'#perturb-tokens .tok[data-index="{j}"]')
    set_number(page, "#perturb-sigma", 3)
    page.click("#perturb-apply")
    page.wait_for_selector('#interventions-list .iv-row[data-key="perturb"]', timeout=30_000)
    page.wait_for_function("() => /TV at L2 h3/.test(document.getElementById('effect-summary').textContent)", timeout=60_000)
    wait_idle(page)
    effect_one = page.inner_text("#effect-summary")
    P_hat = plot_data(page, HEATMAP)
    diff = plot_data(page, DIFF)
    assert close([[a - b for a, b in zip(r1, r2)] for r1, r2 in zip(P_hat, P)], diff, 1e-5)
    assert max(abs(row[j]) for row in diff) > 1e-3, "perturbing key j must move column j"
    for i, (row_hat, row) in enumerate(zip(P_hat, P)):
        ratios = [row_hat[k] / row[k] for k in range(len(row)) if k != j and row[k] > 1e-4]
        assert max(ratios) - min(ratios) < 1e-3 * max(ratios), f"row {i}: other keys must rescale by one factor"
    assert page.locator("#hidden-cosine-plot .scatterlayer .trace").count() >= 1
    assert page.inner_text("#output-effect").strip()

    # n = 3 samples: mean ± spread, and the numbers in the DOM change.
    set_number(page, "#perturb-samples", 3)
    page.wait_for_function("() => /n = 3 samples/.test(document.getElementById('effect-summary').textContent)", timeout=60_000)
    wait_idle(page)
    effect_three = page.inner_text("#effect-summary")
    assert effect_three != effect_one and "±" in effect_three
    error_bars = page.evaluate("() => document.getElementById('hidden-cosine-plot').data[0].error_y?.array")
    assert error_bars and len(error_bars) == 7

    # Mask a key too, and sharpen the shown head in view mode (browser-side re-normalisation).
    page.locator("#token-strip .tok").nth(2).click()
    page.wait_for_function("() => document.getElementById('mask-list').textContent.includes('2:')", timeout=30_000)
    page.wait_for_function("(sel) => document.querySelector(sel).data[0].z.every(row => row[2] === 0)", arg=HEATMAP, timeout=60_000)
    wait_idle(page)
    page.select_option("#mode-select", "view")
    wait_idle(page)
    before_slider = plot_data(page, HEATMAP)
    set_slider(page, "0.7")
    page.wait_for_function("(args) => JSON.stringify(document.querySelector(args[0]).data[0].z) !== args[1]",
                           arg=[HEATMAP, json.dumps(before_slider)], timeout=30_000)
    page.wait_for_timeout(300)
    screenshot(page, "text-lab-perturbed")

    # Export: the response as JSON, the heatmap as PNG.
    with page.expect_download(timeout=30_000) as dl:
        page.click("#export-json")
    path = tmp_path / "response.json"
    dl.value.save_as(path)
    exported = json.loads(path.read_text())
    ops = [iv["op"] for iv in exported["request"]["interventions"]]
    assert ops == ["mask_keys", "perturb_keys"] and exported["request"]["samples"] == 3
    assert exported["response"]["tokens"][0] == "[CLS]" and exported["response"]["effect"]["samples"] == 3
    with page.expect_download(timeout=30_000) as dl:
        page.click("#export-png")
    png = tmp_path / "heatmap.png"
    dl.value.save_as(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5_000
    with page.expect_download(timeout=30_000) as dl:
        page.click('[data-png-for="diff-heatmap"] .export-png')
    assert dl.value.suggested_filename.endswith(".png")

    # The URL carries the view: reload (a fresh page from the same link) and get the same view back.
    url = page.url
    assert "#" in url and "pk=4" in url and "mk=2" in url
    shown = controls(page)
    z = plot_data(page, HEATMAP)
    page.reload()
    wait_for_heatmap(page)
    wait_idle(page)
    page.wait_for_function("() => /TV at L2 h3/.test(document.getElementById('effect-summary').textContent)", timeout=60_000)
    assert controls(page) == shown
    assert close(plot_data(page, HEATMAP), z, 1e-6)
    assert "n = 3 samples" in page.inner_text("#effect-summary")
    screenshot(page, "text-lab-restored")
    page_log.check()


def test_masks_ablation_scopes_and_resets(page, page_log, live_server):
    page.goto(live_server + "/#m=minilm")
    wait_for_heatmap(page)
    wait_idle(page)
    original = plot_data(page, HEATMAP)

    # Causal mask over every layer: the upper triangle of P is zero and rows still sum to 1.
    page.check("#causal-toggle")
    page.wait_for_function("(sel) => document.querySelector(sel).data[0].z[0][1] === 0", arg=HEATMAP, timeout=60_000)
    wait_idle(page)
    z = plot_data(page, HEATMAP)
    assert all(z[i][j] == 0 for i in range(len(z)) for j in range(i + 1, len(z)))
    assert all(abs(sum(row) - 1) < 1e-4 for row in z)
    assert "all layers & heads" in page.inner_text('#interventions-list .iv-row[data-key="causal"]')

    # One-click reset brings the original pattern back.
    page.click("#causal-reset")
    page.wait_for_function("(sel) => document.querySelector(sel).data[0].z[0][1] > 0", arg=HEATMAP, timeout=60_000)
    wait_idle(page)
    assert close(plot_data(page, HEATMAP), original, 1e-6)
    assert not page.is_checked("#causal-toggle")

    # Ablating the shown head leaves its own pattern alone but changes what follows (SPEC §3).
    page.check("#ablate-toggle")
    page.wait_for_function("() => /last-layer hidden cosine/.test(document.getElementById('effect-summary').textContent)", timeout=60_000)
    wait_idle(page)
    assert close(plot_data(page, HEATMAP), original, 1e-6)
    cosines = page.evaluate("() => document.getElementById('hidden-cosine-plot').data[0].y")
    assert cosines[0] > 0.999999 and cosines[-1] < 0.999999
    # The scope is editable in the list of active interventions.
    page.select_option('#interventions-list .iv-row[data-key="ablate"] select', "layer")
    page.wait_for_function("() => document.querySelector('#interventions-list .iv-row[data-key=\"ablate\"]')?.textContent.includes('all heads')", timeout=60_000)
    assert page.input_value("#ablate-scope") == "layer"
    wait_idle(page)
    page.click("#reset-all")
    page.wait_for_function("() => document.getElementById('interventions-list').textContent.includes('none')", timeout=60_000)
    wait_idle(page)

    # Bad input is said with the field's name, never silently: the header says a run failed, the message is under Run
    set_number(page, "#perturb-sigma", 100000)
    page.click("#perturb-apply")
    page.wait_for_function("() => document.getElementById('status').classList.contains('error')", timeout=60_000)
    page.wait_for_function("() => !document.getElementById('run-error').hidden", timeout=60_000)
    assert "noise_std" in page.inner_text("#run-error")
    screenshot(page, "text-lab-bad-input")
    # Chromium logs the expected 422 response itself as a console error; nothing else may appear.
    page_log.errors = [e for e in page_log.errors if "status of 422" not in e]
    page_log.check()


def test_summaries_and_softmax_panel(page, page_log, live_server):
    page.goto(live_server + "/#m=minilm")
    wait_for_heatmap(page)
    wait_idle(page)
    response = page.evaluate("() => fetch('/api/text/attention', {method: 'POST', headers: {'Content-Type': 'application/json'},"
                             " body: JSON.stringify({text: document.getElementById('text-input').value,"
                             " text_pair: document.getElementById('pair-input').value, layers: [0], heads: [0]})}).then(r => r.json())")
    entropy = plot_data(page, "#summary-entropy.js-plotly-plot")
    distance = plot_data(page, "#summary-distance.js-plotly-plot")
    assert close(entropy, response["entropy"], 1e-9) and close(distance, response["mean_distance"], 1e-9)
    n = len(response["tokens"])
    assert all(0 <= d <= n - 1 for row in distance for d in row)

    # Sortable: clicking "entropy" twice gives descending order.
    def column(k):
        return [float(t) for t in page.locator(f"#summary-table tbody tr td:nth-child({k})").all_inner_texts()]
    ascending = column(3)
    assert ascending == sorted(ascending) and len(ascending) == 72
    page.click('#summary-table th[data-sort="entropy"]')
    assert column(3) == sorted(ascending, reverse=True)
    page.click('#summary-table th[data-sort="distance"]')
    assert column(4) == sorted(column(4))

    # A click on a summary heatmap cell selects that head everywhere.
    page.evaluate("() => document.getElementById('summary-entropy').emit('plotly_click', {points: [{x: 4, y: 1}]})")
    page.wait_for_function("() => document.getElementById('heatmap-title').textContent.startsWith('layer 1, head 4')", timeout=30_000)
    wait_idle(page)
    assert page.input_value("#layer-select") == "1" and page.input_value("#head-select") == "4"
    assert page.locator("#summary-table tr.selected").get_attribute("data-head") == "4"

    # The softmax panel: the query row at the current β matches the heatmap's row, and its Jacobian.
    page.select_option("#softmax-query", "5")
    bars = page.evaluate("() => document.getElementById('softmax-bars').data[0].y")
    assert close([bars], [plot_data(page, HEATMAP)[5]], 1e-6)
    jac = plot_data(page, "#softmax-jacobian.js-plotly-plot")
    beta = response["native_beta"]
    assert all(abs(jac[a][b] - beta * ((bars[a] if a == b else 0) - bars[a] * bars[b])) < 1e-9 for a in range(n) for b in range(n))

    # The default vector (−3, 1, 100, 5, −1) at β = 1 saturates: every Jacobian entry ≈ 0.
    page.select_option("#softmax-source", "vector")
    assert page.input_value("#softmax-vector").replace(" ", "") == "-3,1,100,5,-1"
    max_j = float(page.get_attribute("#softmax-readout", "data-max-jacobian"))
    assert max_j < 1e-30
    set_number(page, "#softmax-vector", "1, 2, 3")
    p = [math.exp(v) for v in (1, 2, 3)]
    p = [v / sum(p) for v in p]
    assert abs(float(page.get_attribute("#softmax-readout", "data-max-jacobian")) - max(
        abs((p[a] if a == b else 0) - p[a] * p[b]) for a in range(3) for b in range(3))) < 1e-9
    set_number(page, "#softmax-vector", "1, x")
    page.wait_for_function("() => document.getElementById('status').classList.contains('error')")
    assert "not a finite number" in page.inner_text("#status")
    screenshot(page, "text-lab-summaries-softmax")
    page_log.check()


def test_shared_link_with_a_query_perturbation_changes_only_that_row(page, page_log, live_server):
    # A link made by hand (as a student would share it): layer 1, head 4, perturb query 5 with σ = 3.
    page.goto(live_server + "/#m=minilm&t=The+cat+sat+on+the+warm+mat+all+day.&l=1&h=4&b=0&bm=run&bs=head"
              "&pon=1&pt=queries&pk=5&ps=3&pa=1&pseed=7&pn=1&pscope=head")
    wait_for_heatmap(page)
    page.wait_for_function("() => /TV at L1 h4/.test(document.getElementById('effect-summary').textContent)", timeout=60_000)
    assert page.input_value("#text-input") == "The cat sat on the warm mat all day."
    assert page.input_value("#perturb-target") == "queries" and page.input_value("#perturb-seed") == "7"
    assert page.input_value("#pair-input") == ""
    diff = plot_data(page, DIFF)
    assert max(abs(v) for v in diff[5]) > 1e-3
    # the other rows are the same computation in both runs: their difference is exactly 0
    assert all(v == 0 for i, row in enumerate(diff) if i != 5 for v in row), "only row 5 may change (SPEC §4)"
    # A click on a heatmap cell picks that query row for the softmax panel (and the link remembers it).
    page.evaluate("() => document.getElementById('heatmap').emit('plotly_click', {points: [{pointIndex: [5, 2]}]})")
    assert page.input_value("#softmax-query") == "5"
    assert "q=5" in page.url
    page_log.check()
