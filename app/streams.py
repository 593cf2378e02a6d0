"""The one event-stream pump: a request sent with `Accept: text/event-stream` is a job (docs/api.md "Jobs").

`respond(request, work, what)` answers a plain request with `work(ctx)`'s JSON (`ctx`: the request's context,
app/context.py), bounded by request_timeout_s. With `Accept: text/event-stream` it runs the work as a job in a worker
thread (app/jobs.py) with the job's context (`ctx.with_(job=…, deadline=…, progress=…)`): bounded by job_timeout_s,
and streamed in one wire format, one `data: <json>` line per event after its `id: <job_id>:<n>` line:

- `{"accepted": true, "eta_s", "queue_position", "runs"}` first, before any layer runs (the cost check accepts the
  job: app/costs.py; work served from the result cache says eta 0);
- `{"progress": done, "total": runs × n_layers, "run": k, "runs": runs}` after each attention layer of the k-th of the
  request's model runs (one bar over the whole request, never restarting), or the work's own steps (a patching scan's
  batches);
- events the work emits itself (a continuation's tokens);
- then `{"done": true, …the usual JSON response…}`, or `{"error": …, "retry_after"?, "status"?}`.

Refusals before the job is accepted (422, 413, 429, 503, …) keep their own status: the endpoint waits for the work's first
event before it starts the stream. Every event goes through the job's log (JobLog), which numbers and keeps them:
`reattach` (GET /api/jobs/{job_id}/events) replays those after a Last-Event-ID and follows the live job on this same
pump. A job whose streams have all dropped runs on for job_reattach_grace_s awaiting one, then stops at its next
layer or step (JobCancel); `cancel_job` (DELETE /api/jobs/{job_id}: a page's Cancel) stops it at once.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import logging
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import orjson
from fastapi import HTTPException, Request, Response
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from app.allocator import process_warm_heap
from app.openmp_teams import plain_work_done
from app.context import EMPTY, RequestContext, current, enter
from app.encoding import BINARY_MEDIA_TYPE, binary_fields, binary_response, fast_json
from app.handover import replay_of
from app.jobs import Job
from app.ids import new_run_id
from app.lifecycle import Lifecycle, RequestCancelled, check_cancelled
from app.memory import RequestMemory
from app.runtime import Overloaded
from app.sources import source_address

log = logging.getLogger("attnlab")

_RAISE = "raise"
NOTHING = object()  # no event within the wait
HEARTBEAT = b": keep-alive\n\n"  # an SSE comment: clients ignore it, proxies see the stream is alive
FIRST_EVENT_WAIT_S = 5.0  # the route waits this long (at most job_heartbeat_s) for the accepted event or a refusal
SSE_HEADERS = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}


def wants_events(request: Request) -> bool:
    return "text/event-stream" in request.headers.get("accept", "")


def sse(payload: dict[str, Any], event_id: str | None = None) -> bytes:
    """One event in the wire format (orjson: numpy fields as in fast_json, and no newline inside the data line), with
    its `id:` line when it has one (a job's events: `<job_id>:<n>`, what Last-Event-ID names on re-attaching)."""
    data = b"data: " + orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n\n"
    return b"id: " + event_id.encode() + b"\n" + data if event_id is not None else data


class EventPipe:
    """A job's events, from its worker thread to its response: a thread-safe queue that the route's thread reads once
    (the first event, which decides the status) and the response then reads on the event loop, without holding a
    worker thread while the job waits (a queued job's relay used to hold one: 36 queued jobs left none for new
    requests, which then got no answer at all)."""

    def __init__(self) -> None:
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None

    def put(self, item: Any) -> None:
        self._queue.put(item)
        with self._lock:
            loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:
            with contextlib.suppress(RuntimeError):  # the loop has closed: nobody reads any more
                loop.call_soon_threadsafe(wake.set)

    def get(self, timeout: float) -> Any:
        """The next item within `timeout` seconds, or NOTHING (blocking: the route's thread, before the stream)."""
        try:
            return self._queue.get(timeout=timeout)
        except queue.Empty:
            return NOTHING

    async def next(self, timeout: float) -> Any:
        """The next item within `timeout` seconds, or NOTHING (on the event loop)."""
        with self._lock:
            if self._loop is None:
                self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        self._wake.clear()  # cleared before looking: a put from now on wakes the wait below
        try:
            return self._queue.get_nowait()
        except queue.Empty:
            pass
        try:
            await asyncio.wait_for(self._wake.wait(), timeout)
        except TimeoutError:
            return NOTHING
        try:
            return self._queue.get_nowait()
        except queue.Empty:
            return NOTHING


@dataclass(frozen=True)
class Sent:
    """One event of a job as it goes on the wire (its `id: <job_id>:<n>` line included); `last`: done or error. Not a
    tuple: a tuple in a job's pipe is a failure (_RAISE, exc)."""
    n: int
    data: bytes
    last: bool


def gap_event(job_id: str, after: int, first_kept: int, why: str = "job_event_buffer") -> Sent:
    """Said before a replay whose first events are no longer kept: `event: gap` with the numbers missed (after+1 up
    to first_kept-1), the id of the first event that follows and the cap that dropped them (`why`: job_event_buffer,
    a count, or job_event_buffer_bytes). It has no id of its own: a client's Last-Event-ID stays the last event it
    really had. Progress and the done event are cumulative, so nothing is wrong once the replay is read; only events
    of the work's own (a continuation's tokens) in the gap are not sent again."""
    payload = {"gap": {"after": after, "first": first_kept, "missed": first_kept - after - 1,
                       "first_id": f"{job_id}:{first_kept}", "why": why}}
    return Sent(0, b"event: gap\n" + sse(payload), False)


class JobLog:
    """A job's events for every stream that listens: the one that started it and any that re-attach (GET
    /api/jobs/{job_id}/events, docs/api.md "Re-attaching to a job"). Numbers them from 1, keeps the latest `size`
    within `max_bytes` (job_event_buffer_bytes: a generate with every head's attention sends ~19 MB a step; the
    oldest go first) and always the last one, for `keep_s` after the job ended (JobLogs, the app's: app/process.py); what it keeps counts in
    the memory budget (JobLogs.held_bytes, app/memory.py). Each listener reads through an EventPipe of its own.
    With no listener the job is given `grace_s` to be re-attached, then it is cancelled (JobCancel)."""

    def __init__(self, job_id: str, client: str, what: str, size: int, grace_s: float, keep_s: float,
                 max_bytes: int | None = None):
        self.job_id, self.client, self.what, self.grace_s, self.keep_s = job_id, client, what, grace_s, keep_s
        self._recent: deque[Sent] = deque()
        self._size, self._max_bytes = size, max_bytes
        self.held_bytes = 0  # the kept events' bytes (the last one's too): read without the lock by JobLogs
        self.dropped_why = "job_event_buffer"  # the cap that dropped the latest dropped event
        self._end: Sent | None = None
        self._pipes: list[EventPipe] = []
        self._lock = threading.Lock()
        self.count = 0
        self.ended_at: float | None = None  # monotonic: its last event (or its refusal)
        self.detached_since: float | None = None  # monotonic: since when no stream listens
        self.cancelled = False  # DELETE /api/jobs/{job_id}
        self.kept_bytes = 0  # its kept events' bytes once it has ended (JobLogs caps their sum)
        self.on_end: Callable[[JobLog], None] | None = None  # called once, when it has ended (JobLogs.ended)
        # a drain hands the job to a peer (app/handover.py): its work stops, and its events from then on are dropped
        # until `hand_over` logs the last one
        self.handing = False
        self.own_events = False  # it has sent events of the work's own (a continuation's tokens): a re-run repeats them

    def subscribe(self, after: int = 0) -> tuple[list[Sent], EventPipe]:
        """The kept events after number `after`, and a pipe that gets every later one. When events after `after`
        were dropped (more than `size` came since), the backlog starts with a `gap` event (`gap_event`)."""
        pipe = EventPipe()
        with self._lock:
            backlog = [sent for sent in self._recent if sent.n > after]
            if backlog and backlog[0].n > after + 1:
                backlog.insert(0, gap_event(self.job_id, after, backlog[0].n, self.dropped_why))
            if self._end is not None and self._end.n > after and (not backlog or backlog[-1].n < self._end.n):
                if not backlog and self._end.n > after + 1:
                    backlog.append(gap_event(self.job_id, after, self._end.n, self.dropped_why))
                backlog.append(self._end)
            if self.ended_at is None:
                self._pipes.append(pipe)
                self.detached_since = None
            else:
                pipe.put(None)  # nothing more will come: the stream ends after the backlog
        return backlog, pipe

    def unsubscribe(self, pipe: EventPipe) -> None:
        with self._lock:
            if pipe in self._pipes:
                self._pipes.remove(pipe)
                if not self._pipes and self.ended_at is None:
                    self.detached_since = time.monotonic()

    def stop_reason(self, now: float) -> str | None:
        """Why the job should stop now: asked to (DELETE), or no stream has listened for grace_s; else None."""
        if self.handing:
            return "handover"
        if self.cancelled:
            return "client"
        since = self.detached_since
        return "client" if since is not None and now - since >= self.grace_s else None

    def put(self, item: Any) -> None:
        """From the job's worker thread: an event (dict), a failure (_RAISE, exc), or None (the work has ended). A
        failure before the first event (a refusal: the route answers it with its own status) is passed on as it is."""
        with self._lock:
            if self.ended_at is not None or self.handing:
                return
            if isinstance(item, tuple) and self.count == 0:
                self.ended_at = time.monotonic()
                pipes = list(self._pipes)
                for pipe in pipes:
                    pipe.put(item)
                return
            if isinstance(item, tuple):
                item = _end_event(item[1], self.what)
            elif item is None:
                item = {"done": True}
            if self.count == 0 and not item.get("accepted") and "error" not in item:
                self._log({"accepted": True, "eta_s": 0.0, "queue_position": 0, "runs": 0})  # answered from cache
            self._log(item)
            ended = self.ended_at is not None
            if ended:
                kept = list(self._recent) + ([self._end] if self._end not in self._recent else [])
                self.kept_bytes = sum(len(sent.data) for sent in kept)
        if ended and self.on_end is not None:
            self.on_end(self)

    def start_handover(self) -> bool:
        """A drain takes the job (app/handover.py): its work stops at its next check and its events are dropped from
        now on. False when it has already ended (its answer was logged first: nothing to hand over)."""
        with self._lock:
            if self.ended_at is not None or self.handing:
                return False
            self.handing = True
            return True

    def hand_over(self, event: dict[str, Any], event_id: str | None = None) -> None:
        """The job's last event here, written by a drain's handover (app/handover.py) once `handing` has stopped its
        work: `{"handed_over": …}` with the id `<new job id>:0` (a client re-attaching after it follows the job to
        its peer), or an error event when no peer took it. Its streams end after it."""
        with self._lock:
            if self.ended_at is not None:
                return
            self._log(event, event_id, last=True)
            self.kept_bytes = sum(len(sent.data) for sent in self._recent)
        if self.on_end is not None:
            self.on_end(self)

    def _log(self, event: dict[str, Any], event_id: str | None = None, last: bool = False) -> None:  # under _lock
        if event.get("accepted"):
            event = {**event, "job_id": self.job_id}
        elif not ({"progress", "done", "error", "handed_over"} & event.keys()):
            self.own_events = True
        self.count += 1
        last = last or "done" in event or "error" in event
        sent = Sent(self.count, sse(event, event_id or f"{self.job_id}:{self.count}"), last)
        self._keep(sent)
        if last:
            self._end, self.ended_at = sent, time.monotonic()
        for pipe in self._pipes:
            pipe.put(sent)
        if last:
            self._pipes.clear()


    def _keep(self, sent: Sent) -> None:  # under self._lock
        """Keep `sent`, dropping the oldest kept events past `size` or past `max_bytes` (never the one just kept)."""
        self._recent.append(sent)
        self.held_bytes += len(sent.data)
        while len(self._recent) > 1:
            if len(self._recent) > self._size:
                why = "job_event_buffer"
            elif self._max_bytes is not None and self.held_bytes > self._max_bytes:
                why = "job_event_buffer_bytes"
            else:
                break
            self.held_bytes -= len(self._recent.popleft().data)
            self.dropped_why = why


class JobLogs:
    """The logs of this process's jobs by job id, each kept until `keep_s` after its job ended, and the ended ones'
    events at most `max_bytes` together (job_events_max_bytes: past it the oldest ended jobs' logs are dropped first);
    an id whose log was dropped is remembered as expired, with why (the latest EXPIRED_KEPT of them), so a 404 can
    say which case it is."""

    EXPIRED_KEPT = 10_000

    def __init__(self) -> None:
        self._logs: dict[str, JobLog] = {}
        self._expired: OrderedDict[str, str] = OrderedDict()  # job id → "time" | "bytes": why it was dropped
        self._lock = threading.Lock()
        self.max_bytes: int | None = None  # job_events_max_bytes (run_job passes the setting)

    def add(self, log_: JobLog, max_bytes: int | None = None) -> None:
        log_.on_end = self.ended
        with self._lock:
            if max_bytes is not None:
                self.max_bytes = max_bytes
            self._prune(time.monotonic())
            self._logs[log_.job_id] = log_

    def ended(self, _log: JobLog) -> None:
        """A job has ended: its kept events now count against max_bytes."""
        with self._lock:
            self._prune(time.monotonic())

    def ended_bytes(self) -> int:
        """The bytes of the ended jobs' kept events (for /metrics and the tests)."""
        with self._lock:
            return sum(l.kept_bytes for l in self._logs.values() if l.ended_at is not None)

    def held_bytes(self) -> int:
        """The bytes of every kept event, running jobs' and ended ones': what the memory budget counts for them
        (app/memory.py MemoryBudget.keepers)."""
        with self._lock:
            self._prune(time.monotonic())
            return sum(l.held_bytes for l in self._logs.values())

    def drop(self, job_id: str) -> None:
        """A job refused before it was accepted: its id was never sent."""
        with self._lock:
            self._logs.pop(job_id, None)

    def find(self, job_id: str) -> tuple[JobLog | None, str]:
        """(the job's log, "") or (None, "expired" (after its keep_s) | "dropped" (over max_bytes) | "unknown")."""
        with self._lock:
            self._prune(time.monotonic())
            found = self._logs.get(job_id)
            if found is not None:
                return found, ""
            why = self._expired.get(job_id)
            return None, "unknown" if why is None else "dropped" if why == "bytes" else "expired"

    def _prune(self, now: float) -> None:  # under self._lock
        ended = sorted((l for l in self._logs.values() if l.ended_at is not None), key=lambda l: l.ended_at)
        total = sum(l.kept_bytes for l in ended)
        for old in ended:
            if now - old.ended_at > old.keep_s:
                why = "time"
            elif self.max_bytes is not None and total > self.max_bytes:
                why = "bytes"
            else:
                continue
            del self._logs[old.job_id]
            self._expired[old.job_id] = why
            total -= old.kept_bytes
        while len(self._expired) > self.EXPIRED_KEPT:
            self._expired.popitem(last=False)

    def clear(self) -> None:  # tests
        with self._lock:
            self._logs.clear()
            self._expired.clear()



class JobCancel:
    """A job's cancel event (its context's `cancel`, polled like app.lifecycle.CancelEvent): set when the server shuts
    down (the request's own event, or the shutdown cut-off once that request has ended), when DELETE asks, or when no
    stream has listened for job_reattach_grace_s. The request's own "client" cancel (the stream that started the job
    dropped) only means that stream listens no more."""

    def __init__(self, request_cancel: Any, job_log: JobLog, first: EventPipe, lifecycle: Lifecycle):
        self._request, self._log, self._first, self._lifecycle = request_cancel, job_log, first, lifecycle
        self.reason = "cancelled"

    def is_set(self) -> bool:
        why = None
        request = self._request
        if request is not None and request.is_set():
            if request.reason != "client":
                why = request.reason
            else:
                self._log.unsubscribe(self._first)
        if why is None and self._lifecycle.cut_off:
            why = "shutdown"
        why = why or self._log.stop_reason(time.monotonic())
        if why is not None:
            self.reason = why
        return why is not None


def _end_event(exc: BaseException, what: str) -> dict[str, Any]:
    """A failure after the job was accepted, as its last event; a cancelled job says why."""
    if not isinstance(exc, RequestCancelled):
        return error_event(exc, what)
    if exc.reason == "shutdown":
        return {"error": "the job stopped: the server is shutting down; send it again", "retry_after": 5}
    return {"error": "the job was cancelled: its client asked, or no stream listened for job_reattach_grace_s",
            "cancelled": True}


class JobStream:
    """What a job's work may tell its client: progress over its steps, and events of its own."""

    def __init__(self, events: Any, cancel: Any, job: Job | None = None):
        self._events, self._cancel, self.job = events, cancel, job
        self.ctx: RequestContext = EMPTY  # the job's context, made in its worker thread (run_job)
        self._heard = {"run": 0, "done": 0, "total": 0}

    def emit(self, event: dict[str, Any]) -> None:
        if self._cancel.is_set():  # no stream listens any more (past the grace), or cancelled: stop at its next event
            raise RequestCancelled(self._cancel.reason)
        self._events.put(event)

    def layer_done(self, done: int, total: int) -> None:
        """After each attention layer of the request's model runs: one bar over all of them, its length fixed when
        the job was accepted (`job.total`); its eta_s from the job's own rate so far."""
        heard = self._heard
        if done <= heard["done"]:  # layer counts start again: the next model run of the request (compare, samples)
            heard["run"] += 1
        heard["run"] = max(heard["run"], 1)
        heard.update(done=done, total=total)
        run = heard["run"]
        job = self.job
        if job is not None and job.total:  # fixed at acceptance: a run beyond those counted fills the bar's end
            runs, bar = max(1, job.runs), job.total
            per_run = bar / runs
            progress = min(bar, round((min(run, runs) - 1) * per_run + per_run * done / max(total, 1)))
            run = min(run, runs)
        else:  # the runs the cost check counted (accepted on the job); more if the request made more
            runs = max(run, (job.runs if job is not None else 0) or 1)
            progress, bar = (run - 1) * total + done, runs * total
        event = {"progress": progress, "total": bar, "run": run, "runs": runs}
        if job is not None:  # the one ETA (app/jobs.py JobBoard.eta_s): as /api/jobs and /metrics say it
            job.progressed(progress, bar, time.monotonic())
            event["eta_s"] = job.board.ends_in_s(job)
        self.emit(event)

    def step_done(self, done: int, total: int) -> None:
        """After each step of work that counts its own steps (a scan's batches)."""
        check_cancelled(self.ctx)
        event = {"progress": done, "total": total, "run": 1, "runs": 1}
        if self.job is not None:
            self.job.progressed(done, total, time.monotonic())
            event["eta_s"] = self.job.board.ends_in_s(self.job)
        self.emit(event)

    def where(self) -> str:
        return f"{self._heard['done']} of {self._heard['total']} layers (run {self._heard['run']})"


def respond(request: Request, work: Callable[[RequestContext], dict[str, Any]], what: str) -> Response:
    """`work(ctx)`'s answer as JSON, or with `Accept: text/event-stream` as a job: accepted, layer progress, the
    answer. `ctx` is the request's context (a plain request's, else its job's). `what` names the work in the log
    ("POST /api/text/attention")."""
    if not wants_events(request):
        deferred: list[Callable[[], None]] = []
        ctx = current().with_(deferred=deferred)  # the edge: the request's context, as the middleware made it
        try:
            if wants_binary(request):  # f16/f32 fields as raw bytes after a JSON header (app/encoding.py)
                with binary_fields() as parts:
                    body = work(ctx)
                response = answered(body, parts)
            else:
                response = answered(work(ctx))
        except BaseException:
            _run_deferred(deferred)  # an error's answer waits for it, as it did
            raise
        if deferred:
            response.background = BackgroundTask(_after_sent, deferred)
        return response
    return run_job(request, lambda stream: work(stream.ctx), what, layer_progress=True)


# Deferred work runs on a thread of its own, never on the worker that answered: a worker kept busy after its response
# sent the next request to another worker with an OpenMP team of its own (4 OpenMP threads on 2 cores: the next
# smollm2-135m forward took 363 ms instead of 310 ms), as the warm heap's docstring found (app/allocator.py)
_AFTER_RESPONSE = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="attnlab-after-response")


