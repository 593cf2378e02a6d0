"""The parts of a drain's handover (app/handover.py) that need no fleet: which jobs move, what is sent again, the
handed job's last event and where a re-attach goes after it, and the 410 of a drained replica's runs. The whole
path (three replicas, Redis, nginx, a SIGTERM) is tests/ops/test_drain.py."""
from __future__ import annotations

import json
import time
from types import SimpleNamespace

from app.fleet import Owned, _follow_last_event_id, _gone
from app.handover import MARGIN_S, Handover, replay_of
from app.ids import new_run_id, replica_name
from app.jobs import Job
from app.lifecycle import SCOPE_BODY_KEY
from app.streams import JobLog
from tests.api.helpers import run_async


def _log() -> JobLog:
    return JobLog(new_run_id(), "h:client-1", "POST /api/text/attention", 256, 15.0, 120.0)


def _job(started: bool, remaining_s: float, events: JobLog | None = None, request=object()) -> Job:
    now = time.monotonic()
    job = Job(what="POST /api/text/attention", client="h:client-1", deadline=now + 900, emit=lambda _e: None,
              estimate_s=remaining_s, job_id=new_run_id())
    job.accepted_at, job.started = now, started
    if started:
        job.started_at = now
    job.events, job.request = events or _log(), request
    return job


def test_queued_jobs_move_and_running_ones_by_their_eta_against_the_drain():
    now = time.monotonic()
    assert Handover._should_move(_job(False, 500.0), now, 100.0)  # queued: at once, whatever its ETA
    assert Handover._should_move(_job(False, 1.0), now, 100.0)
    assert not Handover._should_move(_job(True, 50.0), now, 100.0)  # ends within the drain: stays
    assert Handover._should_move(_job(True, 150.0), now, 100.0)  # would be cut: moves now
    assert Handover._should_move(_job(True, 100.0 - MARGIN_S / 2), now, 100.0)  # within the margin: moves
    assert not Handover._should_move(_job(False, 5.0, request=None), now, 100.0)  # names a run of this replica
    own = _log()
    own.put({"accepted": True, "eta_s": 1.0, "queue_position": 0, "runs": 1})
    own.put({"token": "the"})  # a continuation's own event: a re-run would repeat it
    assert own.own_events and not Handover._should_move(_job(True, 500.0, own), now, 100.0)
    moving = _log()
    assert moving.start_handover() and not moving.start_handover()  # taken once
    assert not Handover._should_move(_job(False, 5.0, moving), now, 100.0)


def test_the_handed_jobs_last_event_names_the_new_job_and_later_events_are_dropped():
    events = _log()
    _backlog, pipe = events.subscribe()
    events.put({"accepted": True, "eta_s": 9.0, "queue_position": 1, "runs": 1})
    assert events.start_handover()
    events.put({"progress": 1, "total": 4, "run": 1, "runs": 1})  # the work's last words before it stops: dropped
    events.put(None)
    new_id = new_run_id()
    events.hand_over({"handed_over": {"from": "a", "to": "b", "job_id": new_id, "why": "queued"}}, f"{new_id}:0")
    sent = [pipe.get(1.0) for _ in range(2)]
    assert sent[0].data.startswith(f"id: {events.job_id}:1\n".encode())
    assert sent[1].last and sent[1].data.startswith(f"id: {new_id}:0\n".encode())
    assert json.loads(sent[1].data.split(b"data: ", 1)[1])["handed_over"]["job_id"] == new_id
    assert events.ended_at is not None and events.stop_reason(time.monotonic()) == "handover"
    replay, _ = events.subscribe(1)  # a re-attach to the old job after its first event gets the handover
    assert [s.data for s in replay] == [sent[1].data]
    ended = _log()
    ended.put({"done": True})
    assert not ended.start_handover()  # its answer came first: nothing to hand over


def test_a_jobs_request_is_kept_to_send_again_unless_it_names_a_run_of_this_replica():
    body = b'{"model": "lm", "text": "the cat"}'
    scope = {"method": "POST", "path": "/api/text/attention", "query_string": b"", "client": ("10.0.0.9", 5),
             "headers": [(b"host", b"x"), (b"x-attnlab-client", b"client-1"), (b"content-length", b"33"),
                         (b"x-forwarded-for", b"192.0.2.1"), (b"accept", b"text/event-stream")],
             SCOPE_BODY_KEY: body}
    replay = replay_of(scope)
    assert replay is not None and replay.body == body and replay.peer == "192.0.2.1, 10.0.0.9"
    assert ("x-attnlab-client", "client-1") in replay.headers and ("accept", "text/event-stream") in replay.headers
    assert not {"host", "content-length", "x-forwarded-for"} & {k for k, _ in replay.headers}
    own_run = new_run_id()
    assert replay_of({**scope, SCOPE_BODY_KEY: json.dumps({"minus": own_run}).encode()}) is None
    assert replay_of({**scope, "path": f"/api/runs/{own_run}/scan"}) is None
    assert replay_of({**scope, SCOPE_BODY_KEY: json.dumps({"minus": f"zzzz9999.{'0' * 32}"}).encode()}) is not None
    assert replay_of({k: v for k, v in scope.items() if k != SCOPE_BODY_KEY}) is None


