"""A drain hands its jobs to peers (docs/deploy.md "Fleet", issue 53 §1).

At SIGTERM a replica of a fleet drains (app/fleet.py `drain_then`) for at most `drain_s`. Before, a job queued there
waited for the drain's end and was cut, and a running one longer than the drain was cut at its last layers. Now, at
every tick of the drain (`Handover.tick`):

- a **queued** job (accepted, not started) moves to a peer at once;
- a **running** job stays while its ETA (its own measured rate, app/jobs.py) ends `MARGIN_S` before the drain's end;
  else, as soon as that is known, it moves and is run again from its start there.

Moving a job: its work here stops at its next check (`JobLog.start_handover`) and it leaves its client's list in Redis
(app/fleetjobs.py: its lease is free, it no longer counts against the client's cap); its request is sent again,
as it came (`Replay`: method, path, body, the client's headers, X-Forwarded-For with this replica), to each
registered peer in turn until one accepts it (a draining or full peer answers 503); its stream on the peer is read
up to its first event (the new job's id) and left (the peer runs it on for job_reattach_grace_s awaiting a stream).
The job's stream here then gets its last event, `{"handed_over": {"from", "to", "job_id", "why"}}` with the event
id `<new job id>:0`, and ends. A client that re-attaches after the last event id it saw (the page, `attnlab.Lab`:
GET /api/jobs/<new job id>/events, Last-Event-ID `<new job id>:0`; plain SSE clients that keep the old URL too, see
app/fleet.py) gets the new job's events from its `accepted` on: progress starts again, then the result. Nothing is
sent again by the client. `attnlab:job-moved:<old id>` → the new id (TTL job_timeout_s) lets a re-attach to the old
id find the job after this replica has gone.

Not moved: a job whose request names one of this replica's runs (a run route, `minus`, a patch `source`: the run
lives here only), and a running job that has already sent events of its own (a continuation's tokens: a re-run
would repeat them). Those run to the drain's end as before. When no peer takes a job, its stream ends with an error
event with `retry_after` (the client sends it again, as before).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import httpx

from app.fleet import MOVED_PREFIX
from app.ids import replica_name, run_owner
from app.lifecycle import SCOPE_BODY_KEY

log = logging.getLogger("attnlab")

MARGIN_S = 5.0  # a running job stays when its ETA ends this long before the drain does (the handover takes ~1 s)
FIRST_EVENT_S = 60.0  # a peer's stream must give the moved job's first event within this
HANDOVER_HEADER = "x-attnlab-handover"  # names the job a request re-makes, for the peer's log
# headers not sent on: the connection's own, and those the hop rewrites
DROPPED = {"host", "connection", "keep-alive", "transfer-encoding", "te", "upgrade", "content-length",
           "proxy-connection", "trailer", "x-forwarded-for", "x-attnlab-forwarded", HANDOVER_HEADER}


@dataclass(frozen=True)
class Replay:
    """A job's request as it came, to send it again on a peer."""
    method: str
    path: str
    query: str
    headers: tuple[tuple[str, str], ...]
    body: bytes
    peer: str  # the address it came from (appended to X-Forwarded-For, as a proxy does)


def replay_of(scope: dict[str, Any]) -> Replay | None:
    """The request of the scope (a job's), or None when it cannot be run elsewhere: its body was not read whole, or it
    names a run of this replica (a run route's path, a body's `minus` or patch `source`)."""
    body = scope.get(SCOPE_BODY_KEY)
    if body is None or _names_own_run(scope["path"], body):
        return None
    headers = tuple((k.decode("latin-1"), v.decode("latin-1")) for k, v in scope.get("headers", [])
                    if k.decode("latin-1").lower() not in DROPPED)
    forwarded = ", ".join(v.decode("latin-1") for k, v in scope.get("headers", []) if k.lower() == b"x-forwarded-for")
    peer = (scope.get("client") or ("?", 0))[0]
    return Replay(scope["method"], scope["path"], scope.get("query_string", b"").decode("latin-1"), headers, body,
                  f"{forwarded}, {peer}" if forwarded else peer)


def _names_own_run(path: str, body: bytes) -> bool:
    here = replica_name()
    if path.startswith("/api/runs/") and run_owner(path.split("/")[3]) == here:
        return True
    return f'"{here}.'.encode() in body


