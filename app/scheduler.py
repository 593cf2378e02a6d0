"""The model's turns: one forward at a time, handed over in a fair order (docs/api.md "Jobs").

- Interactive work (a plain request, a decoding step, a window) goes before any waiting job, and a running job hands
  the model to it at the next layer boundary: short work waits for at most one layer of a long job.
- Among waiting work of one kind, turns go round the clients: the client served least recently goes first, each
  client's own work in its arrival order. One client's 30 queued jobs do not hold back another client's first one.
- A job that has started keeps its turn until it ends (its later runs, and after handing over to interactive work),
  so its runs are not interleaved with other jobs' and its ETA holds.
- A job of many short turns (a generate stream's steps: `keeping_turn`) keeps the model from its first turn to its
  end: no other job takes a turn between two of its steps (interactive work still goes first). Interleaved, four
  parallel streams each ran at a quarter of the speed their ETAs assumed, and three ran out of generate_timeout_s with
  0 tokens; one at a time, each stream's ETA (the jobs ahead, then its own steps) holds.
- A plain request of several turns (a head taxonomy's probes, a scan's batches: `plain_turns`) waits for a running job
  once: until it ends no job takes the model back between two of its turns (each gap between them was a job layer's
  wait, a dozen in all, and on a busy machine its whole request_timeout_s).
- At most `queue_depth` requests wait; one more is refused at once (503 + Retry-After), as is a wait past the
  request's deadline, or a request whose estimated model time no longer fits before its deadline at its first turn.
"""
from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Iterator

from app.context import RequestContext, add_timing, current
from app.errors import Overloaded
from app.lifecycle import RequestCancelled, after_layer
from app.openmp_teams import job_hands_over_team
from models.hooks import on_each_layer

CANCEL_POLL_S = 0.1  # a queued request whose client left stops waiting within this
INTERACTIVE, JOB = 0, 1
RUNNING = -1  # a started job's place among waiting jobs: before every job that has not started


