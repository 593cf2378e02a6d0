"""The one event-stream pump: a request sent with `Accept: text/event-stream` is a job (docs/api.md "Jobs").

`respond(request, work, what)` answers a plain request with `work(ctx)`'s JSON (`ctx`: the request's context,
app/context.py), bounded by request_timeout_s. With `Accept: text/event-stream` it runs the work as a job in a worker
thread (app/jobs.py) with the job's context (`ctx.with_(job=…, deadline=…, progress=…)`): bounded by job_timeout_s,
and streamed in one wire format, one `data: <json>` line per event:

- `{"accepted": true, "eta_s", "queue_position", "runs"}` first, before any layer runs (the cost check accepts the
  job: app/costs.py; work served from the result cache says eta 0);
- `{"progress": done, "total": runs × n_layers, "run": k, "runs": runs}` after each attention layer of the k-th of the
  request's model runs (one bar over the whole request, never restarting), or the work's own steps (a patching scan's
  batches);
- events the work emits itself (a continuation's tokens);
- then `{"done": true, …the usual JSON response…}`, or `{"error": …, "retry_after"?, "status"?}`.

Refusals before the job is accepted (422, 413, 503, …) keep their own status: the endpoint waits for the work's first
event before it starts the stream. A client that leaves (a page's Cancel) stops the work at its next layer or step.
"""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
from fastapi import Request, Response
from fastapi.responses import StreamingResponse

from app.context import EMPTY, RequestContext, current, enter
from app.encoding import fast_json
from app.jobs import JOBS, Job
from app.lifecycle import RequestCancelled, check_cancelled
from app.runtime import Overloaded

log = logging.getLogger("attnlab")

_RAISE = "raise"
NOTHING = object()  # no event within the wait
HEARTBEAT = b": keep-alive\n\n"  # an SSE comment: clients ignore it, proxies see the stream is alive
FIRST_EVENT_WAIT_S = 5.0  # the route waits this long (at most job_heartbeat_s) for the accepted event or a refusal
SSE_HEADERS = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}


def wants_events(request: Request) -> bool:
    return "text/event-stream" in request.headers.get("accept", "")


def sse(payload: dict[str, Any]) -> bytes:
    """One event in the wire format (orjson: numpy fields as in fast_json, and no newline inside the data line)."""
    return b"data: " + orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n\n"


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


class JobStream:
    """What a job's work may tell its client: progress over its steps, and events of its own."""

    def __init__(self, events: EventPipe, stopped: threading.Event, job: Job | None = None):
        self._events, self._stopped, self.job = events, stopped, job
        self.ctx: RequestContext = EMPTY  # the job's context, made in its worker thread (run_job)
        self._heard = {"run": 0, "done": 0, "total": 0}

    def emit(self, event: dict[str, Any]) -> None:
        if self._stopped.is_set():  # the client left: the work stops at its next event
            raise RequestCancelled("client")
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
        if job is not None:
            event["eta_s"] = job.progressed(progress, bar, time.monotonic())
        self.emit(event)

    def step_done(self, done: int, total: int) -> None:
        """After each step of work that counts its own steps (a scan's batches)."""
        check_cancelled(self.ctx)
        event = {"progress": done, "total": total, "run": 1, "runs": 1}
        if self.job is not None:
            event["eta_s"] = self.job.progressed(done, total, time.monotonic())
        self.emit(event)

    def where(self) -> str:
        return f"{self._heard['done']} of {self._heard['total']} layers (run {self._heard['run']})"


def respond(request: Request, work: Callable[[RequestContext], dict[str, Any]], what: str) -> Response:
    """`work(ctx)`'s answer as JSON, or with `Accept: text/event-stream` as a job: accepted, layer progress, the
    answer. `ctx` is the request's context (a plain request's, else its job's). `what` names the work in the log
    ("POST /api/text/attention")."""
    if not wants_events(request):
        return fast_json(work(current()))  # the edge: the request's context, as the middleware made it
    return run_job(request, lambda stream: work(stream.ctx), what, layer_progress=True)


def respond_steps(request: Request, work: Callable[[Callable[[int, int], None], RequestContext], dict[str, Any]],
                  what: str) -> Response:
    """Like `respond` for work that reports its own steps: `work(progress, ctx)` calls progress(done, total)."""
    if not wants_events(request):
        ctx = current()  # the edge: the request's context, as the middleware made it
        return fast_json(work(lambda _done, _total: check_cancelled(ctx), ctx))
    return run_job(request, lambda stream: work(stream.step_done, stream.ctx), what, layer_progress=False)


