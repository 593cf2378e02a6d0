"""The circuit view of the text page (static/js/views/circuit.js) on the real smollm2-135m, in Debian's Chromium,
against the real POST /api/text/circuit and /api/text/circuit/edge: the capital task with one pair scored by EAP as
a job (its progress on the page), the graph drawn layer by layer with the edges kept at the budget (the page's own
pruning of every edge's score agrees with the server's count of kept edges at every budget), the slider changing
how many edges are drawn, a mouse click on a drawn <k> edge opening the head's attention row with and without it
(each a softmax row: sums to 1) and its QK attribution with the sender's part outlined, a click on a head showing its
map in the page's heatmap, and the JSON and PNG exports."""
from __future__ import annotations

import json
import re
from urllib.parse import quote

from tests.browser.conftest import SCREENSHOTS

DONE = "() => ['done', 'error'].includes(document.getElementById('circuit-panel').dataset.state)"
PICKS = "el => el.data.find(t => t.meta === 'picks')"


def drawn_lines(page) -> int:
    """How many edge segments the figure's SVG draws: the line traces' path data, one 'M' per segment."""
    return page.eval_on_selector_all(
        "#circuit-graph .scatterlayer .trace path.js-line",
        "paths => paths.reduce((n, p) => n + ((p.getAttribute('d') || '').match(/M/g) || []).length, 0)")


def set_budget(page, index: int) -> None:
    page.eval_on_selector("#circuit-budget", """(el, v) => { el.value = v;
        el.dispatchEvent(new Event('input', {bubbles: true})); el.dispatchEvent(new Event('change', {bubbles: true})); }""",
                          index)


def click_point(page, trace_meta: str, index: int) -> None:
    """A real mouse click on point `index` of the trace tagged `trace_meta` (its SVG marker's centre)."""
    traces = page.eval_on_selector("#circuit-graph", "el => el.data.map(t => t.meta)")
    page.locator("#circuit-graph").scroll_into_view_if_needed()
    box = page.locator("#circuit-graph .scatterlayer .trace").nth(traces.index(trace_meta)) \
        .locator(".points path.point").nth(index).bounding_box()
    x, y = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
    page.mouse.move(x, y)
    page.wait_for_selector("#circuit-graph .hoverlayer .hovertext")  # Plotly's click acts on the hovered point
    page.mouse.click(x, y)


def part_name(node: str) -> str:
    """A node as a QK attribution names its part (docs/science.md): a3.h2 → L3.H2, m4 → L4.mlp, input → embed."""
    if node == "input":
        return "embed"
    m = re.fullmatch(r"a(\d+)\.h(\d+)", node)
    return f"L{m[1]}.H{m[2]}" if m else f"L{node[1:]}.mlp"