async def _after_sent(deferred: list[Callable[[], None]]) -> None:
    """On the event loop once the body is sent: the deferred work on its own thread, awaited (the request counts as in
    flight until it ends: the run store's writer waits for it, and a test client returns after it)."""
    await asyncio.wrap_future(_AFTER_RESPONSE.submit(_run_deferred, deferred))


def _run_deferred(deferred: list[Callable[[], None]]) -> None:
    """A plain request's deferred work (RequestContext.deferred), after its response was sent: each item on its own
    (one failing is logged, the rest still run)."""
    for work in deferred:
        try:
            work()
        except Exception:  # noqa: BLE001  the response is sent: the log is where this can go
            log.exception("work deferred until after a response failed")


def wants_binary(request: Request) -> bool:
    return BINARY_MEDIA_TYPE in request.headers.get("accept", "")


def answered(body: dict[str, Any], parts: list | None = None) -> Response:
    """A plain request's answer as JSON (with `parts`, the binary body: app/encoding.py binary_response), at the end
    of its work, on the worker thread that did it. That thread then tops up the warm heap in its own malloc arena
    (mapped by the warm heap's thread: app/allocator.py) and, when another model request is in flight, ends its
    OpenMP team (app/openmp_teams.py)."""
    response = fast_json(body) if parts is None else binary_response(body, parts)
    warm = process_warm_heap()
    if warm is not None:
        warm.reserve()
    plain_work_done()
    return response