def run_job(request: Request, work: Callable[[JobStream], dict[str, Any] | None], what: str, *,
            layer_progress: bool) -> Response:
    """Run `work(stream)` as a job and stream its events. The work's dict answer becomes the done event; a dict with
    an "error" key is sent as the last event as it is; None ends the stream without one. The job is on the board
    from here (503 when its client has max_queued_jobs_per_client already); the stream sends ": keep-alive" every
    job_heartbeat_s while nothing else is sent."""
    settings = request.app.state.runtime.settings
    events = EventPipe()
    stopped = threading.Event()  # the stream was closed: the client left
    job = Job(what=what, client=current().client, deadline=time.monotonic() + settings.job_timeout_s,
              emit=events.put, layer_progress=layer_progress)
    stream = JobStream(events, stopped, job)
    JOBS.register(job, settings.max_queued_jobs_per_client)

    def thread_main() -> None:
        # the job's context: the request's (its client, cancel event, cache scope, memory, timings) with the job, its
        # deadline and its progress sink; passed on as an argument, and current in this thread's copy of the context
        # variables only, for the work not yet given it as one (app/context.py)
        request_ctx = current()
        stream.ctx = request_ctx.with_(job=job, deadline=job.deadline,
                                       progress=stream.layer_done if layer_progress else request_ctx.progress)
        enter(stream.ctx)
        try:
            answer = work(stream)
            if answer is not None:
                events.put(answer if "error" in answer else {"done": True, **answer})
        except RequestCancelled as exc:
            log.info("%s stopped after %s: %s", what, stream.where(),
                     "the client left" if exc.reason == "client" else exc.reason)
            events.put((_RAISE, exc))
        except BaseException as exc:  # noqa: BLE001 - handed to the endpoint (before the stream) or said in the stream
            events.put((_RAISE, exc))
        finally:
            JOBS.finish(job)
            events.put(None)  # nothing more

    context = contextvars.copy_context()  # the request's cancel event, cache scope and memory go with the work
    try:
        threading.Thread(target=context.run, args=(thread_main,), name="attnlab-job", daemon=True).start()
    except BaseException:
        JOBS.finish(job)
        raise
    heartbeat_s = settings.job_heartbeat_s
    # the first event decides the status (a refusal keeps its own); one that is slow to come does not hold the answer
    first = events.get(min(heartbeat_s, FIRST_EVENT_WAIT_S))
    if isinstance(first, tuple):  # refused or failed before it was accepted: the usual status and body
        raise first[1]
    ahead: list[Any] = [] if first is NOTHING else [first]
    return StreamingResponse(_relay(events, ahead, stopped, heartbeat_s, what), media_type="text/event-stream",
                             headers=SSE_HEADERS)


async def _relay(events: EventPipe, ahead: list[Any], stopped: threading.Event, heartbeat_s: float,
                 what: str) -> AsyncIterator[bytes]:
    """The job's events as server-sent events, on the event loop: the accepted event first (one of ETA 0 for work
    answered from the result cache without a cost check), then the rest until done or error, and a comment whenever
    heartbeat_s pass without one."""
    accepted = False
    try:
        while True:
            item = ahead.pop(0) if ahead else await events.next(heartbeat_s)
            if item is NOTHING:
                yield HEARTBEAT
                continue
            if item is None:
                item = {"done": True}
            if isinstance(item, tuple):
                exc = item[1]
                if not isinstance(exc, RequestCancelled):
                    yield sse(error_event(exc, what))
                return
            if not accepted and not item.get("accepted") and "error" not in item:
                yield sse({"accepted": True, "eta_s": 0.0, "queue_position": 0, "runs": 0})
            accepted = True
            yield sse(item)
            if "done" in item or "error" in item:
                return
    finally:
        stopped.set()  # the stream ended or its client left: the work stops at its next layer


def error_event(exc: BaseException, what: str) -> dict[str, Any]:
    """The stream has started (status 200 is sent): a failure is its last event."""
    if isinstance(exc, Overloaded):
        return {"error": str(exc), "retry_after": exc.retry_after}
    detail = getattr(exc, "detail", None)
    if detail is not None:  # an HTTPException after the job was accepted (a later run refused)
        return {"error": detail if isinstance(detail, str) else str(detail), "status": getattr(exc, "status_code", None)}
    log.error("%s failed after it was accepted", what, exc_info=exc)
    return {"error": f"internal error: {type(exc).__name__}"}
