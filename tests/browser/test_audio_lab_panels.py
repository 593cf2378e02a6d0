"""/audio mounts the lab's panels (issue 32 item 7) and shows one token numbering (issue 28 item 9), in Chromium on the
real whisper-tiny-en with the bundled sample:

- the lab's β panel replaces the page's own slider: the interventions sent for a β move, a masked span and a narrower
  β scope are the ones the page sent before (its wire format: no layers/heads for "every cross layer", its order:
  masks, perturbation, β, ablations), and the lab's active list shows them;
- the Δp chart numbers a token as the cross-attention map's rows do (the transcript's first token is 2 on tiny.en,
  after <|startoftranscript|><|notimestamps|>), not from 0;
- the softmax panel's Jacobian is large enough to read: a full-width panel, at most 40 keys (those with the most
  probability), labelled axes."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.browser.conftest import screenshot

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "weights" / "samples" / "speech-sample.wav"


def _next_view(page, views, timeout=300_000):
    page.wait_for_function(f"() => document.body.dataset.views !== '{views}'", timeout=timeout)


def test_speech_page_lab_panels_requests_numbering_and_jacobian(page, page_log, live_server):
    if not SAMPLE.is_file():
        pytest.fail("the speech sample is missing: run `make speech weights`")
    sent = []  # the intervened request's interventions (the "before" request has none and asks for cross only)
    page.on("request", lambda r: sent.append(json.loads(r.post_data)) if r.url.endswith("/api/audio/attention")
            and r.method == "POST" and json.loads(r.post_data)["kinds"] != ["cross"] else None)
    page.goto(f"{live_server}/audio?sample")
    page.wait_for_function("() => document.body.dataset.ready === '1'", timeout=300_000)
    native = page.evaluate("() => fetch('/api/models?kind=audio').then(r => r.json())")
    native_beta = next(m for m in native["models"] if m["id"] == "whisper-tiny-en")["native_beta"]

    # β: five steps right on the lab's slider (step 0.1: log10 β/β₀ = 0.5), scope "every cross layer"
    views = page.get_attribute("body", "data-views")
    page.focus("#beta-slider")
    for _ in range(5):
        page.keyboard.press("ArrowRight")
    _next_view(page, views)
    page.wait_for_timeout(400)  # a move may have drawn before the last step: its run comes next
    page.wait_for_function("() => !/running/.test(document.getElementById('status').textContent)", timeout=300_000)
    ratio = float(page.input_value("#beta-slider"))
    assert abs(ratio - 0.5) < 1e-9
    beta = {"op": "temperature", "kind": "cross", "beta": pytest.approx(native_beta * 10 ** ratio, rel=1e-12)}
    assert sent[-1]["interventions"] == [beta]

    # a masked span (3–5 s = positions 150–249) comes first, as before
    views = page.get_attribute("body", "data-views")
    page.fill("#span-start", "3")
    page.fill("#span-end", "5")
    page.click("#add-span")
    _next_view(page, views)
    mask = {"op": "mask_keys", "kind": "cross", "tokens": list(range(150, 250))}
    assert sent[-1]["interventions"] == [mask, beta]
    rows = page.locator("#interventions-list .iv-row").all_inner_texts()
    assert any("mask 3.00–5.00 s = positions 150–249 (cross)" in r for r in rows), rows
    assert any("β = 3.16·β₀ on cross-attention" in r for r in rows), rows

    # scope "this head": β names the shown layer and head (layer 3, head 0)
    views = page.get_attribute("body", "data-views")
    page.select_option("#scope-select", "head")
    _next_view(page, views)
    assert sent[-1]["interventions"] == [mask, {**beta, "layers": [3], "heads": [0]}]

    # one numbering: each Δp bar's label is the cross map's row label of the same token
    page.wait_for_function("() => document.getElementById('transcript-diff').dataset.changed === '1'", timeout=60_000)
    bars = page.eval_on_selector("#dp-bars", "el => el.data[0].x")
    map_rows = page.eval_on_selector("#cross-map", "el => el.data[0].y")
    first = next(i for i, label in enumerate(map_rows) if not re.match(r"\d+:<\|.*\|>$", label))
    assert first == 2  # <|startoftranscript|><|notimestamps|> then the transcript
    assert int(bars[0].split(":")[0]) == first, (bars[:3], map_rows[:3])
    inside = [b for b in bars if int(b.split(":")[0]) < len(map_rows)]
    assert len(inside) >= len(bars) - 1  # all but <|endoftext|>, which no row is the input of
    assert all(map_rows[int(b.split(":")[0])] == b for b in inside), [(b, map_rows[int(b.split(":")[0])]) for b in inside][:5]

    # the Jacobian: full width, tall, at most 40 labelled keys
    page.wait_for_function("() => document.getElementById('softmax-panel').dataset.view === document.body.dataset.views",
                           timeout=120_000)
    width, height = page.eval_on_selector("#softmax-jacobian", "e => [e.getBoundingClientRect().width, e.getBoundingClientRect().height]")
    assert height >= 450 and width >= 450, (width, height)  # before: 300 px high beside the perturbation panel
    figure = page.eval_on_selector("#softmax-jacobian", """el => ({keys: el.data[0].x.length, z: el.data[0].z.length,
        ticks: el.layout.xaxis.showticklabels && el.layout.yaxis.showticklabels,
        titles: [el.layout.xaxis.title.text, el.layout.yaxis.title.text]})""")
    assert figure["keys"] == figure["z"] <= 40 and figure["ticks"], figure  # before: 335 keys, no tick labels
    assert all(figure["titles"]), figure
    page.locator("#softmax-panel").scroll_into_view_if_needed()
    screenshot(page, "audio-lab-panels")
    page_log.check()
