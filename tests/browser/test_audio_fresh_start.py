"""The speech page on a fresh start (issue 56 §5), in Chromium on a real server whose weights folder has no Whisper
and no sample yet, whisper-tiny-en marked as being prepared (as `make run`'s background preparation marks it): the
sample button says the clip is being prepared and that the page tries again by itself (not "espeak-ng was not
installed"); once the model and the sample are in place and the preparation has ended, the page opens the sample and
runs Whisper without another click, following the server's Retry-After."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from models import preparing
from tests.browser.conftest import screenshot, serve_app

ROOT = Path(__file__).resolve().parents[2]
WHISPER = ROOT / "weights" / "whisper-tiny-en"
SAMPLE = ROOT / "weights" / "samples" / "speech-sample.wav"


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    if not (WHISPER.is_dir() and SAMPLE.is_file()):
        pytest.fail("whisper-tiny-en or the speech sample is missing: run `make speech weights`")
    weights = tmp_path_factory.mktemp("fresh-weights")
    server = serve_app({"ATTNLAB_WEIGHTS_DIR": str(weights), "ATTNLAB_DEFAULT_MODELS": "[]"}, "fresh-audio-server.log")
    yield next(server), weights
    server.close()


def test_the_sample_waits_for_the_preparation_and_opens_by_itself(page, page_log, fresh):
    base, weights = fresh
    with preparing.preparing(weights, "whisper-tiny-en"):
        page.goto(f"{base}/audio")
        page.click("#sample-button")
        page.wait_for_function("() => document.body.dataset.waiting === 'preparation'", timeout=300_000)  # the event, with a generous limit for a loaded machine
        status = page.inner_text("#status")
        assert "being prepared" in status and "trying again in 10 s" in status, status
        assert "not installed" not in status and "503" not in status, status
        screenshot(page, "audio-fresh-start")
        # the preparation finishes: the model's folder and the sample in place, then its mark removed
        (weights / "whisper-tiny-en").symlink_to(WHISPER, target_is_directory=True)
        (weights / "samples").mkdir()
        shutil.copy(SAMPLE, weights / "samples" / SAMPLE.name)
    page.wait_for_function("() => document.body.dataset.ready === '1'", timeout=300_000)  # no click: by itself
    assert page.locator("#word-strip button").count() > 3
    # every word of the transcript is over the spectrogram too (issue 56 §10: "the" was left out where labels met)
    words = page.locator("#word-strip button").all_inner_texts()
    labels = page.eval_on_selector("#spectrogram", "el => (el.layout.annotations || []).map(a => a.text)")
    assert [w.strip() for w in labels] == [w.strip() for w in words], (labels, words)
    screenshot(page, "audio-fresh-start-ready")
    # the 503s the page waited through are logged by Chromium as failed loads; nothing else may be
    page_log.errors = [e for e in page_log.errors if "status of 503" not in e]
    page_log.check()
