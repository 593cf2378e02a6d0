"""One request's state in one object: `RequestContext`, made once per request by the middleware (app/main.py
RequestDeadline, with what app/lifecycle.py RequestGuard and app/main.py ServerTiming set around it) and read by
admission (app/jobs.py), the cost checks (app/admission.py), the memory reservation (app/memory.py), the scheduler
(app/scheduler.py) and the engine call (app/runtime.py).

Its fields:
- `client`: who sent it (the X-Attnlab-Client header, else the attnlab_client cookie, else the peer's address): jobs
  queue and take turns per client, and a client may evict its own kept runs;
- `deadline`: the monotonic time by which it must be answered (request_timeout_s from its arrival; a job's
  job_timeout_s). Every wait for the model inside it counts against it;
- `cancel`: set when its client leaves or the server stops (app/lifecycle.py); `cache_scope`: the client whose cached
  results it reads and writes with result_cache_scope="client" (None: shared);
- `progress`: called as progress(layers_done, n_layers) after each attention layer of its model runs (a job's
  stream); `job`: the job it is (app/jobs.py), None for a plain request;
- `estimate_s` and `passes`: its cost check's model seconds (the scheduler refuses it at its first turn when they
  no longer fit before the deadline) and passes over the layers (a job's progress bar);
- `memory`: what it has reserved of the memory budget (app/memory.py); `timings`: seconds waiting for and running
  the model, for the Server-Timing header.

The object sits in one context variable (so the worker thread of a sync endpoint and a job's thread see it).
Each field is also reachable as a `ContextField` under its old name (`request_deadline`, `request_cancel`, …):
`.get()` reads the current context's field, and `.set(value)` puts a copy of the context with that field changed
(copy on write: a job's thread changing its deadline does not change the request's), so code written against
context variables keeps working while the state lives in one place.
"""
from __future__ import annotations

import contextvars
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_current: contextvars.ContextVar[RequestContext | None] = contextvars.ContextVar("attnlab_request", default=None)


@dataclass(frozen=True)
class RequestContext:
    client: str = ""
    deadline: float | None = None
    cancel: Any = None  # app.lifecycle.CancelEvent
    cache_scope: str | None = None
    progress: Callable[[int, int], None] | None = None
    job: Any = None  # app.jobs.Job
    estimate_s: float | None = None
    memory: Any = None  # app.memory.RequestMemory
    timings: dict[str, float] | None = None

    def with_(self, **fields: Any) -> RequestContext:
        return dataclasses.replace(self, **fields)


EMPTY = RequestContext()  # outside a request (scripts, tests of the engine): no deadline, no client, nothing held


def current() -> RequestContext:
    """The current request's context (EMPTY outside a request)."""
    return _current.get() or EMPTY


def enter(context: RequestContext) -> contextvars.Token:
    """Make `context` the current one (undo with leave(token))."""
    return _current.set(context)


def leave(token: contextvars.Token) -> None:
    _current.reset(token)


class ContextField:
    """One field of the current RequestContext, read and written like a context variable (see the module doc)."""

    def __init__(self, name: str):
        self.name = name

    def get(self) -> Any:
        return getattr(current(), self.name)

    def set(self, value: Any) -> contextvars.Token:
        return _current.set(current().with_(**{self.name: value}))

    def reset(self, token: contextvars.Token) -> None:
        """Put back this field's value from before `token`'s set, and only this field: fields are reset in any
        order, as separate context variables were (resetting the whole context would undo later sets of others)."""
        before = token.old_value
        if before is contextvars.Token.MISSING or before is None:
            before = EMPTY
        _current.set(current().with_(**{self.name: getattr(before, self.name)}))


request_deadline = ContextField("deadline")
request_timings = ContextField("timings")
request_model_seconds = ContextField("estimate_s")  # the cost check's model seconds (app/admission.py)


def add_timing(name: str, seconds: float, ctx: RequestContext | None = None) -> None:
    """Add `seconds` to the request's Server-Timing entry `name` (`ctx`: the request's context; None: the current)."""
    timings = (ctx or current()).timings
    if timings is not None:
        timings[name] = timings.get(name, 0.0) + seconds