def respond_steps(request: Request, work: Callable[[Callable[[int, int], None], RequestContext], dict[str, Any]],
                  what: str) -> Response:
    """Like `respond` for work that reports its own steps: `work(progress, ctx)` calls progress(done, total)."""
    if not wants_events(request):
        ctx = current()  # the edge: the request's context, as the middleware made it
        # its turns follow each other: a running job waits for the work's end, not only for each turn's (scheduler)
        with request.app.state.runtime.scheduler.plain_turns(ctx):
            return answered(work(lambda _done, _total: check_cancelled(ctx), ctx))
    return run_job(request, lambda stream: work(stream.step_done, stream.ctx), what, layer_progress=False)


def run_job(request: Request, work: Callable[[JobStream], dict[str, Any] | None], what: str, *,
            layer_progress: bool) -> Response:
    """Run `work(stream)` as a job and stream its events. The work's dict answer becomes the done event; a dict with
    an "error" key is sent as the last event as it is; None ends the stream with a bare done event. The job is on the
    board from here (429 when its client has max_queued_jobs_per_client already, or its address
    max_queued_jobs_per_address; 503 past max_queued_jobs); the stream sends ": keep-alive"
    every job_heartbeat_s while nothing else is sent. Its events are numbered and kept (JobLog) for a client that
    re-attaches (`reattach`); a job whose streams all dropped runs on for job_reattach_grace_s awaiting one."""
    settings, process = request.app.state.runtime.settings, request.app.state.process  # the app's (app/process.py)
    client = current().client
    job_log = JobLog(new_run_id(), client, what, settings.job_event_buffer, settings.job_reattach_grace_s,
                     settings.result_pin_s, settings.job_event_buffer_bytes)
    _, events = job_log.subscribe()  # the stream of this request: the job's first listener
    cancel = JobCancel(current().cancel, job_log, events, process.lifecycle)
    source = source_address(request.scope.get("headers", []), request.scope.get("client"), settings.trusted_proxies)
    job = Job(what=what, client=client, deadline=time.monotonic() + settings.job_timeout_s,
              emit=job_log.put, layer_progress=layer_progress, job_id=job_log.job_id, source=source)
    job.events, job.request = job_log, replay_of(request.scope)  # what a drain needs to hand it over (app/handover.py)
    stream = JobStream(job_log, cancel, job)
    process.jobs.register(job, settings.max_queued_jobs_per_client, settings.max_queued_jobs_per_address,
                          settings.max_queued_jobs)
    process.job_logs.add(job_log, settings.job_events_max_bytes)
    request.app.state.runtime.memory.count_kept("job events", process.job_logs.held_bytes)  # in the budget (app/memory.py)

    def thread_main() -> None:
        # the job's context: the request's (its client, cache scope, timings) with the job, its deadline, its progress
        # sink, its own cancel (it may outlive its request's stream) and its own memory holder (released here, at its
        # end, not when the request's response ends); passed on as an argument, and current in this thread's copy of
        # the context variables only, for the work not yet given it as one (app/context.py)
        request_ctx = current()
        memory = RequestMemory(client=client)
        stream.ctx = request_ctx.with_(job=job, deadline=job.deadline, cancel=cancel, memory=memory,
                                       progress=stream.layer_done if layer_progress else request_ctx.progress)
        enter(stream.ctx)
        try:
            answer = work(stream)
            if answer is not None:
                job_log.put(answer if "error" in answer else {"done": True, **answer})
        except RequestCancelled as exc:
            log.info("%s stopped after %s: %s", what, stream.where(),
                     "the client left" if exc.reason == "client" else exc.reason)
            job_log.put((_RAISE, exc))
        except BaseException as exc:  # noqa: BLE001 - handed to the endpoint (before the stream) or said in the stream
            job_log.put((_RAISE, exc))
        finally:
            process.jobs.finish(job)
            if memory.budget is not None:
                memory.budget.release(memory)
            job_log.put(None)  # nothing more

    context = contextvars.copy_context()  # the request's cache scope and timings go with the work
    try:
        threading.Thread(target=context.run, args=(thread_main,), name="attnlab-job", daemon=True).start()
    except BaseException:
        process.jobs.finish(job)
        process.job_logs.drop(job_log.job_id)
        raise
    heartbeat_s = settings.job_heartbeat_s
    # the first event decides the status (a refusal keeps its own); one that is slow to come does not hold the answer
    first = events.get(min(heartbeat_s, FIRST_EVENT_WAIT_S))
    if isinstance(first, tuple):  # refused or failed before it was accepted: the usual status and body
        process.job_logs.drop(job_log.job_id)
        raise first[1]
    ahead: list[Any] = [] if first is NOTHING else [first]
    return StreamingResponse(_relay(job_log, events, ahead, heartbeat_s), media_type="text/event-stream",
                             headers=SSE_HEADERS)


