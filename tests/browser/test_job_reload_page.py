"""A page reload re-attaches to the job it left running (issue 36 §3; docs/api.md "Re-attaching to a job"), in
Chromium on the real server with the 12-layer random BERT: the text page keeps its live job's request and last event
id in sessionStorage (static/js/views/jobs.js); after a reload it puts the job's text back, re-attaches with
GET /api/jobs/{job_id}/events?after=… and draws the finished result, without sending the job again. A saved job the
server does not know (404) is forgotten and the job is sent once more.

The page's job waits its turn behind another client's long job (the model is that job's until it ends), so the reload
comes while it is queued: a reload that lost the job would draw nothing, or send it again."""
from __future__ import annotations

import threading
import time

import httpx
import pytest

from app.ids import run_owner
from tests.api.test_job_reattach import LONG_COMPARE, numbered, serve_big_bert
from tests.browser.conftest import screenshot
from tests.faults.conftest import LONG_TEXT

JOB_KEY = "attnlab:job:/api/text/attention"


@pytest.fixture(scope="module")
def big_server(tmp_path_factory):
    yield from serve_big_bert(tmp_path_factory, "page-reload")


def _blocker(base: str, out: dict) -> None:
    """Another client's long job (16 samples of a compare): it holds the model until it ends."""
    body = {**LONG_COMPARE, "samples": 16, "interventions": [{"op": "mask_keys", "tokens": [9]}]}
    answer = httpx.post(base + "/api/text/attention", json=body, timeout=300,
                        headers={"Accept": "text/event-stream", "X-Attnlab-Client": "reload-blocker"})
    out["events"] = numbered(answer.text)


def test_a_page_reload_re_attaches_to_its_job_and_draws_the_result(page, big_server):
    sent, reattached = [], []

    def on_request(request) -> None:
        if request.method == "POST" and request.url.endswith("/api/text/attention") and \
                "text/event-stream" in (request.headers.get("accept") or ""):
            sent.append(request.url)  # a job sent (a short view is a plain POST)
        if "/api/jobs/" in request.url and "/events" in request.url:
            reattached.append(request.url)

    page.on("request", on_request)
    base = big_server.base
    page.goto(f"{base}/#m=big")
    page.wait_for_function("() => /tokens/.test(document.getElementById('status').textContent)", timeout=120_000)
    blocked: dict = {}
    blocker = threading.Thread(target=_blocker, args=(base, blocked))
    blocker.start()
    try:
        for _ in range(200):  # the blocker has the model
            if httpx.get(base + "/api/jobs", timeout=10).json()["jobs"]:
                break
            time.sleep(0.05)
        page.fill("#text-input", LONG_TEXT)
        page.click("#run-button")
        page.wait_for_function(f"() => sessionStorage.getItem('{JOB_KEY}') !== null", timeout=60_000)
        saved = page.evaluate(f"() => JSON.parse(sessionStorage.getItem('{JOB_KEY}'))")
        job_id = saved["lastId"].rpartition(":")[0]
        assert run_owner(job_id) and len(sent) == 1, (saved, sent)
        assert "events" not in blocked, "the blocking job ended before the reload: nothing was left to re-attach to"

        page.reload()
        page.wait_for_function("() => document.getElementById('heatmap').dataset.atlas === 'overview'",
                               timeout=300_000)
        assert page.input_value("#text-input") == LONG_TEXT  # the job's text is back in the box
        assert len(sent) == 1, sent  # not sent again
        assert reattached and reattached[0].split("/api/jobs/")[1].startswith(job_id), reattached
        assert page.evaluate(f"() => sessionStorage.getItem('{JOB_KEY}')") is None  # forgotten once done
        title = page.text_content("#heatmap-title")
        assert "tokens" in title, title
        screenshot(page, "job-reload-01-result")
    finally:
        blocker.join(timeout=300)
    assert blocked["events"][-1][1].get("done") is True

    # a saved job the server does not know (its id from before a restart): forgotten on its 404, sent again
    unknown = f"{job_id.partition('.')[0]}.{'0' * 32}:2"
    page.evaluate(f"([key, saved]) => sessionStorage.setItem(key, JSON.stringify(saved))",
                  [JOB_KEY, {"key": saved["key"], "lastId": unknown}])
    page.reload()
    page.wait_for_function("() => document.getElementById('heatmap').dataset.atlas === 'overview'", timeout=300_000)
    assert len(sent) == 2, sent  # sent once more: the old job was not to be found
    assert any(unknown.rpartition(":")[0] in url for url in reattached), reattached
    assert page.evaluate(f"() => sessionStorage.getItem('{JOB_KEY}')") is None
