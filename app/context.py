"""The request's own state, read by the scheduler, the cost checks, the memory accountant and the engine call.

`request_deadline`: the monotonic time by which the request must be answered (app/main.py RequestDeadline sets it
when a request arrives; a job's worker thread sets the job's own, job_timeout_s from its arrival). Every wait for
the model inside that request counts against it, so a request that queues twice (encode, then run) still waits at
most `request_timeout_s` in all.

`request_timings`: seconds this request spent waiting for the model ("queue") and running it ("model"), for the
Server-Timing header (app/main.py ServerTiming); a dict shared with the worker thread of the request.
"""
from __future__ import annotations

import contextvars

request_deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar("request_deadline", default=None)
request_timings: contextvars.ContextVar[dict[str, float] | None] = contextvars.ContextVar("request_timings", default=None)


def add_timing(name: str, seconds: float) -> None:
    timings = request_timings.get()
    if timings is not None:
        timings[name] = timings.get(name, 0.0) + seconds
