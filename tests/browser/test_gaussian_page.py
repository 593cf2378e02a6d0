"""Browser journey on /gaussian: opens drawn, the epoch slider and play animate the centers, a head and
a query can be chosen, α sharpens the pattern, the convolution panel follows its controls."""
from __future__ import annotations

from tests.browser.conftest import screenshot

TRACE_COUNT = "el => (el.data || []).length"


def centers_xy(pg):
    """x/y of every head-marker trace in the centers figure (the ones carrying customdata)."""
    return pg.eval_on_selector(
        "#centers-plot",
        "el => (el.data || []).filter(t => t.customdata).map(t => [Array.from(t.x), Array.from(t.y), Array.from(t.marker.size)])",
    )


def readout(pg, sel):
    return pg.eval_on_selector(sel, "el => el.textContent")


def wait_drawn(pg, selector, timeout=60_000):
    pg.wait_for_function(
        "sel => { const el = document.querySelector(sel); return el && el.data && el.data.length > 0 }",
        arg=selector, timeout=timeout)


def test_gaussian_page_journey(live_server, page, page_log):
    page.goto(f"{live_server}/gaussian")
    for sel in ("#centers-plot", "#attention-plot", "#conv-plot", "#conv-error-plot", "#gelu-plot"):
        wait_drawn(page, sel)
    page.wait_for_function("() => document.querySelector('#alpha-readout').textContent.includes('P there')")
    page.wait_for_function("() => document.querySelector('#conv-readout').textContent.includes('max |error|')")
    assert page.locator(".js-plotly-plot").count() >= 5
    # drawn traces in the SVG, not just data: one scatter layer per head-marker trace
    assert page.locator("#centers-plot .scatterlayer .trace").count() >= 3
    assert page.locator("#attention-plot .hm, #attention-plot image").count() >= 1
    screenshot(page, "gaussian-open")

    n_layers = len(centers_xy(page))
    assert n_layers >= 2
    last = centers_xy(page)
    slider = page.locator("#epoch-slider")
    assert int(slider.get_attribute("max")) >= 1
    epoch_text = readout(page, "#epoch-readout")

    # move the slider to epoch 0: the centers are the initial ones, the figure changes
    slider.evaluate("el => { el.value = el.min; el.dispatchEvent(new Event('input', {bubbles: true})); }")
    page.wait_for_function("t => document.querySelector('#epoch-readout').textContent !== t", arg=epoch_text)
    first = centers_xy(page)
    assert first != last
    assert "epoch 0" in readout(page, "#epoch-readout")
    screenshot(page, "gaussian-epoch0")

    # play animates forward to the last epoch
    page.click("#play-button")
    page.wait_for_function(
        "() => { const s = document.querySelector('#epoch-slider'); return s.value === s.max }", timeout=60_000)
    page.wait_for_function("() => document.querySelector('#play-button').textContent.includes('Play')", timeout=10_000)
    assert centers_xy(page) == last

    # choose layer 1 head 2 through the selects, then move the query by clicking the attention grid
    page.select_option("#layer-select", "1")
    page.select_option("#head-select", "2")
    page.wait_for_function("() => document.querySelector('#head-title').textContent.includes('layer 1, head 2')")
    before = readout(page, "#head-title")
    box = page.locator("#attention-plot .nsewdrag").first.bounding_box()
    page.mouse.click(box["x"] + box["width"] * 0.1, box["y"] + box["height"] * 0.1)
    page.wait_for_function("t => document.querySelector('#head-title').textContent !== t", arg=before)
    assert "query (0, 0)" in readout(page, "#head-title") or "query (1, 1)" in readout(page, "#head-title")

    # α to the top of the slider: P at q + μ is printed and close to 1 (when q + μ is on the grid)
    page.locator("#alpha-slider").evaluate(
        "el => { el.value = el.max; el.dispatchEvent(new Event('input', {bubbles: true})); }")
    page.wait_for_function("() => document.querySelector('#alpha-readout').textContent.includes('α = 1.000e+6')")
    text = readout(page, "#alpha-readout")
    if "outside the grid" not in text:
        prob = float(text.split("P there = ")[1].split(" ")[0])
        assert prob > 0.999
    screenshot(page, "gaussian-head-alpha")

    # convolution panel: padding none at large α → interior matches, border does not
    page.locator("#conv-alpha-slider").evaluate(
        "el => { el.value = el.max; el.dispatchEvent(new Event('input', {bubbles: true})); }")
    page.select_option("#conv-padding", "none")
    page.wait_for_function("() => document.querySelector('#conv-readout').textContent.includes('zero-token border = 0')")
    conv_text = readout(page, "#conv-readout")
    interior = float(conv_text.split("interior max |error| = ")[1].split(" ")[0])
    overall = float(conv_text.split("· max |error| = ")[1].split(" ")[0])
    assert interior < 1e-5 < 0.1 < overall
    page.select_option("#conv-padding", "zeros")
    page.select_option("#conv-kernel", "5")
    page.wait_for_function("() => document.querySelector('#conv-readout').textContent.startsWith('25 heads')")
    conv_text = readout(page, "#conv-readout")
    assert float(conv_text.split("· max |error| = ")[1].split(" ")[0]) < 1e-5
    assert "Stride" in readout(page, "#stride-note")
    assert page.locator("#cost-table tr").count() >= 5
    screenshot(page, "gaussian-conv")
    page_log.check()


def test_clicking_a_head_selects_it(live_server, page, page_log):
    page.goto(f"{live_server}/gaussian")
    wait_drawn(page, "#centers-plot")
    page.wait_for_function("() => document.querySelector('#head-title').textContent.includes('layer 0, head 0')")
    # click the most isolated head of layer 0 where Plotly drew it (hover first: Plotly picks on hover)
    head_traces = page.eval_on_selector("#centers-plot", "el => el.data.map((t, i) => t.customdata ? i : -1).filter(i => i >= 0)")
    xs, ys, _ = centers_xy(page)[0]
    isolation = [min(((xs[i] - xs[j]) ** 2 + (ys[i] - ys[j]) ** 2) for j in range(len(xs)) if j != i) for i in range(len(xs))]
    head = max(range(len(xs)), key=lambda i: isolation[i] if i != 0 else -1)
    target = page.locator(f"#centers-plot .scatterlayer .trace:nth-child({head_traces[0] + 1}) .points path.point").nth(head)
    box = target.bounding_box()
    x, y = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
    page.mouse.move(x - 3, y - 3)
    page.mouse.move(x, y)
    page.wait_for_timeout(300)
    page.mouse.click(x, y)
    page.wait_for_function("h => document.querySelector('#head-title').textContent.includes('layer 0, head ' + h)", arg=head)
    assert page.locator("#head-select").input_value() == str(head)
    page_log.check()
