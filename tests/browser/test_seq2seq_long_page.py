"""A long encoder–decoder input on the text page (issue 20), in Debian's Chromium: a tiny random BART (tests/tiny_models.py,
no download) served as an operator's extra model with full_map_tokens lowered to 8 so that a sentence is "long". The
response carries an overview per kind (encoder, decoder, cross); the page draws the chosen kind's overview, the kind
select switches it from the same run, cross-attention's overview has the target's queries as rows and the source's
keys as columns, and a zoomed cross window loads exactly the API's window (requested with kind) with target/source
labels. The panels that have nothing to show at this length say so; the status line shows no error."""
from __future__ import annotations

import json
import re
import urllib.request
from urllib.parse import quote

import numpy as np
import pytest

from tests.browser.conftest import SCREENSHOTS, screenshot, serve_app
from tests.tiny_models import build_text_model

SOURCE = ("the cat sat on the mat because it was tired , the dog ran on the street . a big red car did not cross "
          "the small blue house")
TARGET = "the dog sat on the rug because it was tired"
OVERVIEW = "() => document.getElementById('heatmap').dataset.atlas === 'overview'"


@pytest.fixture(scope="module")
def long_bart_server(tmp_path_factory):
    folder = build_text_model("bart", tmp_path_factory.mktemp("models") / "tiny-bart")
    yield from serve_app({"ATTNLAB_EXTRA_MODELS": json.dumps({"tiny-bart": str(folder)}),
                          "ATTNLAB_DEFAULT_MODELS": '["tiny-bart"]', "ATTNLAB_FULL_MAP_TOKENS": "8",
                          "ATTNLAB_OVERVIEW_BLOCKS": "16"}, "browser-server-bart-long.log")


def _status_ok(page):
    status = page.eval_on_selector("#status", "el => ({text: el.textContent, error: el.classList.contains('error')})")
    assert not status["error"], status["text"]
    return status["text"]


def _overview(page):
    return page.eval_on_selector("#heatmap", """el => ({z: el.data[0].z, x: Array.from(el.data[0].x), y: Array.from(el.data[0].y),
        title: el.layout.title.text, note: document.getElementById('atlas-note').textContent})""")