class ModelScheduler:
    """The model lock and its turns (see the module doc). `settings` needs queue_depth, request_timeout_s and
    job_timeout_s."""

    def __init__(self, settings) -> None:
        self.settings = settings
        self._run_lock = threading.Lock()  # one forward at a time
        self._turns = threading.Condition()  # the lock is handed over by priority (see _acquire_in_order)
        # waiting turns as (kind, client, arrival, started job?), ordered by _order when the lock is free
        self._fifo: list[tuple[int, str, int, bool]] = []
        self._tickets = itertools.count(1)
        self._served: dict[tuple[int, str], int] = {}  # (kind, client) → the turn at which it last got the model
        self._turn = itertools.count(1)
        self.yields = 0  # times a running job handed the model to waiting interactive work (for the benchmarks)
        self._waiting = 0
        self._waiting_lock = threading.Lock()
        self._plain_works = 0  # plain requests of several turns in progress (plain_turns): jobs wait for their end
        self._keeping: set[int] = set()  # jobs (by seq) inside keeping_turn: from their first turn they hold the turn
        self._holder: int | None = None  # the seq of the job that holds the turn (keeping_turn), once it has had it

    @property
    def waiting(self) -> int:
        return self._waiting

    def _entry(self, interactive: bool, job, client: str) -> tuple[int, str, int, bool]:
        """A waiting turn: (kind, client, arrival, a started job?)."""
        if interactive or job is None:
            return INTERACTIVE, client, next(self._tickets), False
        return JOB, job.client, job.seq, job.started

    def _order(self, entry: tuple[int, str, int, bool]) -> tuple[int, int, int]:
        """Lower goes first: the kind, then a started job, then the client served least recently (read now, so a
        client's second request goes behind every client that has waited since its first), then arrival."""
        kind, client, arrival, started = entry
        return kind, RUNNING if started else self._served.get((kind, client), 0), arrival

    def _mark_served(self, entry: tuple[int, str, int, bool], job) -> None:
        kind, client, _, started = entry
        if started:
            return
        self._served[(kind, client)] = next(self._turn)
        if kind == JOB:
            job.started, job.started_at = True, time.monotonic()

    def _take_turn_if_kept(self, entry: tuple[int, str, int, bool]) -> None:
        """A job inside keeping_turn holds the turn from its first turn on (under _turns)."""
        if entry[0] == JOB and entry[2] in self._keeping:
            self._holder = entry[2]

    def _job_may_go(self, entry: tuple[int, str, int, bool]) -> bool:
        """Whether a job's turn may be taken now: no plain work of several turns in progress (plain_turns), and no
        other job holding the turn (keeping_turn). Interactive work may always go."""
        if entry[0] != JOB:
            return True
        return not self._plain_works and self._holder in (None, entry[2])

    @contextlib.contextmanager
    def admitted(self, interactive: bool | None = None, ctx: RequestContext | None = None) -> Iterator[None]:
        """Hold the model lock for the request `ctx` (its job, client, deadline, cancel, estimate and timings; None:
        the current context: scripts, tests and the start-up timing); refuse at once when `queue_depth` requests already wait
        (`interactive` None: whatever is not a job)."""
        ctx = ctx or current()
        job = ctx.job
        if interactive is None:
            interactive = job is None
        entry = self._entry(interactive, job, ctx.client)
        with self._waiting_lock:
            if self._waiting >= self.settings.queue_depth:
                raise Overloaded(f"server busy: {self._waiting} requests already waiting (queue_depth)")
            self._waiting += 1
        deadline, cancel = ctx.deadline, ctx.cancel
        timeout = self.settings.request_timeout_s if deadline is None else deadline - time.monotonic()
        waited_from = time.perf_counter()
        try:
            acquired = timeout > 0 and self._acquire_in_order(timeout, entry, cancel)
        finally:
            add_timing("queue", time.perf_counter() - waited_from, ctx)
            with self._waiting_lock:
                self._waiting -= 1
        if acquired == "cancelled":
            raise RequestCancelled(cancel.reason)
        if not acquired:
            raise self._timed_out(job)
        self._mark_served(entry, job)
        holding = [True]

        def layer_done(layer: int, n_layers: int) -> None:
            after_layer(layer, n_layers, ctx)  # cancel and progress first: a job that should stop does not queue again
            if entry[0] == JOB:
                self._hand_over_if_waited(holding, job, ctx)

        try:
            if cancel is not None and cancel.is_set():  # the client left while we waited: the lock goes on at once
                raise RequestCancelled(cancel.reason)
            self._refuse_if_out_of_time(deadline, ctx.estimate_s, job)  # the caller passes the estimate to its first turn
            with on_each_layer(layer_done):  # a client that leaves stops the forward at its next layer
                yield
        finally:
            if holding[0]:
                self._run_lock.release()
            with self._turns:
                self._turns.notify_all()

    @contextlib.contextmanager
    def plain_turns(self, ctx: RequestContext | None = None) -> Iterator[None]:
        """The work of a plain request `ctx` (None: the current context) made of several model turns: while it lasts,
        a running job hands the model over at its next layer and takes it back only once this work has ended, so the
        work waits for about one layer of the job in all, not one per turn. A job's own work (ctx.job set) is not
        held: it takes its turns like any job."""
        if (ctx or current()).job is not None:
            yield
            return
        with self._turns:
            self._plain_works += 1
        try:
            yield
        finally:
            with self._turns:
                self._plain_works -= 1
                self._turns.notify_all()

    @contextlib.contextmanager
    def keeping_turn(self, ctx: RequestContext | None = None) -> Iterator[None]:
        """The work of the job of `ctx` (None: the current context) made of many short turns (a generate stream's
        steps): from its first turn until this ends, no other job takes a turn between two of its turns (it waits
        for the job ahead of it as any job does). Outside a job: nothing."""
        job = (ctx or current()).job
        if job is None:
            yield
            return
        with self._turns:
            self._keeping.add(job.seq)
        try:
            yield
        finally:
            with self._turns:
                self._keeping.discard(job.seq)
                if self._holder == job.seq:
                    self._holder = None
                self._turns.notify_all()

    def _timed_out(self, job) -> Overloaded:
        retry_after = max(1, round(self.settings.request_timeout_s / 4))
        if job is not None:
            return Overloaded(f"timed out waiting for the model: the job ran past job_timeout_s="
                              f"{self.settings.job_timeout_s:g} s", retry_after=retry_after)
        return Overloaded(f"timed out after {self.settings.request_timeout_s:g} s waiting for the model "
                          "(request_timeout_s)", retry_after=retry_after)

    def _hand_over_if_waited(self, holding: list[bool], job, ctx: RequestContext) -> None:
        """Between two layers of a job's forward: when interactive work waits, let it run, then take the lock back
        before any other job. The forward's state lives in this thread and the engine's recording in context
        variables, so another forward in between changes nothing of this one."""
        with self._turns:
            if not self._plain_works and not any(kind == INTERACTIVE for kind, *_ in self._fifo):
                return
            job_hands_over_team()
            holding[0] = False
            self._run_lock.release()
            self.yields += 1
            self._turns.notify_all()
        deadline = ctx.deadline
        timeout = self.settings.job_timeout_s if deadline is None else deadline - time.monotonic()
        acquired = timeout > 0 and self._acquire_in_order(timeout, (JOB, job.client, job.seq, True), ctx.cancel)
        if acquired == "cancelled":
            raise RequestCancelled(ctx.cancel.reason)
        if not acquired:
            raise self._timed_out(job)
        holding[0] = True

    def _refuse_if_out_of_time(self, deadline: float | None, estimate: float | None, job=None) -> None:
        """At a request's first turn with the model: 503 when its estimated model time no longer fits before its
        deadline (it waited in a long queue), instead of starting work that the deadline would throw away. The
        message names the limit that applies: a job's job_timeout_s, else request_timeout_s."""
        if estimate is None:
            return
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and estimate > left:
            limit = (f"job_timeout_s={self.settings.job_timeout_s:g} s" if job is not None
                     else f"request_timeout_s={self.settings.request_timeout_s:g} s")
            raise Overloaded(
                f"server busy: this request needs about {estimate:.0f} s of model time and {max(left, 0):.0f} s "
                f"of {limit} are left after its wait in the queue",
                retry_after=max(1, round(self.settings.request_timeout_s / 4)),
            )

    def _acquire_in_order(self, timeout: float, entry: tuple[int, str, int, bool] | None = None,
                          cancel=None) -> bool | str:
        """Take the model lock in priority order: with a bare Lock a newcomer may overtake the queue, so an unlucky
        request could wait until its time limit however short the queue is. "cancelled": the request's client left
        (or the server stops) while it waited; it leaves the queue then."""
        end = time.monotonic() + timeout
        entry = entry or (INTERACTIVE, "", next(self._tickets), False)
        with self._turns:
            self._fifo.append(entry)
            try:
                while True:
                    if cancel is not None and cancel.is_set():
                        return "cancelled"
                    # a job waits while plain work of several turns is in progress, or another job holds the turn
                    eligible = self._job_may_go(entry)
                    first = eligible and min(filter(self._job_may_go, self._fifo), key=self._order) is entry
                    if first and self._run_lock.acquire(blocking=False):
                        self._take_turn_if_kept(entry)
                        return True
                    remaining = end - time.monotonic()
                    if remaining <= 0:
                        return False
                    # woken at each release; the poll notices a cancelled request (a client that left)
                    self._turns.wait(min(remaining, CANCEL_POLL_S if cancel is not None else 0.5))
            finally:
                self._fifo.remove(entry)
                self._turns.notify_all()
