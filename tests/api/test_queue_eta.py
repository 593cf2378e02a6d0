"""Issue 53 §9: one definition of a job's ETA (app/jobs.py JobBoard.eta_s), read by GET /api/jobs, GET /metrics and
the job's stream (its accepted event and its progress events), where they used to disagree on the same job (55 s
against 104 s: /api/jobs said a queued job's own time, its stream the time until it ends). And the autoscaling
metric counts only the work more replicas would shorten: not a job that waits only for its own client's earlier one.
Jobs on the process's real board (their estimates given), read through the real app and the real stream code."""
from __future__ import annotations

import re
import time

import pytest

from app.jobs import Job
from app.streams import JobStream
from tests.api.helpers import tiny_lm_client
from tests.tiny_models import build_text_model


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    llama = str(build_text_model("llama", tmp_path_factory.mktemp("llama-eta")))
    with tiny_lm_client(llama) as client:
        client.app.state.runtime.warm_up()  # no background warm-up left running
        yield client


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
    assert match, f"{name} missing from:\n{text}"
    return float(match.group(1))


class Events:
    def __init__(self):
        self.sent: list[dict] = []

    def put(self, event: dict) -> None:
        self.sent.append(event)


class Cancel:
    reason = ""

    @staticmethod
    def is_set() -> bool:
        return False


def _job(client: str, what: str, events: list[dict]) -> Job:
    return Job(what=what, client=client, deadline=time.monotonic() + 3600, emit=events.append)


def _board_of(client, what: str) -> dict:
    return next(j for j in client.get("/api/jobs").json()["jobs"] if j["what"] == what)


def test_api_jobs_metrics_and_the_stream_say_one_eta(client):
    """A running job alone: its /api/jobs eta_s, its stream's progress eta_s and the metrics' queue ETA agree; then
    a queued job behind it: /api/jobs says the same eta_s as its accepted event (the jobs ahead included)."""
    first_events: list[dict] = []
    second_events: list[dict] = []
    running = _job("h:eta-alice", "POST /api/text/attention eta-1", first_events)
    queued = _job("h:eta-bob", "POST /api/text/attention eta-2", second_events)
    board = client.app.state.process.jobs  # the app's own job board (app/process.py)
    try:
        board.register(running)
        board.accept(running, 40.0, 1, layers=10)
        running.started, running.started_at = True, time.monotonic() - 12.0  # 3 layers in 12 s: 28 s left
        sent = Events()
        JobStream(sent, Cancel(), running).layer_done(3, 10)  # the stream's progress event with its ETA
        progress_eta = sent.sent[-1]["eta_s"]
        board_eta = _board_of(client, running.what)["eta_s"]
        metric_eta = _metric(client.get("/metrics").text, "attnlab_queue_eta_seconds")
        assert progress_eta > 0 and abs(board_eta - progress_eta) <= 0.5, (board_eta, progress_eta)
        assert abs(metric_eta - progress_eta) <= 0.5, (metric_eta, progress_eta)

        board.register(queued)
        board.accept(queued, 25.0, 1)
        accepted = second_events[0]
        listed = _board_of(client, queued.what)
        assert accepted["queue_position"] == 1 and accepted["eta_s"] >= 25.0 + 0.5 * progress_eta, accepted
        assert abs(listed["eta_s"] - accepted["eta_s"]) <= 0.5, (listed, accepted)  # not its own 25 s alone
        assert listed["own_s"] == 25.0 and listed["ends_in_s"] == listed["eta_s"], listed
    finally:
        board.finish(running)
        board.finish(queued)


def test_scalable_wait_leaves_out_jobs_that_wait_for_their_own_clients_turn(client):
    """Alice runs one job and has a second queued (it waits for her first: more replicas change nothing); Bob has one
    queued (another replica would start it at once). The scalable wait counts Bob's job only."""
    events: list[dict] = []
    alice_first = _job("h:scale-alice", "POST /api/text/attention scale-a1", events)
    alice_second = _job("h:scale-alice", "POST /api/text/attention scale-a2", events)
    bob = _job("h:scale-bob", "POST /api/text/attention scale-b1", events)
    jobs = [(alice_first, 30.0), (alice_second, 50.0), (bob, 20.0)]
    board = client.app.state.process.jobs
    try:
        for job, estimate in jobs:
            board.register(job)
        for job, estimate in jobs:
            # alice's second would wait for her first inside accept (one job per client): accept it by hand
            if job is alice_second:
                job.estimate_s, job.runs, job.accepted_at = estimate, 1, time.monotonic()
            else:
                board.accept(job, estimate, 1)
            if job is alice_first:
                job.started, job.started_at = True, time.monotonic()
        text = client.get("/metrics").text
        assert _metric(text, "attnlab_jobs_waiting_scalable") == 1
        assert 19.0 <= _metric(text, "attnlab_scalable_wait_seconds") <= 20.0  # bob's 20 s, not alice's 50 s
        assert _metric(text, "attnlab_jobs_waiting") == 2  # both wait; only one of them would move
        # a new client's wait: alice's running job, then bob's (turns go round the clients), not her second
        assert 48.0 <= _metric(text, "attnlab_queue_eta_seconds") <= 50.0
    finally:
        for job, _ in jobs:
            board.finish(job)
