"""The one event-stream pump: a request sent with `Accept: text/event-stream` is a job (docs/api.md "Jobs").

`respond(request, work, what)` answers a plain request with `work()`'s JSON, bounded by request_timeout_s. With
`Accept: text/event-stream` it runs the work as a job in a worker thread (app/jobs.py): bounded by job_timeout_s,
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

import contextvars
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import orjson
from fastapi import Request, Response
from fastapi.responses import StreamingResponse

from app.costs import request_model_runs
from app.encoding import fast_json
from app.jobs import JOBS, Job, current_job, request_client
from app.lifecycle import RequestCancelled, check_cancelled, request_progress
from app.runtime import Overloaded, request_deadline

log = logging.getLogger("attnlab")

_RAISE = "raise"
SSE_HEADERS = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}


def wants_events(request: Request) -> bool:
    return "text/event-stream" in request.headers.get("accept", "")


def sse(payload: dict[str, Any]) -> bytes:
    """One event in the wire format (orjson: numpy fields as in fast_json, and no newline inside the data line)."""
    return b"data: " + orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n\n"


class JobStream:
    """What a job's work may tell its client: progress over its steps, and events of its own."""

    def __init__(self, events: queue.Queue, stopped: threading.Event):
        self._events, self._stopped = events, stopped
        self._heard = {"run": 0, "done": 0, "total": 0}

    def emit(self, event: dict[str, Any]) -> None:
        if self._stopped.is_set():  # the client left: the work stops at its next event
            raise RequestCancelled("client")
        self._events.put(event)

    def layer_done(self, done: int, total: int) -> None:
        """After each attention layer of the request's model runs: one bar over all of them."""
        heard = self._heard
        if done <= heard["done"]:  # layer counts start again: the next model run of the request (compare, samples)
            heard["run"] += 1
        heard["run"] = max(heard["run"], 1)
        heard.update(done=done, total=total)
        run = heard["run"]
        # the runs the cost check counted (set in this worker thread's context); more if the request made more
        runs = max(run, request_model_runs.get() or 1)
        self.emit({"progress": (run - 1) * total + done, "total": runs * total, "run": run, "runs": runs})

    def step_done(self, done: int, total: int) -> None:
        """After each step of work that counts its own steps (a scan's batches)."""
        check_cancelled()
        self.emit({"progress": done, "total": total, "run": 1, "runs": 1})

    def where(self) -> str:
        return f"{self._heard['done']} of {self._heard['total']} layers (run {self._heard['run']})"


def respond(request: Request, work: Callable[[], dict[str, Any]], what: str) -> Response:
    """`work()`'s answer as JSON, or with `Accept: text/event-stream` as a job: accepted, layer progress, the answer.
    `what` names the work in the log ("POST /api/text/attention")."""
    if not wants_events(request):
        return fast_json(work())
    return run_job(request, lambda stream: work(), what, layer_progress=True)


def respond_steps(request: Request, work: Callable[[Callable[[int, int], None]], dict[str, Any]], what: str) -> Response:
    """Like `respond` for work that reports its own steps: `work(progress)` calls progress(done, total)."""
    if not wants_events(request):
        return fast_json(work(lambda _done, _total: check_cancelled()))
    return run_job(request, lambda stream: work(stream.step_done), what, layer_progress=False)


def run_job(request: Request, work: Callable[[JobStream], dict[str, Any] | None], what: str, *,
            layer_progress: bool) -> Response:
    """Run `work(stream)` as a job and stream its events. The work's dict answer becomes the done event; a dict with
    an "error" key is sent as the last event as it is; None ends the stream without one."""
    settings = request.app.state.runtime.settings
    events: queue.Queue = queue.Queue()
    stopped = threading.Event()  # the stream was closed: the client left
    stream = JobStream(events, stopped)
    job = Job(what=what, client=request_client.get(), deadline=time.monotonic() + settings.job_timeout_s,
              emit=events.put)

    def thread_main() -> None:
        current_job.set(job)  # in this thread's copy of the request's context only
        request_deadline.set(job.deadline)
        if layer_progress:
            request_progress.set(stream.layer_done)
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
    threading.Thread(target=context.run, args=(thread_main,), name="attnlab-job", daemon=True).start()
    first = events.get()
    if isinstance(first, tuple):  # refused or failed before it was accepted: the usual status and body
        raise first[1]
    if first is None:
        first = {"done": True}
    ahead = [first]
    if not first.get("accepted"):  # answered from the result cache without a cost check: nothing to wait for
        ahead.insert(0, {"accepted": True, "eta_s": 0.0, "queue_position": 0, "runs": 0})

    def relay() -> Iterator[bytes]:
        pending = ahead.pop(0)
        try:
            while pending is not None:
                if isinstance(pending, tuple):
                    exc = pending[1]
                    if not isinstance(exc, RequestCancelled):
                        yield sse(error_event(exc, what))
                    return
                yield sse(pending)
                if "done" in pending or "error" in pending:
                    return
                while True:
                    if ahead:
                        pending = ahead.pop(0)
                        break
                    try:
                        pending = events.get(timeout=1.0)
                        break
                    except queue.Empty:
                        check_cancelled()
        except RequestCancelled:
            return
        finally:
            stopped.set()  # the stream ended or its client left: the work stops at its next layer

    return StreamingResponse(relay(), media_type="text/event-stream", headers=SSE_HEADERS)


def error_event(exc: BaseException, what: str) -> dict[str, Any]:
    """The stream has started (status 200 is sent): a failure is its last event."""
    if isinstance(exc, Overloaded):
        return {"error": str(exc), "retry_after": exc.retry_after}
    detail = getattr(exc, "detail", None)
    if detail is not None:  # an HTTPException after the job was accepted (a later run refused)
        return {"error": detail if isinstance(detail, str) else str(detail), "status": getattr(exc, "status_code", None)}
    log.error("%s failed after it was accepted", what, exc_info=exc)
    return {"error": f"internal error: {type(exc).__name__}"}
