"""The /audio page in Chromium on the real whisper-tiny-en: upload a clip (the espeak-ng sample as FLAC), see the
spectrogram and the cross-attention map, mask 3–7 s by dragging over the spectrogram, and see the transcript lose
its second sentence; then at 390 px, with the keyboard only, clear and re-add the span."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from models.audio import decode_path
from tests.browser.conftest import screenshot
from tests.unit.test_audio_decode import encode

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "weights" / "samples" / "speech-sample.wav"


def wait_ready(page, timeout=300_000):
    page.wait_for_function("() => document.body.dataset.ready === '1'", timeout=timeout)


def test_upload_map_drag_mask_and_diff(page, page_log, live_server, tmp_path):
    if not SAMPLE.is_file():
        pytest.fail("the speech sample is missing: run `make speech weights`")
    clip = decode_path(SAMPLE)
    flac = tmp_path / "sample.flac"
    flac.write_bytes(encode((clip.samples * 32767).astype(np.int16)[None, :], 16000, "flac", "flac", out_rate=44100))

    page.goto(f"{live_server}/audio")
    page.set_input_files("#file-input", str(flac))
    wait_ready(page)
    assert "flac, 44100 Hz" in page.inner_text("#clip-info")
    mel = page.eval_on_selector("#spectrogram", "el => [el.data[0].z.length, el.data[0].z[0].length]")
    assert mel == [80, 668]
    rows = page.eval_on_selector("#cross-map", "el => [el.data[0].z.length, el.data[0].z[0].length]")
    assert rows[1] == 334 and rows[0] > 20  # tokens × 20 ms positions up to the clip's end
    words = page.locator("#word-strip button").all_inner_texts()
    assert "Attention" in words
    assert page.get_attribute("#transcript-diff", "data-changed") == "0"

    # the map mode (issue 22 §3): the cross rows weighted by what each 20 ms frame's value adds, then back to P
    plain = np.array(page.eval_on_selector("#cross-map", "el => el.data[0].z"), dtype=float)
    page.select_option("#weighting-select", "value_norm")
    page.wait_for_function("() => document.getElementById('cross-title').textContent.startsWith('value-weighted')",
                           timeout=300_000)
    weighted = np.array(page.eval_on_selector("#cross-map", "el => el.data[0].z"), dtype=float)
    assert weighted.shape == plain.shape and np.abs(weighted - plain).max() > 1e-3
    screenshot(page, "audio-value-weighted")
    page.select_option("#weighting-select", "attention")
    page.wait_for_function("() => document.getElementById('cross-title').textContent.startsWith('layer')", timeout=300_000)
    assert np.abs(np.array(page.eval_on_selector("#cross-map", "el => el.data[0].z"), dtype=float) - plain).max() < 1e-3

    # drag from 3 s to 7 s (past the clip's end: clipped to 6.68 s) over the spectrogram
    box = page.locator("#spectrogram .nsewdrag").first.bounding_box()
    x_at = lambda seconds: box["x"] + box["width"] * seconds / clip.duration_s  # noqa: E731
    y = box["y"] + box["height"] / 2
    page.mouse.move(x_at(3.0), y)
    page.mouse.down()
    page.mouse.move(x_at(5.0), y, steps=6)
    page.mouse.move(min(x_at(7.0), box["x"] + box["width"] - 1), y, steps=6)
    page.mouse.up()
    page.wait_for_function("() => document.getElementById('transcript-diff').dataset.changed === '1'", timeout=300_000)
    deleted = " ".join(page.locator("#transcript-diff del").all_inner_texts())
    assert "Attention" in deleted and "word." in deleted
    chip = page.inner_text("#interventions-list")
    assert "mask 3." in chip and "(cross)" in chip
    bars = page.eval_on_selector("#dp-bars", "el => el.data[0].y")
    assert min(bars) < -0.5  # the second sentence's tokens lose their probability
    screenshot(page, "audio-masked")

    # zooming into the encoder's overview fetches the exact window of the kept run
    page.evaluate("() => Plotly.relayout('encoder-map', {'xaxis.range[0]': 2, 'xaxis.range[1]': 4, "
                  "'yaxis.range[0]': 4, 'yaxis.range[1]': 2})")
    page.wait_for_function("() => document.getElementById('encoder-map').dataset.mode === 'window'", timeout=60_000)
    assert page.eval_on_selector("#encoder-map", "el => [el.data[0].z.length, el.data[0].z[0].length]") == [100, 100]

    # 390 px, keyboard only: clear, then type the span and press Enter on "Add span"
    page.set_viewport_size({"width": 390, "height": 900})
    # the figures follow the window (Plotly's responsive resize runs after the resize event)
    page.wait_for_function("() => document.documentElement.scrollWidth <= 390", timeout=10_000)
    page.focus("#clear-all")
    page.keyboard.press("Enter")
    page.wait_for_function("() => document.getElementById('transcript-diff').dataset.changed === '0'", timeout=300_000)
    page.fill("#span-start", "3")
    page.fill("#span-end", "7")
    page.focus("#add-span")
    page.keyboard.press("Enter")
    page.wait_for_function("() => document.getElementById('transcript-diff').dataset.changed === '1'", timeout=300_000)
    screenshot(page, "audio-390")

    # every "§" link of the page leads to an anchor of the guide
    targets = page.eval_on_selector_all("a[href^='/guide#']", "els => els.map(a => a.getAttribute('href').split('#')[1])")
    assert {"s2", "s3", "s4", "s11-5"} <= set(targets)
    page.goto(f"{live_server}/guide")
    anchors = set(page.eval_on_selector_all("[id]", "els => els.map(e => e.id)"))
    assert set(targets) <= anchors, set(targets) - anchors
    page_log.check()


def test_lab_softmax_panel_and_query_and_key_perturbation(page, page_log, live_server):
    """The lab's panels on /audio: the softmax panel's row is the cross map's row (the silence after the clip as one
    key), its query dropdown follows the page's token; a query perturbation of one token at the shown head changes
    that row only; a span dragged with "perturb" becomes the perturbation's keys."""
    if not SAMPLE.is_file():
        pytest.fail("the speech sample is missing: run `make speech weights`")
    page.goto(f"{live_server}/audio?sample")
    wait_ready(page)
    drawn = "() => document.getElementById('softmax-panel').dataset.view === document.body.dataset.views"
    page.wait_for_function(drawn, timeout=120_000)
    q = int(page.get_attribute("#softmax-panel", "data-row"))
    bars = page.eval_on_selector("#softmax-bars", "el => el.data[0].y")
    row = page.eval_on_selector("#cross-map", f"el => el.data[0].z[{q}]")  # the clip's 334 positions (float16)
    assert len(bars) == len(row) + 1 == 335
    assert max(abs(a - b) for a, b in zip(bars, row)) < 2e-3
    assert abs(bars[-1] - (1 - sum(row))) < 5e-3 and abs(sum(bars) - 1) < 1e-6  # the mass after the clip

    page.select_option("#softmax-query", "5")  # the panel's dropdown picks the page's token
    page.wait_for_function("() => document.getElementById('softmax-panel').dataset.row === '5'", timeout=60_000)
    assert page.input_value("#token-select") == "5"

    before = page.eval_on_selector("#cross-map", "el => el.data[0].z")
    views = page.get_attribute("body", "data-views")
    page.select_option("#perturb-target", "queries")
    page.select_option("#perturb-scope", "head")
    page.fill("#perturb-sigma", "40")
    page.press("#perturb-sigma", "Enter")
    page.locator("#perturb-tokens .tok").nth(q).click()
    page.click("#perturb-apply")
    page.wait_for_function(f"() => document.body.dataset.views !== '{views}'", timeout=300_000)
    assert "perturb queries σ=40 (cross)" in page.inner_text("#interventions-list")
    after = page.eval_on_selector("#cross-map", "el => el.data[0].z")
    changed = [i for i, (a, b) in enumerate(zip(before, after)) if max(abs(x - y) for x, y in zip(a, b)) > 1e-3]
    assert changed == [q]  # at that layer and head only row q of P changes (§4)
    page.wait_for_function(drawn, timeout=120_000)
    screenshot(page, "audio-lab")

    views = page.get_attribute("body", "data-views")
    page.select_option("#span-action", "perturb")
    page.fill("#span-start", "3")
    page.fill("#span-end", "5")
    page.click("#add-span")
    page.wait_for_function(f"() => document.body.dataset.views !== '{views}'", timeout=300_000)
    assert page.input_value("#perturb-target") == "keys"
    assert "100 positions, 3.00–5.00 s of the cross-attention keys" in page.inner_text("#perturb-chosen")
    assert "perturb keys σ=40 (cross)" in page.inner_text("#interventions-list")
    page_log.check()


