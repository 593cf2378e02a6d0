"""The pages' one server-sent-events reader (static/js/api.js serverEvents): the speech page's streamed transcript
reads a job's events through it (accepted, a token event per token, then done: app/streams.py's pump, as every
stream) and shows the text as it grows. The text page's continuation
(test_lm_page.py) and the patching scan's progress (test_analysis_page.py) read unnamed events through it."""
from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "weights" / "samples" / "speech-sample.wav"


def test_speech_transcript_streams_to_its_done_event(page, page_log, live_server):
    if not SAMPLE.is_file():
        pytest.fail("the speech sample is missing: run `make speech weights`")
    page.goto(f"{live_server}/audio?sample")
    page.wait_for_function("() => document.body.dataset.ready === '1'", timeout=300_000)
    page.click("#stream-button")
    page.wait_for_function("() => document.getElementById('stream-out').dataset.done === '1'", timeout=300_000)
    streamed = page.inner_text("#stream-out").strip()
    # the same words as the page's transcript (no interventions: the greedy transcript both ways)
    assert streamed not in ("", "…") and "Attention" in streamed, streamed
    page_log.check()
