"""Jobs through the API (docs/api.md "Jobs"): a streamed request is accepted first with its ETA, is bounded by
job_timeout_s rather than request_timeout_s, and a plain request's 413 says so and names the field that drives the
cost; a long compare keeps both of its runs. A tiny Llama (tests/tiny_models.py) with a given throughput, so the
estimates are known numbers."""
from __future__ import annotations

import time

import pytest
from tests.api.helpers import TINY_ATLAS, TINY_TEXT, job_events, sse_events, tiny_lm_client
from tests.tiny_models import build_text_model

from app.costs import forward_macs, model_shape

STREAM = {"Accept": "text/event-stream"}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return str(build_text_model("llama", tmp_path_factory.mktemp("llama-jobs")))


def _client_at(llama, seconds_per_run: float, text: str = TINY_TEXT, **settings):
    """A client whose estimate of one plain run of `text` is `seconds_per_run`."""
    client = tiny_lm_client(llama, request_timeout_s=10, job_timeout_s=100, **settings)
    client.__enter__()
    runtime = client.app.state.runtime
    deadline = time.monotonic() + 60
    while not runtime.ready and time.monotonic() < deadline:  # the start-up timing runs first: then the given rate
        time.sleep(0.05)
    adapter = runtime.adapter("lm")
    n = len(adapter.encode(text).tokens)
    runtime.measures.throughput.set_rate("lm", forward_macs(model_shape(adapter), n, n) / seconds_per_run)
    return client


@pytest.fixture()
def slow(llama):
    """Each run estimated at 6 s: one run fits request_timeout_s=10, a compare (two runs) does not; job_timeout_s=100."""
    client = _client_at(llama, 6.0)
    yield client
    client.__exit__(None, None, None)


def test_a_job_is_accepted_first_with_its_eta(slow):
    body = {"model": "lm", "text": TINY_TEXT, "layers": [0], "heads": [0], "compare": True,
            "interventions": [{"op": "mask_keys", "tokens": [3]}]}
    response = slow.post("/api/text/attention", json=body, headers=STREAM)
    assert response.status_code == 200
    accepted, *rest = job_events(response)
    assert accepted["accepted"] is True and accepted["queue_position"] == 0 and accepted["runs"] == 2
    assert 12.0 <= accepted["eta_s"] <= 13.0  # two runs of 6 s (and the mask's work), nothing ahead
    assert "progress" in rest[0] and rest[-1]["done"] is True


def test_a_plain_request_over_request_timeout_is_told_to_stream_and_the_job_is_admitted(slow):
    body = {"model": "lm", "text": TINY_TEXT + " again", "layers": [0], "heads": [0], "compare": True,
            "interventions": [{"op": "mask_keys", "tokens": [3]}]}
    plain = slow.post("/api/text/attention", json=body)
    assert plain.status_code == 413
    detail = plain.json()["detail"]
    assert detail.startswith("compare:")  # the second run is what does not fit, not `samples` (none were sent)
    assert "request_timeout_s=10" in detail and "Accept: text/event-stream" in detail
    streamed = slow.post("/api/text/attention", json=body, headers=STREAM)
    assert streamed.status_code == 200 and sse_events(streamed)[-1]["done"] is True


@pytest.mark.parametrize(("extra", "field"), [
    ({"compare": True, "samples": 4, "interventions": [{"op": "perturb_keys", "noise_std": 1.0}]}, "samples"),
    ({}, "text"),
])
def test_the_413_names_the_field_that_drives_the_cost(llama, extra, field):
    client = _client_at(llama, 200.0 if field == "text" else 30.0)  # one run of 200 s: over job_timeout_s=100
    try:
        body = {"model": "lm", "text": TINY_TEXT, "layers": [0], "heads": [0], **extra}
        refused = client.post("/api/text/attention", json=body, headers=STREAM)
        assert refused.status_code == 413  # refused before the stream starts: its own status, not an event
        detail = refused.json()["detail"]
        assert detail.startswith(f"{field}:") and "job_timeout_s=100" in detail
    finally:
        client.__exit__(None, None, None)


