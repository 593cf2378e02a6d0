"""Jobs: long work a client starts, admitted with an ETA and carried to its end (docs/api.md "Jobs").

A request sent with `Accept: text/event-stream` is a job (app/streams.py runs it). Its cost check (app/costs.py)
accepts it: the job then says `{"accepted": true, "eta_s", "queue_position", "runs"}` before any layer runs, and
waits until this client's earlier jobs have finished (one running job per client). Its time limit is
`job_timeout_s`, not `request_timeout_s`.

The ETA is the job's own estimated model time plus what is left of every job accepted before it: the model runs one
forward at a time and hands its lock to jobs in arrival order (app/runtime.py), so those run first. Short interactive
work (first views, windows, rows, decoding steps) goes before any job at the next layer boundary and is not counted:
it is short by construction.
"""
from __future__ import annotations

import contextvars
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from app.errors import Overloaded
from app.lifecycle import RequestCancelled, request_cancel

# The job the current request's work belongs to (set by app/streams.py in the job's worker thread); None: the request
# is interactive (a plain JSON request), bounded by request_timeout_s.
current_job: contextvars.ContextVar["Job | None"] = contextvars.ContextVar("attnlab_job", default=None)
# Who sent the current request (app/main.py RequestDeadline): the X-Attnlab-Client header, else the attnlab_client
# cookie, else the peer's address. Jobs queue per client, and a client may evict its own kept runs to make room.
request_client: contextvars.ContextVar[str] = contextvars.ContextVar("attnlab_client", default="")

_SEQ = itertools.count(1)
POLL_S = 0.1  # a job waiting for its client's earlier job notices a cancel within this


@dataclass(eq=False)
class Job:
    what: str  # "POST /api/text/attention", for the log and the board
    client: str
    deadline: float  # monotonic; job_timeout_s from its arrival
    emit: Callable[[dict[str, Any]], None]  # sends one event to the job's stream
    seq: int = field(default_factory=lambda: next(_SEQ))  # arrival order: the model lock's order among jobs
    estimate_s: float = 0.0
    runs: int = 0
    accepted_at: float | None = None
    finished: bool = False
    started: bool = False  # it has had the model once (app/scheduler.py: it keeps its turn until it ends)

    def remaining_s(self, now: float) -> float:
        if self.accepted_at is None:
            return 0.0
        return max(0.0, self.estimate_s - (now - self.accepted_at))


class JobBoard:
    """The unfinished jobs of this process, in arrival order."""

    def __init__(self) -> None:
        self._jobs: list[Job] = []
        self._cond = threading.Condition()

    def __len__(self) -> int:
        with self._cond:
            return len(self._jobs)

    def accept(self, job: Job, estimate_s: float, runs: int) -> None:
        """The job's cost check passed: say so (its first event) with its ETA and place, then wait for this client's
        earlier jobs. A job accepted twice (a second cost check: a later pass of the same request) adds its estimate."""
        now = time.monotonic()
        with self._cond:
            if job.accepted_at is not None:
                job.estimate_s += estimate_s
                job.runs += runs
                return
            job.estimate_s, job.runs, job.accepted_at = estimate_s, runs, now
            self._jobs.append(job)
            ahead = [other for other in self._jobs if other.seq < job.seq and not other.finished]
            wait_s = sum(other.remaining_s(now) for other in ahead)
        job.emit({"accepted": True, "eta_s": round(wait_s + estimate_s, 2), "queue_position": len(ahead),
                  "runs": runs})
        self._wait_for_client(job)

    def _wait_for_client(self, job: Job) -> None:
        cancel = request_cancel.get()
        with self._cond:
            while any(o.client == job.client and o.seq < job.seq and not o.finished for o in self._jobs):
                if cancel is not None and cancel.is_set():
                    raise RequestCancelled(cancel.reason)
                if time.monotonic() > job.deadline:
                    raise Overloaded("the job waited past job_timeout_s for this client's earlier job", retry_after=5)
                self._cond.wait(POLL_S)

    def finish(self, job: Job) -> None:
        with self._cond:
            job.finished = True
            if job in self._jobs:
                self._jobs.remove(job)
            self._cond.notify_all()

    def snapshot(self, client: str | None = None) -> list[dict[str, Any]]:
        """The board for /api/jobs: what runs and waits, without inputs; with `client`, that client's jobs only."""
        now = time.monotonic()
        with self._cond:
            return [{"what": j.what, "eta_s": round(j.remaining_s(now), 1), "runs": j.runs} for j in self._jobs
                    if client is None or j.client == client]


JOBS = JobBoard()


def client_of(headers: list[tuple[bytes, bytes]], peer: tuple[str, int] | None) -> str:
    """The client a request comes from, for queueing and kept runs: the cache scope's header or cookie
    (app.lifecycle.client_scope), else the peer's address. Not a security boundary (result_cache_scope is)."""
    from app.lifecycle import client_scope

    scope, new = client_scope(headers)
    return "a:" + (peer[0] if peer else "?") if new else scope