def test_model_task_and_language_controls(page, page_log, live_server):
    """tiny.en is English-only: task and language are disabled. Where whisper-base is prepared (optional), choosing it
    gives its 6 layers × 8 heads, the detected language with its probability, and "translate" puts <|translate|> in
    the prompt."""
    if not SAMPLE.is_file():
        pytest.fail("the speech sample is missing: run `make speech weights`")
    page.goto(f"{live_server}/audio?sample")
    wait_ready(page)
    assert page.is_disabled("#task-select") and page.is_disabled("#language-select")
    models = page.eval_on_selector_all("#model-select option", "els => els.map(e => e.value)")
    base_prepared = (ROOT / "weights" / "whisper-base" / "prepared.json").is_file()
    assert models == ["whisper-tiny-en", "whisper-base"] if base_prepared else ["whisper-tiny-en"]
    if not base_prepared:
        pytest.skip("whisper-base is not prepared here (optional: `make whisper-base`): only tiny.en's controls checked")
    views = page.get_attribute("body", "data-views")
    page.select_option("#model-select", "whisper-base")
    page.wait_for_function(f"() => document.body.dataset.views !== '{views}'", timeout=300_000)
    assert page.eval_on_selector_all("#layer-select option", "els => els.length") == 6
    assert page.eval_on_selector_all("#head-select option", "els => els.length") == 8
    assert page.inner_text("#language-select option >> nth=0").startswith("detect (en, p = ")
    assert not page.is_disabled("#task-select")
    views = page.get_attribute("body", "data-views")
    page.select_option("#task-select", "translate")
    page.wait_for_function(f"() => document.body.dataset.views !== '{views}'", timeout=300_000)
    assert page.eval_on_selector("#token-select", "el => el.options[2].textContent") == "2: <|translate|>"
    assert "dawn" in page.inner_text("#transcript-diff")
    screenshot(page, "audio-whisper-base")
    page_log.check()