def test_long_seq2seq_overview_per_kind_and_cross_window(page, page_log, long_bart_server):
    windows = []
    page.on("request", lambda r: windows.append(json.loads(r.post_data)) if r.url.endswith("/window") else None)
    page.goto(f"{long_bart_server}/#m=tiny-bart&t={quote(SOURCE)}&tg={quote(TARGET)}&k=encoder")
    page.wait_for_function(OVERVIEW, timeout=120_000)
    page.wait_for_function("() => /overview/.test(document.getElementById('status').textContent)", timeout=60_000)
    _status_ok(page)
    source = page.locator("#token-strip .tok").all_inner_texts()
    m = len(source)
    assert m > 8  # over full_map_tokens: the long path
    encoder = _overview(page)
    run = page.get_attribute("#heatmap", "data-run")
    assert re.fullmatch(r"[a-z0-9]{4,16}\.[0-9a-f]{32}", run) and page.get_attribute("#heatmap", "data-kind") == "encoder"
    # the encoder's overview is source × source in at most 16 blocks a side, its edges ending at the source's length
    assert 1 < len(encoder["z"]) <= 16 and len(encoder["z"]) == len(encoder["z"][0])
    assert max(encoder["y"]) < m and max(encoder["x"]) < m and max(encoder["x"]) > m - 6
    assert "encoder" in encoder["title"] and "source tokens" in encoder["note"]
    # the panels that work per kind: received of the encoder over the source; the decoded target below
    page.wait_for_function("() => document.getElementById('received-plot').dataset.n", timeout=60_000)
    assert int(page.get_attribute("#received-plot", "data-n")) == m
    page.wait_for_function("() => document.querySelectorAll('#target-tokens .tok').length > 0", timeout=60_000)
    n = page.locator("#target-tokens .tok").count()
    assert 1 < n < m
    assert "not computed" in page.inner_text("#modelview")  # no thumbnails at long inputs: said, not failed
    screenshot(page, "long-seq2seq-01-encoder")

    # cross-attention: the same run (the server's cache), a non-square overview — target queries × source keys
    page.select_option("#kind-select", "cross")
    page.wait_for_function("() => document.getElementById('heatmap').layout.title.text.includes('cross')", timeout=60_000)
    page.wait_for_function(OVERVIEW, timeout=60_000)
    page.wait_for_function("() => /overview/.test(document.getElementById('status').textContent)", timeout=60_000)
    _status_ok(page)
    # no new model run: the server's cached run answers every kind
    assert page.get_attribute("#heatmap", "data-run") == run and page.get_attribute("#heatmap", "data-kind") == "cross"
    cross = _overview(page)
    rows, cols = len(cross["z"]), len(cross["z"][0])
    assert rows != cols and rows <= n and max(cross["y"]) < n <= max(cross["y"]) + n / rows + 1e-9
    assert max(cross["x"]) > m - 6 and max(cross["x"]) < m  # keys: the whole source
    assert f"{n} target queries × {m} source keys" in cross["note"]
    layout = page.eval_on_selector("#heatmap", "el => [el._fullLayout.xaxis.title.text, el._fullLayout.yaxis.title.text]")
    assert layout == ["key (source token)", "query (target token)"]
    assert int(page.get_attribute("#received-plot", "data-n")) == m  # cross received: over the source's keys
    assert page.locator("#token-strip .tok").all_inner_texts() == source

    # a zoomed cross window: exact P from the server for kind cross, labelled target × source
    page.evaluate(f"""() => Plotly.relayout('heatmap', {{'xaxis.range[0]': 2, 'xaxis.range[1]': 20,
                                                       'yaxis.range[0]': {n}, 'yaxis.range[1]': 0}})""")
    page.wait_for_function("() => document.getElementById('heatmap').dataset.atlas === 'window-labels'", timeout=60_000)
    _status_ok(page)
    shown = page.eval_on_selector("#heatmap", """el => ({z: el.data[0].z, x: Array.from(el.data[0].x), y: Array.from(el.data[0].y),
        xt: el.layout.xaxis.ticktext, yt: el.layout.yaxis.ticktext})""")
    assert shown["x"] == list(range(2, 20)) and shown["y"] == list(range(n))
    assert [t.split(":", 1)[1] for t in shown["xt"]] == source[2:20]
    target = page.locator("#target-tokens .tok").all_inner_texts()
    assert len(shown["yt"]) == n and shown["yt"][0].startswith("0:")
    asked = windows[-1]
    assert asked["kind"] == "cross" and asked["rows"] == [0, n] and asked["cols"] == [2, 20]
    request = urllib.request.Request(f"{long_bart_server}/api/runs/{run}/window", method="POST",
                                     data=json.dumps({**asked, "encoding": "json"}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        api = json.load(response)["attention"]  # (n, 18)
    assert len(api) == n and np.array_equal(np.array(api, dtype=np.float32), np.array(shown["z"], dtype=np.float32))
    # the head view follows the window: target queries, source keys
    page.wait_for_function("() => document.getElementById('headview').dataset.window", timeout=60_000)
    assert json.loads(page.get_attribute("#headview", "data-window")) == {"rows": [0, n], "cols": [2, 20]}
    screenshot(page, "long-seq2seq-02-cross-window")
    page.locator("#heatmap").screenshot(path=str(SCREENSHOTS / "long-seq2seq-cross-window-heatmap.png"))
    assert target  # the decoded target stays shown

    # a query row of the cross map: over every source key, sums to 1
    page.evaluate("() => document.getElementById('heatmap').emit('plotly_click', {points: [{y: 2.2, x: 3}]})")
    page.wait_for_function("() => (document.getElementById('atlas-row').data || []).length > 0", timeout=60_000)
    row = page.eval_on_selector("#atlas-row", "el => Array.from(el.data[0].y)")
    assert len(row) == m and abs(sum(row) - 1) < 1e-4

    # the decoder: target × target, a new view of the same run
    page.select_option("#kind-select", "decoder")
    page.wait_for_function("() => document.getElementById('heatmap').layout.title.text.includes('decoder')", timeout=60_000)
    page.wait_for_function(OVERVIEW, timeout=60_000)
    decoder = _overview(page)
    assert len(decoder["z"]) == len(decoder["z"][0]) and max(decoder["x"]) < n and max(decoder["y"]) < n
    page.wait_for_function("() => /overview/.test(document.getElementById('status').textContent)", timeout=60_000)
    _status_ok(page)
    assert not page_log.errors, page_log.errors