def reattach(request: Request, job_id: str, after: int) -> Response:
    """GET /api/jobs/{job_id}/events: the job's kept events after number `after`, then the live ones to its end, on
    the same pump as the stream that started it. 404 saying which case it is (unknown, expired) for a job this process
    cannot answer, and for another client's (the same words as unknown: nothing is told of other clients' work)."""
    job_log = _own_job(job_id, request.app.state.process.job_logs, request.app.state.runtime.settings)
    backlog, events = job_log.subscribe(after)
    heartbeat_s = request.app.state.runtime.settings.job_heartbeat_s
    return StreamingResponse(_relay(job_log, events, list(backlog), heartbeat_s), media_type="text/event-stream",
                             headers=SSE_HEADERS)


def cancel_job(job_id: str, job_logs: JobLogs, settings: Any) -> dict[str, Any]:
    """DELETE /api/jobs/{job_id}: the job stops at its next layer or step (the page's Cancel), whatever streams
    listen; 404 as for `reattach`."""
    job_log = _own_job(job_id, job_logs, settings)
    job_log.cancelled = True
    return {"job_id": job_id, "cancelled": job_log.ended_at is None}


def _own_job(job_id: str, job_logs: JobLogs, settings: Any) -> JobLog:
    """The log of this client's job `job_id`, or 404 saying which case it is (unknown, expired); another client's
    job gets the words of an unknown one: nothing is told of other clients' work."""
    job_log, why = job_logs.find(job_id)
    if job_log is not None and not _same_client(job_log.client, current().client):
        job_log, why = None, "unknown"
    if job_log is None:
        raise HTTPException(404, detail=missing_job(job_id, why, settings))
    return job_log


