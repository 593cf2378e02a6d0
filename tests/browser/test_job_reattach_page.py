"""The page's job client (static/js/views/jobs.js postJob) in Chromium, on the real server behind a TCP relay that
cuts a job's first stream mid-way (tests/api/test_job_reattach.py): the page re-attaches with the last event id and
gets the rest of the job's events, without sending the job again; and an abort (the page's Cancel) cancels the job on
the server at once (DELETE), instead of leaving it to run on for job_reattach_grace_s."""
from __future__ import annotations

import httpx
import pytest

from tests.api.test_job_reattach import LONG_COMPARE, CuttingRelay, numbered, serve_big_bert


@pytest.fixture(scope="module")
def big_server(tmp_path_factory):
    yield from serve_big_bert(tmp_path_factory, "page-reattach")


RUN_JOB = """async ([body, abortAt]) => {
  const { postJob } = await import('/static/js/views/jobs.js');
  const events = [];
  const controller = new AbortController();
  try {
    const done = await postJob('/api/text/attention', body, { signal: controller.signal, onEvent: (e) => {
      events.push(e);
      if (abortAt && e.progress === abortAt) controller.abort();
    } });
    return { done, events };
  } catch (err) {
    return { error: err.name, events };
  }
}"""


def test_the_page_re_attaches_a_cut_stream_and_its_cancel_deletes_the_job(page, big_server):
    relay = CuttingRelay(big_server.port, cut_after=b'"progress":3,')
    try:
        page.goto(f"http://127.0.0.1:{relay.port}/api/health")
        body = {**LONG_COMPARE, "interventions": [{"op": "mask_keys", "tokens": [6]}]}  # not cached
        got = page.evaluate(RUN_JOB, [body, None])
        assert relay.cut.is_set(), "the relay never cut the stream"
        assert "done" in got, got.get("error")
        assert relay.posts == [b"POST /api/text/attention HTTP/1.1"], relay.posts  # sent once
        progress = [e["progress"] for e in got["events"] if "progress" in e]
        assert progress == list(range(1, progress[-1] + 1)), progress  # on from where it was cut, none twice
        assert got["done"]["run_id"] and got["done"]["base_run_id"]

        # Cancel: the abort sends DELETE; the job's kept events end with its cancelled error well before its end
        cancel_body = {**LONG_COMPARE, "interventions": [{"op": "mask_keys", "tokens": [7]}]}
        aborted = page.evaluate(RUN_JOB, [cancel_body, 1])
        assert aborted.get("error") == "AbortError", aborted
        job_id = aborted["events"][0]["job_id"]
        events = []
        for _ in range(50):  # the job's end comes at its next layer
            replay = httpx.get(f"{big_server.base}/api/jobs/{job_id}/events", timeout=30,
                               headers={"Accept": "text/event-stream"})
            events = numbered(replay.text)
            if events and "error" in events[-1][1]:
                break
        last = events[-1][1]
        assert last.get("cancelled") is True, last
        assert [p["progress"] for _, p in events if "progress" in p][-1] < events[0][1]["total"] // 2
    finally:
        relay.close()