class Handover:
    """The drain's handover of this process's jobs (see the module doc). `registry`: app/fleet.py Registry (the
    peers' URLs, and Redis for the moved ids); `board`: app/jobs.py JobBoard."""

    def __init__(self, registry: Any, board: Any, settings: Any, http: Any = None):
        self.registry, self.board, self.settings = registry, board, settings
        self.http = http or httpx.Client(timeout=httpx.Timeout(FIRST_EVENT_S, connect=3.0))
        self.moved: dict[str, str] = {}  # old job id → new job id (for the tests and the log)

    def tick(self, drain_left_s: float) -> None:
        """Move each job that should go now: queued ones, and running ones whose ETA ends within MARGIN_S of the
        drain's end (or after it), in arrival order (a client's jobs keep their order on the peers). All of them are
        stopped here before any is sent: a queued job must not take the lease its client's moved job gives back."""
        now = time.monotonic()
        moving = [(job, "queued" if not job.started else
                   f"its ETA ({job.remaining_s(now):,.0f} s) is past the drain's {drain_left_s:,.0f} s left")
                  for job in self.board.live() if self._should_move(job, now, drain_left_s)]
        taken = [(job, why) for job, why in moving if self._take(job)]
        for job, why in taken:
            self._send_on(job, why)

    @staticmethod
    def _should_move(job: Any, now: float, drain_left_s: float) -> bool:
        events = job.events
        if job.request is None or events is None or events.handing or job.accepted_at is None:
            return False  # cannot be re-made elsewhere, already moving, or not yet accepted (its cost check runs)
        if not job.started:
            return True
        return not events.own_events and job.remaining_s(now) + MARGIN_S > drain_left_s

    def move(self, job: Any, why: str) -> str | None:
        """Hand `job` to a peer (see the module doc): the new job id, or None when no peer took it (its stream then
        ends with an error event saying to send it again) or it had just ended here."""
        return self._send_on(job, why) if self._take(job) else None

    def _take(self, job: Any) -> bool:
        """Stop the job here (its work at its next check, its events from now) and release it from its client's
        list and lease in Redis; False when it has just ended."""
        if not job.events.start_handover():
            return False
        fleet = self.board.fleet
        if fleet is not None:
            fleet.release(job.job_id)  # off its client's list and lease now: the peer's copy takes its place
        return True

    def _send_on(self, job: Any, why: str) -> str | None:
        """Send the taken job's request to each peer in turn until one takes it; its last event here says where."""
        events = job.events
        for name, url in self._peers():
            new_id = self._send(job.request, url, job.job_id)
            if new_id is None:
                continue
            self.moved[job.job_id] = new_id
            self._remember(job.job_id, new_id)
            log.info("drain: job %s (%s) handed over to replica %s as %s: %s", job.job_id, job.what, name, new_id, why)
            events.hand_over({"handed_over": {"from": replica_name(), "to": name, "job_id": new_id, "why": why}},
                             f"{new_id}:0")
            return new_id
        log.warning("drain: no peer took job %s (%s): its client is told to send it again", job.job_id, job.what)
        events.hand_over({"error": "the job stopped: its replica is shutting down and no other replica took it; "
                                   "send it again", "retry_after": 5})
        return None

    def _peers(self) -> list[tuple[str, str]]:
        """The other registered replicas, in name order (a draining one refuses with 503: the next is asked)."""
        here = replica_name()
        return sorted((name, url) for name, url in self.registry.replicas().items() if name != here)

    def _send(self, replay: Replay, url: str, old_id: str) -> str | None:
        """POST the job's request to the peer at `url` and read its stream up to the first event id: the new job's
        id, or None (refused: 4xx/5xx, a draining peer's 503, no answer)."""
        target = url.rstrip("/") + replay.path + (f"?{replay.query}" if replay.query else "")
        headers = [*replay.headers, ("x-forwarded-for", replay.peer), (HANDOVER_HEADER, old_id)]
        try:
            with self.http.stream(replay.method, target, headers=headers, content=replay.body) as answer:
                if answer.status_code != 200 or not answer.headers.get("content-type", "").startswith(
                        "text/event-stream"):
                    log.info("drain: replica at %s refused job %s: %s", url, old_id, answer.status_code)
                    return None
                for line in answer.iter_lines():
                    if line.startswith("id:"):
                        return line[3:].strip().rpartition(":")[0] or None
        except httpx.HTTPError as exc:
            log.info("drain: replica at %s did not take job %s: %s", url, old_id, exc)
        return None

    def _remember(self, old_id: str, new_id: str) -> None:
        try:
            self.registry.client.set(MOVED_PREFIX + old_id, new_id, ex=max(1, round(self.settings.job_timeout_s)))
        except Exception as exc:  # noqa: BLE001 - Redis down: the stream's last event still names the new job
            log.warning("drain: Redis did not keep job %s's move to %s: %s", old_id, new_id, exc)