def _same_client(owner: str, asking: str) -> bool:
    """Whether `asking` may see the job of `owner`: the same client, or any holder of the id for a job whose client
    was known by its address only (app.jobs.client_of: no header or cookie; behind a proxy or a forwarding replica
    the address is not the client's own)."""
    return owner == asking or owner.startswith("a:")


def missing_job(job_id: str, why: str, settings: Any) -> str:
    """The 404's detail for a job this process cannot answer (the fleet's router says when its replica is gone)."""
    if why == "expired":
        return (f"job {job_id!r} expired: it ended over result_pin_s={settings.result_pin_s:g} s ago and its events "
                "were dropped: send the job again")
    if why == "dropped":
        return (f"job {job_id!r} expired: it has ended and its events were dropped to keep ended jobs' events under "
                f"job_events_max_bytes={settings.job_events_max_bytes:,}: send the job again")
    return (f"job {job_id!r} is unknown: this server never ran it for this client (an id from another server, or "
            "from before a restart): send the job again")


async def _relay(job_log: JobLog, events: EventPipe, ahead: list[Any], heartbeat_s: float) -> AsyncIterator[bytes]:
    """A job's events as server-sent events, on the event loop, until its last one (done or error), and a comment
    whenever heartbeat_s pass without one. A stream that ends early (its client left) stops listening: the job then
    runs on for job_reattach_grace_s unless another stream listens (JobCancel)."""
    try:
        while True:
            item = ahead.pop(0) if ahead else await events.next(heartbeat_s)
            if item is NOTHING:
                yield HEARTBEAT
                continue
            if item is None:
                return
            if isinstance(item, tuple):  # a failure before any event, after the stream had started with heartbeats
                exc = item[1]
                if not isinstance(exc, RequestCancelled):
                    yield sse(error_event(exc, job_log.what))
                return
            yield item.data
            if item.last:
                return
    finally:
        job_log.unsubscribe(events)


def error_event(exc: BaseException, what: str) -> dict[str, Any]:
    """The stream has started (status 200 is sent): a failure is its last event."""
    if isinstance(exc, Overloaded):
        event = {"error": str(exc), "retry_after": exc.retry_after}
        return {**event, "status": exc.status} if exc.status != 503 else event  # 429: a cap about the client
    detail = getattr(exc, "detail", None)
    if detail is not None:  # an HTTPException after the job was accepted (a later run refused)
        return {"error": detail if isinstance(detail, str) else str(detail), "status": getattr(exc, "status_code", None)}
    log.error("%s failed after it was accepted", what, exc_info=exc)
    return {"error": f"internal error: {type(exc).__name__}"}
