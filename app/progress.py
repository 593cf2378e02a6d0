"""Progress of one long request as server-sent events (docs/api.md "Runs, windows and long inputs").

A first view of thousands of tokens takes seconds on a CPU. When the client asks with `Accept: text/event-stream`,
`respond` runs the request's work in a worker thread with `app.lifecycle.request_progress` set, and streams
`{"progress": done, "total": runs × n_layers, "run": k, "runs": runs}` after each attention layer of the k-th of the
request's `runs` model runs (a compare runs the model once more, and once per further sample; runs the result cache
holds are not run and not counted), `done` = (k − 1)·n_layers + the layers done in run k: one bar from 0 to total
over the whole request, never restarting; then `{"done": true, …the usual JSON response…}`. A client that leaves
(a page's Cancel) stops the work at the next layer.

Refusals before the first layer (422, 413, 503, …) are still answered with their own status: the endpoint waits for
the work's first event (a layer done, the answer, or an error) before it starts the stream.
"""
from __future__ import annotations

import contextvars
import logging
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import orjson
from fastapi import Request, Response
from fastapi.responses import StreamingResponse

from app.costs import request_model_runs
from app.encoding import fast_json
from app.lifecycle import RequestCancelled, check_cancelled, request_progress
from app.runtime import Overloaded

log = logging.getLogger("attnlab")

_RAISE = "raise"


def wants_events(request: Request) -> bool:
    return "text/event-stream" in request.headers.get("accept", "")


def _event(payload: dict[str, Any]) -> bytes:
    # orjson: the answer's numpy fields as in fast_json, and no newline inside the one data line
    return b"data: " + orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n\n"


def respond(request: Request, job: Callable[[], dict[str, Any]], what: str) -> Response:
    """The job's answer as JSON, or with `Accept: text/event-stream` as layer progress events and then the answer.
    `what` names the work in the log ("POST /api/text/attention")."""
    if not wants_events(request):
        return fast_json(job())
    events: queue.Queue = queue.Queue()
    stopped = threading.Event()  # the stream was closed: the client left
    heard = {"run": 0, "done": 0, "total": 0}

    def progress(done: int, total: int) -> None:
        if stopped.is_set():
            raise RequestCancelled("client")
        if done <= heard["done"]:  # layer counts start again: the next model run of the request (compare, samples)
            heard["run"] += 1
        heard["run"] = max(heard["run"], 1)
        heard.update(done=done, total=total)
        run = heard["run"]
        # the runs the cost check counted (set in this worker thread's context); more if the request made more
        runs = max(run, request_model_runs.get() or 1)
        events.put({"progress": (run - 1) * total + done, "total": runs * total, "run": run, "runs": runs})

    def work() -> None:
        request_progress.set(progress)  # in this thread's copy of the request's context only
        try:
            events.put({"done": True, **job()})
        except RequestCancelled as exc:
            log.info("%s stopped after %d of %d layers (run %d): %s", what, heard["done"], heard["total"],
                     heard["run"], "the client left" if exc.reason == "client" else exc.reason)
            events.put((_RAISE, exc))
        except BaseException as exc:  # noqa: BLE001 - handed to the endpoint (before the stream) or said in the stream
            events.put((_RAISE, exc))

    context = contextvars.copy_context()  # the request's cancel event, cache scope and deadline go with the work
    threading.Thread(target=context.run, args=(work,), name="attnlab-progress", daemon=True).start()
    first = events.get()
    if isinstance(first, tuple):  # refused or failed before its first layer: the usual status and body
        raise first[1]

    def stream() -> Iterator[bytes]:
        pending = first
        try:
            while True:
                if isinstance(pending, tuple):
                    exc = pending[1]
                    if isinstance(exc, RequestCancelled):
                        return
                    yield _event(_error(exc, what))
                    return
                yield _event(pending)
                if "done" in pending:
                    return
                while True:
                    try:
                        pending = events.get(timeout=1.0)
                        break
                    except queue.Empty:
                        check_cancelled()
        except RequestCancelled:
            return
        finally:
            stopped.set()  # the stream ended or its client left: the work stops at its next layer

    return StreamingResponse(stream(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})


def _error(exc: Exception, what: str) -> dict[str, Any]:
    """The stream has started (status 200 is sent): a failure is its last event."""
    if isinstance(exc, Overloaded):
        return {"error": str(exc), "retry_after": exc.retry_after}
    detail = getattr(exc, "detail", None)
    if detail is not None:  # an HTTPException after the first layer (a later run refused)
        return {"error": detail if isinstance(detail, str) else str(detail), "status": getattr(exc, "status_code", None)}
    log.error("%s failed after its first layer", what, exc_info=exc)
    return {"error": f"internal error: {type(exc).__name__}"}