def test_a_re_attach_whose_last_event_id_names_the_new_job_goes_to_it():
    old, new = new_run_id(), f"zzzz9999.{'1' * 32}"
    scope = {"type": "http", "method": "GET", "path": f"/api/jobs/{old}/events", "raw_path": b"",
             "headers": [(b"last-event-id", f"{new}:0".encode())]}
    moved = _follow_last_event_id(scope)
    assert moved["path"] == f"/api/jobs/{new}/events" and (b"last-event-id", f"{new}:0".encode()) in moved["headers"]
    same = {**scope, "headers": [(b"last-event-id", f"{old}:7".encode())]}
    assert _follow_last_event_id(same) is same
    assert _follow_last_event_id({**scope, "method": "DELETE", "path": f"/api/jobs/{old}"})["path"].endswith(old)


def test_a_drained_replicas_run_is_410_saying_so_a_killed_ones_404():
    run = Owned("run", f"abcd1234.{'2' * 32}", "abcd1234")
    status, body = _gone(run, "not registered: its process ended", str(round(time.time())))
    detail = json.loads(body)["detail"]
    assert status == 410 and "drained" in detail and "run the input again" in detail
    status, body = _gone(run, "not registered: its process ended")
    assert status == 404 and "is gone" in json.loads(body)["detail"]


def test_a_move_releases_the_job_tries_each_peer_and_falls_back_to_an_error_event():
    class Peers:  # the registry: two peers, the first refuses (draining), the second takes the job
        client = SimpleNamespace(set=lambda *a, **k: None)

        @staticmethod
        def replicas():
            return {replica_name(): "http://self", "peer1": "http://one", "peer2": "http://two"}

    released: list[str] = []
    board = SimpleNamespace(fleet=SimpleNamespace(release=released.append), live=lambda: [])
    asked: list[str] = []
    new_id = f"peer2abc.{'3' * 32}"
    taken_by = {"http://two"}

    class Answered(Handover):  # a peer's answer without a peer: only http://two takes the job
        def _send(self, replay, url, old_id):
            asked.append(url)
            return new_id if url in taken_by else None

    handover = Answered(Peers(), board, SimpleNamespace(job_timeout_s=900.0), http=object())
    job = _job(False, 10.0)
    _backlog, pipe = job.events.subscribe()
    assert handover.move(job, "queued") == new_id
    assert released == [job.job_id] and asked == ["http://one", "http://two"]
    assert pipe.get(1.0).data.startswith(f"id: {new_id}:0\n".encode())
    refused = _job(False, 10.0)
    taken_by.clear()
    assert handover.move(refused, "queued") is None
    _backlog, _ = refused.events.subscribe()
    assert b"no other replica took it" in _backlog[-1].data and b"retry_after" in _backlog[-1].data


def test_the_router_follows_a_moved_job_and_says_a_drained_owner_drained():
    """After the drained replica has gone: a re-attach to its old job id goes to the new job (attnlab:job-moved),
    from its first event; a window of its run is a 410 (attnlab:drained); a killed replica's stays 404."""
    from app.fleet import FleetRouter

    old, new = f"gone1234.{'4' * 32}", new_run_id()  # the new job is this process's: served here

    class Registry:  # Redis as the drained replica left it
        @staticmethod
        def url_of(_name):
            return None

        @staticmethod
        def moved_to(job_id):
            return new if job_id == old else None

        @staticmethod
        def drained_at(name):
            return "1764640000" if name == "gone1234" else None

    seen: list[dict] = []

    async def app(scope, _receive, _send):
        seen.append(scope)

    router = FleetRouter(app, SimpleNamespace(max_json_bytes=1 << 20, forward_timeout_s=5.0),
                         fleet=SimpleNamespace(registry=Registry(), draining=False))

    async def ask(method: str, path: str, headers: list) -> list[dict]:
        sent: list[dict] = []

        async def receive():
            return {"type": "http.request", "body": b"{}", "more_body": False}

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": method, "path": path, "raw_path": path.encode(), "query_string": b"",
                 "headers": headers, "client": ("127.0.0.1", 5), "app": SimpleNamespace(state=SimpleNamespace())}
        await router(scope, receive, send)
        return sent

    run_async(ask("GET", f"/api/jobs/{old}/events", [(b"last-event-id", f"{old}:9".encode())]))
    assert seen and seen[-1]["path"] == f"/api/jobs/{new}/events"
    assert not any(k == b"last-event-id" for k, _ in seen[-1]["headers"])  # the new job from its first event
    answer = run_async(ask("POST", f"/api/runs/gone1234.{'5' * 32}/window", [(b"content-type", b"application/json")]))
    assert answer[0]["status"] == 410 and b"drained" in answer[1]["body"]
    answer = run_async(ask("POST", f"/api/runs/kill5678.{'5' * 32}/window", [(b"content-type", b"application/json")]))
    assert answer[0]["status"] == 404 and b"is gone" in answer[1]["body"]