def test_the_circuit_view_draws_prunes_and_explains_a_key_edge(live_server, page, page_log, tmp_path):
    page.goto(f"{live_server}/#m=smollm2-135m&t={quote('The capital of France is')}&l=0&h=0")
    page.wait_for_function("() => !document.getElementById('circuit-panel').hidden", timeout=300_000)
    page.select_option("#circuit-task", "capital")
    page.fill("#circuit-n", "1")
    page.select_option("#circuit-method", "eap")
    with page.expect_response(lambda r: r.url.endswith("/api/text/circuit"), timeout=600_000) as answer:
        page.click("#circuit-run")
        page.wait_for_function("() => Number(document.getElementById('circuit-panel').dataset.progress || 0) > 0",
                               timeout=600_000)
        page.wait_for_function(DONE, timeout=600_000)
    assert page.get_attribute("#circuit-panel", "data-state") == "done", page.text_content("#circuit-error")
    sent = json.loads(answer.value.request.post_data)
    assert sent["task"] == {"name": "capital", "n": 1, "seed": 0} and sent["method"] == "eap" and sent["top"] is None
    # the server's answer as the page holds it: what every figure below is checked against
    server = page.evaluate("""() => { const el = document.getElementById('circuit-graph');
        return {layers: el.layout.yaxis.tickvals.length - 2, heads: el.layout.xaxis.tickvals.length - 1}; }""")
    assert server == {"layers": 30, "heads": 9}  # smollm2-135m: 30 layers of 9 heads, MLPs in their own column

    # the graph: as many pick markers as edges drawn, one SVG segment per drawn edge, every node placed
    picks = page.eval_on_selector("#circuit-graph", PICKS)
    drawn = int(page.get_attribute("#circuit-panel", "data-drawn"))
    kept = int(page.get_attribute("#circuit-panel", "data-kept"))
    assert 0 < drawn == len(picks["customdata"]) == min(kept, 300)
    assert drawn_lines(page) == drawn
    nodes = page.eval_on_selector("#circuit-graph", "el => el.data.find(t => t.meta === 'nodes').customdata.length")
    assert nodes == 1 + 30 * (9 + 1) + 1
    # the page's pruning (every edge's |score|, top round(b·|E|), paths input → logits) against the server's count
    counts = page.evaluate("""() => {
        const el = document.getElementById('circuit-budget'), out = [];
        for (let i = 0; i <= Number(el.max); i++) {
            el.value = i; el.dispatchEvent(new Event('input', {bubbles: true}));
            const p = document.getElementById('circuit-panel').dataset;
            out.push([Number(p.budget), Number(p.kept)]);
        }
        return out; }""")
    server_counts = page.evaluate("""() => [...document.querySelectorAll('#circuit-faith')].map(el =>
        el.data[0].x.map((b, i) => [b, el.data[0].customdata[i]]))[0]""")
    assert len(counts) == len(server_counts) >= 5
    for (b, mine), (b_server, theirs) in zip(counts, server_counts):
        assert b == b_server and mine == theirs, (b, mine, theirs)

    # the slider: the smallest budget draws fewer edges than the largest
    set_budget(page, 0)
    page.wait_for_function("b => document.getElementById('circuit-panel').dataset.shown === String(b)", arg=counts[0][0])
    small = drawn_lines(page)
    set_budget(page, len(counts) - 1)
    page.wait_for_function("b => document.getElementById('circuit-panel').dataset.shown === String(b)", arg=counts[-1][0])
    large = drawn_lines(page)
    assert small < large, (small, large)
    assert small == min(counts[0][1], 300) and large == min(counts[-1][1], 300)
    text = page.text_content("#circuit-budget-text")
    assert "kept on paths from input to logits" in text

    # a <k> edge among the drawn ones, clicked with the mouse
    picks = page.eval_on_selector("#circuit-graph", PICKS)["customdata"]
    index = next(i for i, name in enumerate(picks) if name.endswith("<k>"))
    edge = picks[index]
    with page.expect_response(lambda r: r.url.endswith("/api/text/circuit/edge"), timeout=300_000) as edge_answer:
        click_point(page, "picks", index)
        page.wait_for_function("() => ['done', 'error'].includes(document.getElementById('circuit-edge').dataset.state)",
                               timeout=300_000)
    assert page.get_attribute("#circuit-edge", "data-state") == "done", page.text_content("#circuit-edge-status")
    assert json.loads(edge_answer.value.request.post_data)["edge"] == edge
    assert page.text_content("#circuit-edge-title") == edge
    exact = float(page.get_attribute("#circuit-edge", "data-score"))
    assert exact == exact  # a number, not NaN
    rows = page.eval_on_selector("#circuit-edge-row", "el => el.data.map(t => t.y)")
    assert len(rows) == 2 and len(rows[0]) == len(rows[1]) > 1
    for row in rows:  # B's attention row at the query, with and without the edge: softmax rows
        assert abs(sum(row) - 1) < 1e-3 and min(row) >= 0
    assert page.is_visible("#circuit-edge-qk")
    sender = edge.split("->")[0]
    bars = page.eval_on_selector("#circuit-qk-keys", "el => ({y: el.data[0].y, w: el.data[0].marker.line.width})")
    assert "key side" in page.eval_on_selector("#circuit-qk-keys", "el => el.layout.title.text")
    outlined = [name for name, w in zip(bars["y"], bars["w"]) if w > 0]
    assert outlined == [part_name(sender)], (edge, bars)
    assert page.get_attribute("#circuit-edge", "data-part") == part_name(sender)
    assert "sum to" in page.text_content("#circuit-qk-status")
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.locator("#circuit-panel").screenshot(path=str(SCREENSHOTS / "circuit-panel.png"))

    # export: every edge's score and in_graph at this budget, MIB's form
    with page.expect_download(timeout=60_000) as dl:
        page.click("#circuit-json")
    path = tmp_path / "circuit.json"
    dl.value.save_as(path)
    exported = json.loads(path.read_text())
    in_graph = sum(e["in_graph"] for e in exported["edges"].values())
    assert len(exported["edges"]) == exported["n_edges"] and in_graph == counts[-1][1]
    assert exported["edges"][edge]["in_graph"] is True
    with page.expect_download(timeout=60_000) as dl:
        page.click('[data-png-for="circuit-graph"] .export-png')
    png = tmp_path / "circuit.png"
    dl.value.save_as(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # a head node: its map in the page's heatmap (the head picker's selection)
    head_nodes = page.eval_on_selector("#circuit-graph", "el => el.data.find(t => t.meta === 'nodes').customdata")
    target = "a9.h4"
    click_point(page, "nodes", head_nodes.index(target))
    page.wait_for_function("() => document.getElementById('circuit-panel').dataset.opened === 'a9.h4'")
    page.wait_for_function("() => /layer 9, head 4/.test(document.getElementById('heatmap-title').textContent)",
                           timeout=120_000)
    assert page.input_value("#layer-select") == "9" and page.input_value("#head-select") == "4"
    page_log.check()


def test_the_circuit_panel_is_for_decoder_lms_only_and_refuses_bad_pairs_on_the_page(live_server, page, page_log):
    page.goto(f"{live_server}/#m=smollm2-135m&t={quote('The capital of France is')}")
    page.wait_for_function("() => !document.getElementById('circuit-panel').hidden", timeout=300_000)
    assert page.is_hidden("#circuit-results")  # nothing drawn, nothing shown until scored
    assert page.eval_on_selector("#circuit-panel", "e => e.getBoundingClientRect().height") < 320
    # the user's own pairs: a line without answer and wrong is said on the page, nothing sent
    page.select_option("#circuit-task", "pairs")
    assert page.is_visible("#circuit-pairs-box") and page.is_hidden("#circuit-n-box")
    page.fill("#circuit-pairs", "The capital of France is | The capital of Italy is")
    sent = []
    page.on("request", lambda r: sent.append(r.url) if r.url.endswith("/api/text/circuit") else None)
    page.click("#circuit-run")
    assert 'line 1: write "clean | corrupt | answer | wrong"' in page.text_content("#circuit-error")
    assert page.is_visible("#circuit-error") and sent == []
    page.select_option("#circuit-method", "eap_ig")
    assert page.is_visible("#circuit-steps-box")
    page.select_option("#model-select", "minilm")  # a sentence encoder: no circuit of a next token
    page.wait_for_function("() => document.getElementById('circuit-panel').hidden", timeout=120_000)
    page.select_option("#model-select", "smollm2-135m")
    page.wait_for_function("() => !document.getElementById('circuit-panel').hidden", timeout=120_000)
    page_log.check()
