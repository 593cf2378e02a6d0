"""Jobs: long work a client starts, admitted with an ETA and carried to its end (docs/api.md "Jobs").

A request sent with `Accept: text/event-stream` is a job (app/streams.py runs it). It is on the board from its arrival
(`register`; at most `max_queued_jobs_per_client` per client and `max_queued_jobs_per_address` per source address,
else 429 + Retry-After; at most `max_queued_jobs` on the replica, else 503). Its cost check (app/costs.py)
accepts it: the job then says `{"accepted": true, "eta_s", "queue_position", "runs", "total"}` before any layer runs,
and waits until this client's earlier jobs have finished (one running job per client; across replicas sharing Redis
by its client's lease there: app/fleetjobs.py, and the cap counts the client's jobs on every replica). Its time limit is
`job_timeout_s`, not `request_timeout_s`; a job whose ETA is over what is left of it is refused (503) instead.

The ETA (`JobBoard.eta_s`, the one definition: the stream's accepted and progress events, /api/jobs and /metrics all
read it) is the job's own estimated model time plus what is left of every job that runs before it: the model runs one
forward at a time and hands its lock round the clients (app/scheduler.py), so those are this client's earlier jobs
(in a fleet sharing Redis, on every replica) and as many of each other client's as turns go round before this one.
What is left of a job that has made progress comes from its own measured rate, not from the estimate. Short
interactive work (first views, windows, rows) goes before any job at the next layer boundary and is not counted: it
is short by construction. `queue()` is what the replica's queue means for scaling: a new client's wait, and the part
of it more replicas would take away (not the jobs that wait only for their own client's earlier job).
"""
from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from app.errors import ClientLimit, Overloaded
from app.fleetjobs import POLL_S as FLEET_POLL_S
from app.fleetjobs import Ahead
from app.lifecycle import RequestCancelled, client_scope, request_cancel

_SEQ = itertools.count(1)
POLL_S = 0.1  # a job waiting for its client's earlier job notices a cancel within this
FLEET_RETRY_S = 10  # Retry-After of a job over its client's cap in the fleet (its earlier jobs' ends are not known here)
TRUST_AFTER = 0.1  # a job's own rate is trusted fully from 10 % of its progress on (blended with the estimate before)


@dataclass(eq=False)
class Job:
    what: str  # "POST /api/text/attention", for the log and the board
    client: str
    deadline: float  # monotonic; job_timeout_s from its arrival
    emit: Callable[[dict[str, Any]], None]  # sends one event to the job's stream
    seq: int = field(default_factory=lambda: next(_SEQ))  # arrival order: the model lock's order among jobs
    estimate_s: float = 0.0
    runs: int = 0
    total: int | None = None  # the progress bar's length, fixed when the job is accepted (runs × layers)
    layer_progress: bool = False  # its progress counts attention layers (total fixed at acceptance)
    accepted_at: float | None = None
    finished: bool = False
    started: bool = False  # it has had the model once (app/scheduler.py: it keeps its turn until it ends)
    started_at: float | None = None  # its first progress: its own rate is measured from here
    done: int = 0  # progress so far, of `total` (or of the work's own step count)
    of: int = 0
    job_id: str = ""  # its id on the wire (app/streams.py); names it on the fleet's list of its client's jobs
    source: str = ""  # its source address (app/sources.py), for max_queued_jobs_per_address
    # monotonic: when its client's earlier jobs on other replicas should have ended (a fleet sharing Redis; accept)
    elsewhere_until: float = 0.0
    # a drain hands it to a peer with these (app/handover.py): its request as sent (Replay; None: it cannot be re-made
    # elsewhere) and its event log (app/streams.py JobLog), where the handover writes its last event
    request: Any = None
    events: Any = None
    board: Any = None  # the JobBoard it is on (its app's: app/process.py), set by `register`

    def remaining_s(self, now: float) -> float:
        """Seconds left: from the job's own measured rate once it has made progress (docs/api.md "Jobs": the ETA
        learns), else its estimate less the time it has run."""
        if self.accepted_at is None:
            return 0.0
        if self.started_at is None:
            return self.estimate_s
        if self.of and self.done >= self.of:  # every step done: what is left is the answer, not the estimate's rest
            return 0.0
        by_estimate = max(0.0, self.estimate_s - (now - self.started_at))
        if not 0 < self.done < self.of:
            return by_estimate
        measured = (now - self.started_at) * (self.of - self.done) / self.done
        trust = min(1.0, self.done / (self.of * TRUST_AFTER))  # the first few layers' rate is mostly set-up
        return trust * measured + (1 - trust) * by_estimate

    def progressed(self, done: int, of: int, now: float) -> float:
        """Progress heard (done of `of`): the seconds left by the job's own rate. The first progress of a run starts
        the clock when the scheduler did not (app/scheduler.py sets `started_at` at the job's first turn)."""
        if self.started_at is None:  # progress before the scheduler saw it start (work outside the model lock)
            self.started_at = now - (self.estimate_s * done / of if of and self.estimate_s else 0.0)
        self.done, self.of = done, of
        return round(self.remaining_s(now), 2)