def test_a_long_compare_keeps_both_runs(llama):
    """Both runs of a compare answer windows, even where the result cache holds a single run: they are pinned."""
    client = tiny_lm_client(llama, result_cache_items=1, **TINY_ATLAS)
    with client:
        body = {"model": "lm", "text": TINY_TEXT, "layers": [0], "heads": [0], "compare": True,
                "interventions": [{"op": "mask_keys", "tokens": [3]}]}
        answer = client.post("/api/text/attention", json=body).json()
        assert answer["attention"] is None  # the long path: windows come from the kept runs
        window = {"layer": 0, "head": 0, "rows": [0, 8], "cols": [0, 8]}
        for run_id in (answer["run_id"], answer["base_run_id"]):
            assert client.post(f"/api/runs/{run_id}/window", json=window).status_code == 200, run_id
        difference = client.post(f"/api/runs/{answer['run_id']}/window", json={**window, "minus": answer["base_run_id"]})
        assert difference.status_code == 200


def test_a_patching_scan_is_estimated_before_it_runs(llama):
    # each forward of the prompt 1 s: a head scan of 2 × 4 heads + 5 forwards ≈ 13 s > request_timeout_s=10
    client = _client_at(llama, 1.0, "the cat sat on the mat")
    try:
        body = {"model": "lm", "clean": "the cat sat on the mat", "corrupt": "the dog sat on the mat",
                "answer": " the", "wrong": " a", "scan": "heads"}
        plain = client.post("/api/text/patching", json=body)
        assert plain.status_code == 413, plain.text
        assert plain.json()["detail"].startswith("scan:") and "Accept: text/event-stream" in plain.json()["detail"]
        streamed = client.post("/api/text/patching", json=body, headers=STREAM)
        assert streamed.status_code == 200
        events = job_events(streamed)
        assert events[0]["accepted"] is True and events[-1]["done"] is True
    finally:
        client.__exit__(None, None, None)


def test_with_client_scope_a_client_sees_its_own_jobs_and_counts_only(llama):
    """Issue 37 §4: GET /api/jobs showed every client's `what`, `eta_s` and `runs` and the server's memory totals.
    With result_cache_scope="client" a client sees its own jobs and aggregate counts only (the shared scope keeps
    the whole board). Two jobs of two clients on the app's real board."""
    import json

    from app.jobs import Job

    alice, bob = "alice-client-1", "bob-client-22"

    def two_jobs(board) -> list:
        """Alice's and Bob's jobs on `board` (an app's own: app/process.py). Deadlines far enough out for both ETAs
        (bob's counts alice's job ahead of it: 80 s; a job whose ETA is over what is left of its deadline is refused)."""
        jobs = [Job(what="POST /api/text/attention", client=f"h:{alice}", deadline=time.monotonic() + 600,
                    emit=lambda event: None),
                Job(what="POST /api/text/patching", client=f"h:{bob}", deadline=time.monotonic() + 600,
                    emit=lambda event: None)]
        for job, eta in zip(jobs, (30.0, 50.0)):
            board.accept(job, eta, 2)
        return jobs

    with tiny_lm_client(llama, result_cache_scope="client") as client:
        client.app.state.runtime.warm_up()  # deterministic: no background warm-up left running
        board = client.app.state.process.jobs
        before = len(board)
        jobs = two_jobs(board)
        try:
            mine = client.get("/api/jobs", headers={"X-Attnlab-Client": alice}).json()
            assert [(j["what"], j["runs"]) for j in mine["jobs"]] == [("POST /api/text/attention", 2)], mine
            assert 25 <= mine["jobs"][0]["eta_s"] <= 30
            assert mine["counts"] == {"jobs": before + 2, "yours": 1}
            assert "memory" not in mine and "patching" not in json.dumps(mine)
            client.cookies.clear()
            nobody = client.get("/api/jobs").json()  # no scope of its own yet: known only by its address
            assert nobody["jobs"] == [] and nobody["counts"]["jobs"] == before + 2 and "memory" not in nobody
        finally:
            for job in jobs:
                board.finish(job)
    with tiny_lm_client(llama) as shared:  # result_cache_scope="shared": the whole board, as before
        shared.app.state.runtime.warm_up()
        board = shared.app.state.process.jobs
        jobs = two_jobs(board)
        try:
            everything = shared.get("/api/jobs", headers={"X-Attnlab-Client": alice}).json()
            assert {"POST /api/text/attention", "POST /api/text/patching"} <= {j["what"] for j in everything["jobs"]}
            assert "in_flight_bytes" in everything["memory"]
        finally:
            for job in jobs:
                board.finish(job)
