"""/audio (issue 28, item 5): a span dragged over the spectrogram is snapped to whole 20 ms encoder positions and
labelled with exactly what is sent. The label's positions and seconds agree, the request masks those positions, the
drawn rectangle is those seconds, and the label's span sent through the API gives the transcript the drag gave."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from attnlab.results import read_binary
from tests.browser.conftest import screenshot

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "weights" / "samples" / "speech-sample.wav"
LABEL = re.compile(r"mask (\d+\.\d\d)–(\d+\.\d\d) s = positions (\d+)–(\d+) \(cross\)")


def _answer(response) -> dict:
    """The page's answer as it came: the binary form (it asks for it: a JSON header, then the maps' bytes), else JSON."""
    if response.headers.get("content-type", "").startswith("application/octet-stream"):
        return read_binary(bytearray(response.body()))
    return response.json()


def test_dragged_span_is_what_is_labelled_and_sent(page, page_log, live_server):
    if not SAMPLE.is_file():
        pytest.fail("the speech sample is missing: run `make speech weights`")
    exchanges = []  # (request body, response body) of the page's runs with interventions

    def on_response(response):
        if response.url.endswith("/api/audio/attention") and response.request.method == "POST":
            body = json.loads(response.request.post_data)
            if body["interventions"]:
                exchanges.append((body, _answer(response)))

    page.on("response", on_response)
    page.goto(f"{live_server}/audio?sample")
    page.wait_for_function("() => document.body.dataset.ready === '1'", timeout=300_000)
    duration = page.evaluate("() => Number(document.getElementById('spectrogram').layout.xaxis.range[1])")
    strip = page.eval_on_selector_all("#word-strip button", "els => els.map(b => [b.textContent, b.title])")
    harbor = next(title for word, title in strip if word == "harbor")
    start, end = (float(x) for x in re.match(r"([\d.]+)–([\d.]+) s", harbor).groups())

    # drag over "harbor" with both edges between position boundaries (a third and two thirds into a position)
    views = page.get_attribute("body", "data-views")
    box = page.locator("#spectrogram .nsewdrag").first.bounding_box()
    x_at = lambda seconds: box["x"] + box["width"] * seconds / duration  # noqa: E731
    y = box["y"] + box["height"] / 2
    page.mouse.move(x_at(start - 0.0133), y)
    page.mouse.down()
    page.mouse.move(x_at((start + end) / 2), y, steps=4)
    page.mouse.move(x_at(end + 0.0067), y, steps=4)
    page.mouse.up()
    page.wait_for_function(f"() => document.body.dataset.views !== '{views}'", timeout=300_000)

    chip = page.inner_text("#interventions-list")
    match = LABEL.search(chip)
    assert match, f"the span's label names no positions: {chip!r}"
    t0, t1, first, last = float(match[1]), float(match[2]), int(match[3]), int(match[4])
    assert (round(first * 0.02, 2), round((last + 1) * 0.02, 2)) == (t0, t1)  # positions j cover [0.02 j, 0.02 (j+1))
    assert abs(t0 - start) < 0.05 and abs(t1 - end) < 0.05
    body, answer = exchanges[-1]
    assert body["interventions"] == [{"op": "mask_keys", "kind": "cross", "tokens": list(range(first, last + 1))}]
    shape = page.evaluate("() => document.getElementById('spectrogram').layout.shapes[0]")
    assert abs(shape["x0"] - t0) < 1e-9 and abs(shape["x1"] - t1) < 1e-9  # the rectangle drawn is what is sent

    # the label's span, typed into the API by hand, gives the drag's transcript
    again = page.request.post(f"{live_server}/api/audio/attention", data={
        "audio_id": body["audio_id"], "layers": [3], "heads": [0], "kinds": ["cross"], "compare": True,
        "interventions": [{"op": "mask_keys", "kind": "cross", "tokens": list(range(first, last + 1))}]})
    assert again.ok, again.text()
    after = again.json()["effect"]["output"]
    assert after["text_after"] == answer["effect"]["output"]["text_after"]
    assert [t["token"] for t in after["tokens_after"]] == [t["token"] for t in answer["effect"]["output"]["tokens_after"]]
    screenshot(page, "audio-span-snapped")
    page_log.check()
