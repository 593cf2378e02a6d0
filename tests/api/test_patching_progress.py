"""A patching scan's progress (issue 56 §8): its batches are the steps the page's bar shows, so a scan is split into
several batches however few tokens a copy has; one batch of every copy sent a single progress event, at the end (the
page read "starting…" until the scan was done). The tiny Llama (2 layers × 4 heads) with a batch budget that holds
every copy at once."""
from __future__ import annotations

import pytest

from tests.api.helpers import sse_events, tiny_lm_client
from tests.tiny_models import build_text_model

PAIR = {"model": "lm", "clean": "the cat sat on the mat", "corrupt": "the dog sat on the mat", "answer": " the",
        "wrong": " a"}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with tiny_lm_client(build_text_model("llama", tmp_path_factory.mktemp("llama-patch-progress")),
                        patching_batch_tokens=100_000) as c:
        yield c


@pytest.mark.parametrize("scan", ["heads", "residual"])
def test_a_scan_reports_progress_before_its_end(client, scan):
    response = client.post("/api/text/patching", json={**PAIR, "scan": scan}, headers={"Accept": "text/event-stream"})
    assert response.status_code == 200, response.text
    events = sse_events(response)
    progress = [e for e in events if "progress" in e]
    assert events[-1].get("done") is True
    total = progress[-1]["total"]
    assert len(progress) >= 4 and progress[0]["progress"] < total, progress  # steps before the end, not one at it
    assert [e["progress"] for e in progress] == sorted(e["progress"] for e in progress)
    assert progress[-1]["progress"] == total and progress[-1]["eta_s"] == 0
