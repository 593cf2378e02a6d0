"""The encoder–decoder view of the text page on a tiny random BART (built from a config by tests/tiny_models.py,
no download), served as an operator's extra model (settings.extra_models: the family is read from its config): the attention kind selector, cross-attention maps with the
target's N tokens as query rows and the source's M tokens as key columns, the decoded target with its
per-token probabilities, and interventions that name the kind they act on."""
from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import quote

import pytest

from tests.browser.conftest import masked_cells, plot_data, screenshot, serve_app, shown_p
from tests.browser.test_text_page import HEATMAP, wait_for_heatmap
from tests.tiny_models import build_text_model

SOURCE = "the cat sat on the red mat because it was tired"
TARGET = "a dog ran"


@pytest.fixture(scope="module")
def bart_server(tmp_path_factory):
    folder = build_text_model("bart", tmp_path_factory.mktemp("models") / "tiny-bart")
    # the tiny BART alone: the default minilm and smollm2-135m are not used here (not loaded and timed at start-up)
    yield from serve_app({"ATTNLAB_EXTRA_MODELS": json.dumps({"tiny-bart": str(folder)}),
                          "ATTNLAB_DEFAULT_MODELS": '["tiny-bart"]'}, "browser-server-bart.log")


# true when the heatmap's drawn z differs from z0 somewhere by > 1e-3 (differs = true) or nowhere by > 1e-6 (false)
DRAWN_DIFFERS = """([sel, z0, differs]) => {
  const t = document.querySelector(sel)?.data?.[0];
  if (!t || t.z.length !== z0.length) return false;
  const gap = Math.max(...t.z.map((row, i) => Math.max(...row.map((v, j) => Math.abs(v - z0[i][j])))));
  return differs ? gap > 1e-3 : gap < 1e-6;
}"""


def wait_idle(page):
    page.wait_for_function("() => /tokens/.test(document.getElementById('status').textContent)", timeout=60_000)


def test_cross_attention_view(page, page_log, bart_server):
    page.goto(f"{bart_server}/#m=tiny-bart&t={quote(SOURCE)}&tg={quote(TARGET)}&k=encoder")
    wait_for_heatmap(page)
    wait_idle(page)
    assert page.is_visible("#kind-select") and page.is_visible("#target-input") and not page.is_visible("#pair-box")
    assert page.input_value("#target-input") == TARGET
    source = page.locator("#token-strip .tok").all_inner_texts()
    target = page.locator("#target-tokens .tok").all_inner_texts()
    m, n = len(source), len(target)
    assert m > n > 1
    encoder = plot_data(page, HEATMAP)
    assert len(encoder) == m and all(len(row) == m for row in encoder)

    bodies = []
    page.on("request", lambda r: bodies.append(json.loads(r.post_data)) if r.url.endswith("/api/text/attention") else None)
    page.select_option("#kind-select", "cross")
    page.wait_for_function("() => document.getElementById('heatmap-title').textContent.startsWith('cross')", timeout=60_000)
    wait_idle(page)
    cross = plot_data(page, HEATMAP)
    assert len(cross) == n and all(len(row) == m for row in cross), "cross-attention: N target rows × M source columns"
    assert all(abs(sum(row) - 1) < 1e-4 for row in cross)
    keys, queries = page.eval_on_selector(HEATMAP, "el => [el.data[0].x, el.data[0].y]")
    assert [label.split(":", 1)[1] for label in keys] == source  # keys on x: the source
    # queries on y: the decoder's input positions (the target shifted right behind the start token)
    assert len(queries) == n and [label.split(":", 1)[1] for label in queries][-3:] == TARGET.split()
    assert "k=cross" in page.url
    screenshot(page, "seq2seq-cross")

    # the map mode (issue 22 §3): the cross rows weighted by the source tokens' values, from the server
    page.select_option("#weighting-select", "value_norm")
    page.wait_for_function(DRAWN_DIFFERS, arg=[HEATMAP, cross, True], timeout=60_000)
    wait_idle(page)
    weighted = plot_data(page, HEATMAP)
    assert len(weighted) == n and all(abs(sum(row) - 1) < 1e-4 for row in weighted)
    assert max(abs(a - b) for ra, rb in zip(weighted, cross) for a, b in zip(ra, rb)) > 1e-3
    assert bodies and bodies[-1]["weighting"] == "value_norm"
    page.select_option("#weighting-select", "attention")
    page.wait_for_function(DRAWN_DIFFERS, arg=[HEATMAP, cross, False], timeout=60_000)  # P again
    wait_idle(page)
    bodies.clear()

    # An intervention made while the cross-attention is shown names that kind.
    page.check("#ablate-toggle")
    page.wait_for_selector('#interventions-list .iv-row[data-key="ablate"]', timeout=60_000)
    page.wait_for_function("() => /hidden cosine/.test(document.getElementById('effect-summary').textContent)", timeout=60_000)
    wait_idle(page)
    assert "cross attention" in page.inner_text('#interventions-list .iv-row[data-key="ablate"]')
    sent = [iv for body in bodies for iv in body["interventions"]]
    assert sent and all(iv["kind"] == "cross" for iv in sent)
    after = page.eval_on_selector("#target-probs-plot", "el => el.data.map(t => t.y)")
    assert len(after) == 2 and all(len(ys) == n for ys in after)  # before and after, one bar per target token

    # The JSON export holds every kind's map as plain lists.
    with page.expect_download(timeout=30_000) as dl:
        page.click("#export-json")
    exported = json.loads(Path(dl.value.path()).read_text())
    assert set(exported["response"]["attention"]) == {"encoder", "decoder", "cross"}
    assert len(exported["response"]["attention"]["cross"][0][0]) == n and len(exported["response"]["attention"]["cross"][0][0][0]) == m

    # The decoder's self-attention is causal over the target.
    page.uncheck("#ablate-toggle")
    page.select_option("#kind-select", "decoder")
    page.wait_for_function("() => document.getElementById('heatmap-title').textContent.startsWith('decoder')", timeout=60_000)
    wait_idle(page)
    decoder = shown_p(page)
    assert len(decoder) == n and all(decoder[i][j] == 0 for i in range(n) for j in range(i + 1, n))
    assert len(masked_cells(page)) == n * (n - 1) // 2  # drawn grey: the decoder's own causal mask
    assert page.is_disabled("#causal-toggle") and page.is_checked("#causal-toggle")  # built in, not a control
    screenshot(page, "seq2seq-decoder")
    page_log.check()