class JobBoard:
    """The unfinished jobs of this process, from their arrival (`register`) to their end (`finish`), in arrival
    order. At most `max_queued_jobs_per_client` per client, `max_queued_jobs_per_address` per source address and
    `max_queued_jobs` in all (app/streams.py passes the settings)."""

    def __init__(self) -> None:
        self._jobs: list[Job] = []
        self._cond = threading.Condition()
        # replicas sharing Redis: the client rules over the whole fleet (app/fleetjobs.py, set by app/fleet.py)
        self.fleet: Any = None

    def __len__(self) -> int:
        with self._cond:
            return len(self._jobs)

    def register(self, job: Job, max_per_client: int | None = None, max_per_source: int | None = None,
                 max_total: int | None = None) -> None:
        """A job arrives: on the board at once (its place in the queue counts from now), or refused at once: 429 +
        Retry-After (ClientLimit) when its client already has `max_per_client` jobs queued or running, or its source
        address `max_per_source` (in a fleet sharing Redis: on every replica together); 503 + Retry-After when this
        replica has `max_total` (nginx then tries another)."""
        now = time.monotonic()
        with self._cond:
            live = [other for other in self._jobs if not other.finished]
            own = [other for other in live if other.client == job.client]
            if max_per_client is not None and len(own) >= max_per_client:
                raise ClientLimit(
                    f"too many jobs: this client already has {len(own)} jobs queued or running "
                    f"(max_queued_jobs_per_client={max_per_client}); send this one when one of them has ended",
                    retry_after=_soonest(own, now))
            same = [other for other in live if job.source and other.source == job.source]
            if max_per_source is not None and len(same) >= max_per_source:
                raise ClientLimit(
                    f"too many jobs: the clients of this address ({job.source}) already have {len(same)} jobs queued "
                    f"or running (max_queued_jobs_per_address={max_per_source}); send this one when one of them has "
                    "ended", retry_after=_soonest(same, now))
            if max_total is not None and len(live) >= max_total:
                raise Overloaded(
                    f"server busy: {len(live)} jobs queued or running on this replica (max_queued_jobs={max_total}); "
                    "send it again later", retry_after=_soonest(live, now))
            self._jobs.append(job)
            job.board = self
        self._register_in_fleet(job, max_per_client, max_per_source)

    def _register_in_fleet(self, job: Job, max_per_client: int | None, max_per_source: int | None) -> None:
        """In a fleet sharing Redis, the client's and the address's caps over every replica (app/fleetjobs.py)."""
        fleet = self.fleet
        if fleet is None or not job.job_id or max_per_client is None:
            return
        if fleet.register(job.job_id, job.client, max_per_client, 0.0) is None:
            self.finish(job)
            raise ClientLimit(
                f"too many jobs: this client already has {max_per_client} jobs queued or running on the replicas "
                f"of this fleet (max_queued_jobs_per_client={max_per_client}); send this one when one of them "
                "has ended", retry_after=FLEET_RETRY_S)
        if max_per_source is not None and job.source and not fleet.register_source(job.job_id, job.source,
                                                                                     max_per_source):
            self.finish(job)
            raise ClientLimit(
                f"too many jobs: the clients of this address ({job.source}) already have {max_per_source} jobs "
                f"queued or running on the replicas of this fleet (max_queued_jobs_per_address={max_per_source}); "
                "send this one when one of them has ended", retry_after=FLEET_RETRY_S)

    def ahead_of(self, job: Job) -> list[Job]:
        """The jobs that run before `job` (under the board's lock): its client's earlier jobs, and of every other
        client as many as turns go round before this one (app/scheduler.py: the client served least recently first;
        here by arrival), a started one always."""
        mine = [o for o in self._jobs if o.client == job.client and o.seq < job.seq and not o.finished]
        rounds = len(mine)
        ahead = list(mine)
        clients: dict[str, list[Job]] = {}
        for other in self._jobs:
            if other.client != job.client and not other.finished:
                clients.setdefault(other.client, []).append(other)
        for jobs in clients.values():
            jobs.sort(key=lambda o: (not o.started, o.seq))
            for rank, other in enumerate(jobs):
                if other.started or rank < rounds or (rank == rounds and other.seq < job.seq):
                    ahead.append(other)
        return ahead

    def accept(self, job: Job, estimate_s: float, runs: int, layers: int | None = None) -> None:
        """The job's cost check passed: say so (its first event) with its ETA, place and progress total, then wait
        for this client's earlier jobs. 503 + Retry-After instead when the queue ahead and the job's own estimate
        would not end before its deadline (job_timeout_s from its arrival). A job accepted twice (a second cost
        check: a later pass of the same request) adds its estimate."""
        if job.accepted_at is not None:  # a later pass of the same request
            with self._cond:
                job.estimate_s += estimate_s
                job.runs += runs
            return
        # its client's earlier jobs on other replicas (a fleet sharing Redis); with none, it holds the client's lease now
        elsewhere = self._take_lease_or_jobs_ahead(job)
        now = time.monotonic()
        with self._cond:
            if job not in self._jobs:  # not registered at its arrival (tests of the board alone)
                self._jobs.append(job)
                job.board = self
            here = {o.job_id for o in self._jobs}
            remote = [o for o in elsewhere if o.job_id not in here]  # its client's jobs on other replicas
            # each one's left_s is its own replica's ETA (its queue there included): they have ended by the latest
            job.elsewhere_until = now + max((o.left_s for o in remote), default=0.0)
            ahead: list[Any] = self.ahead_of(job) + remote
            wait_s = self.eta_s(job, now)  # not yet accepted: the jobs ahead only
            if wait_s + estimate_s > job.deadline - now:
                self._jobs.remove(job)
                self._cond.notify_all()
                if self.fleet is not None:
                    self.fleet.release(job.job_id)
                raise Overloaded(
                    f"server busy: this job needs about {estimate_s:,.0f} s of model time after about {wait_s:,.0f} s "
                    f"of jobs ahead of it ({len(ahead)}), over the {max(0.0, job.deadline - now):,.0f} s left of "
                    "job_timeout_s; send it again later", retry_after=max(1, min(300, round(wait_s))))
            job.estimate_s, job.runs, job.accepted_at = estimate_s, runs, now
            if job.layer_progress and layers:
                job.total = runs * layers
        event = {"accepted": True, "eta_s": round(wait_s + estimate_s, 2), "queue_position": len(ahead), "runs": runs}
        if job.total is not None:
            event["total"] = job.total
        job.emit(event)
        self._wait_for_client(job)

    def live(self) -> list[Job]:
        """This process's unfinished jobs, in arrival order (a drain's handover, app/handover.py)."""
        with self._cond:
            return [job for job in self._jobs if not job.finished]

    def eta_s(self, job: Job, now: float) -> float:
        """THE ETA of `job` (under the board's lock; see the module doc): seconds until it ends, its own time left
        (0 before it is accepted) and the jobs ahead of it here, and while it has not started its client's earlier jobs
        on other replicas."""
        elsewhere = 0.0 if job.started else max(0.0, job.elsewhere_until - now)
        return job.remaining_s(now) + elsewhere + sum(other.remaining_s(now) for other in self.ahead_of(job))

    def ends_in_s(self, job: Job) -> float:
        """Seconds until `job` ends by the board (`eta_s` now): its stream's progress events say this."""
        now = time.monotonic()
        with self._cond:
            return round(self.eta_s(job, now), 2)

    def queue(self) -> dict[str, float]:
        """The queue for /metrics and autoscaling, by `eta_s`: `wait_s`, a job sent now by a new client's wait (the
        running job, and the first waiting job of each client: turns go round the clients); `scalable_wait_s` and
        `waiting_scalable`, the part of it that more replicas would take away: the accepted jobs that wait for the
        model, not the running one nor any that waits only for its own client's earlier job (one job per client runs
        at a time, whatever the replicas)."""
        now = time.monotonic()
        with self._cond:
            newcomer = Job(what="", client="\0a new client", deadline=now, emit=lambda event: None, seq=1 << 62)
            ahead = self.ahead_of(newcomer)
            scalable = [o for o in ahead if o.accepted_at is not None and not o.started
                        and not any(e.client == o.client and e.seq < o.seq and not e.finished for e in self._jobs)
                        and o.elsewhere_until <= now]
            return {"wait_s": self.eta_s(newcomer, now), "scalable_wait_s": sum(o.remaining_s(now) for o in scalable),
                    "waiting_scalable": float(len(scalable))}

    def _take_lease_or_jobs_ahead(self, job: Job) -> list[Ahead]:
        """In a fleet, one step of admission (not a query): the job takes its client's lease when no earlier job of
        that client is alive on any replica (FleetJobTurns.try_start), and gets []; else it gets those earlier jobs.
        A refused job gives the lease back (accept). [] outside a fleet."""
        fleet = self.fleet
        if fleet is None or not job.job_id:
            return []
        found = fleet.try_start(job.job_id)
        return [] if found is True else found

    def _wait_for_client(self, job: Job) -> None:
        """Until the job's turn among its client's jobs: its earlier jobs here have ended, and in a fleet sharing
        Redis it holds its client's lease (no earlier job of its client alive on any replica)."""
        cancel = request_cancel.get()

        def check() -> None:
            if cancel is not None and cancel.is_set():
                raise RequestCancelled(cancel.reason)
            if time.monotonic() > job.deadline:
                raise ClientLimit("the job waited past job_timeout_s for this client's earlier job", retry_after=5)

        fleet = self.fleet
        if fleet is not None and fleet.holds(job.job_id):  # the fleet's order (by arrival in Redis) includes this
            while fleet.try_start(job.job_id) is not True:  # process's jobs: the one order, else two could deadlock
                check()
                time.sleep(FLEET_POLL_S)
            check()  # a job a drain handed over is released from the fleet: it must not start here
            return
        with self._cond:
            while any(o.client == job.client and o.seq < job.seq and not o.finished for o in self._jobs):
                check()
                self._cond.wait(POLL_S)

    def left_s(self, job_id: str) -> float:
        """Seconds until this process's job `job_id` ends (its queue ahead included), for the fleet's ETAs."""
        with self._cond:
            job = next((j for j in self._jobs if j.job_id == job_id), None)
        return self.ends_in_s(job) if job is not None and job.accepted_at is not None else 0.0

    def finish(self, job: Job) -> None:
        with self._cond:
            job.finished = True
            if job in self._jobs:
                self._jobs.remove(job)
            self._cond.notify_all()
        if self.fleet is not None and job.job_id:
            self.fleet.release(job.job_id)

    def snapshot(self, client: str | None = None) -> list[dict[str, Any]]:
        """The board for /api/jobs (of one client when given): what runs and waits, without inputs. `state`:
        "arriving" (not yet accepted), "queued" or "running"; `eta_s`: the ETA (`eta_s`: with the jobs ahead of it,
        `queue_position` of them, as its stream says it); `own_s`: its own seconds left; `ends_in_s`: `eta_s` (its
        older name)."""
        now = time.monotonic()
        with self._cond:
            board = []
            for j in self._jobs:
                if client is not None and j.client != client:
                    continue
                ahead = self.ahead_of(j)
                state = "arriving" if j.accepted_at is None else "running" if j.started else "queued"
                eta = round(self.eta_s(j, now), 1)
                board.append({"what": j.what, "state": state, "queue_position": len(ahead), "eta_s": eta,
                              "own_s": round(j.remaining_s(now), 1), "ends_in_s": eta,
                              "runs": j.runs, **({"total": j.total} if j.total is not None else {})})
            return board



def _soonest(jobs: list[Job], now: float) -> int:
    """Retry-After for a cap over `jobs`: when the first of them should end, 1 to 60 s."""
    return max(1, min(60, round(min((other.remaining_s(now) for other in jobs), default=1.0))))


def client_of(headers: list[tuple[bytes, bytes]], peer: tuple[str, int] | None) -> str:
    """The client a request comes from, for queueing and kept runs: the cache scope's header or cookie
    (app.lifecycle.client_scope), else the peer's address. Not a security boundary (result_cache_scope is)."""
    scope, new = client_scope(headers)
    return "a:" + (peer[0] if peer else "?") if new else scope
