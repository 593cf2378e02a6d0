"""The page fetches its maps in the binary form (issue 55 §2, docs/api.md "The binary form"), in Debian's Chromium
against the real minilm: the text page's first view is asked with `Accept: application/octet-stream`, answered as
`application/octet-stream`, and the heatmap shows exactly the numbers of the JSON form of the same request (sent here
apart, decoded from its base64). A window of the kept run, asked by the page's own fetch code (api.js postBinary),
holds the same numbers as the window's JSON form."""
from __future__ import annotations

import base64
import json
from urllib.parse import quote

import httpx
import numpy as np

from tests.browser.conftest import shown_p
from tests.browser.test_text_page import wait_for_heatmap

TEXT = "The quick brown fox jumps over the lazy dog because it was bored."
BINARY = "application/octet-stream"


def _base64(field: dict) -> np.ndarray:
    dtype = {"float32": "<f4", "float16": "<f2"}[field["dtype"]]
    return np.frombuffer(base64.b64decode(field["data"]), dtype=dtype).reshape(field["shape"]).astype(np.float64)


def test_the_text_page_draws_its_maps_from_the_binary_form(page, page_log, live_server):
    answers = []  # (the request's Accept, its body, the response's content type) of each first view

    def heard(response):
        request = response.request
        if request.method == "POST" and request.url.endswith("/api/text/attention"):
            answers.append((request.headers.get("accept", ""), request.post_data,
                            response.headers.get("content-type", "")))

    page.on("response", heard)
    page.goto(f"{live_server}/#m=minilm&t={quote(TEXT)}")
    wait_for_heatmap(page)
    page.wait_for_function("() => !document.getElementById('status').textContent.includes('running')",
                           timeout=120_000)
    assert answers, "the page asked for no first view"
    accept, body, content_type = answers[-1]
    assert BINARY in accept and content_type.startswith(BINARY), answers[-1]

    # the same request in the JSON form: the heatmap shows its numbers, to float32's last bit
    request = json.loads(body)
    served = httpx.post(live_server + "/api/text/attention", json=request, timeout=120)
    served.raise_for_status()
    expected = _base64(served.json()["attention"])[0, 0]  # (T, T): the shown layer's head
    shown = np.array(shown_p(page), dtype=np.float64)
    assert shown.shape == expected.shape and expected.size > 1
    assert np.array_equal(shown, expected), float(np.abs(shown - expected).max())

    # a window of the kept run through the page's fetch code: Float32Arrays with the JSON form's numbers
    run_id = served.json()["run_id"]
    ask = {"layer": 1, "head": 3, "rows": [2, 7], "cols": [0, 9], "include_scores": True, "encoding": "f32"}
    window = page.evaluate("""async ([url, ask]) => {
        const { postBinary } = await import('/static/js/api.js');
        const w = await postBinary(url, ask);
        return { typed: w.attention.values instanceof Float32Array && w.scores.values instanceof Float32Array,
                 attention: Array.from(w.attention.values), scores: Array.from(w.scores.values),
                 shape: w.attention.shape };
    }""", [f"/api/runs/{run_id}/window", ask])
    plain = httpx.post(f"{live_server}/api/runs/{run_id}/window", json=ask, timeout=60).json()
    assert window["typed"] and window["shape"] == [5, 9]
    assert np.array_equal(np.array(window["attention"]), _base64(plain["attention"]).ravel())
    assert np.array_equal(np.array(window["scores"]), _base64(plain["scores"]).ravel())
    page_log.check()
