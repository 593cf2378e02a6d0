"""One request's state in one object: `RequestContext`, made once per request by the middleware (app/main.py
RequestDeadline, with what app/lifecycle.py RequestGuard and app/main.py ServerTiming set around it), and passed as
an argument (`ctx`) to admission and the cost checks (app/admission.py), the memory reservation (app/memory.py
MemoryBudget.reserve), the engine call (app/runtime.py Runtime.run, encode, step), the scheduler (app/scheduler.py
ModelScheduler.admitted) and the per-layer listener (app/lifecycle.py after_layer).

Its fields:
- `client`: who sent it (the X-Attnlab-Client header, else the attnlab_client cookie, else the peer's address): jobs
  queue and take turns per client, and a client may evict its own kept runs;
- `deadline`: the monotonic time by which it must be answered (request_timeout_s from its arrival; a job's
  job_timeout_s). Every wait for the model inside it counts against it;
- `cancel`: set when its client leaves or the server stops (app/lifecycle.py); `cache_scope`: the client whose cached
  results it reads and writes with result_cache_scope="client" (None: shared);
- `progress`: called as progress(layers_done, n_layers) after each attention layer of its model runs (a job's
  stream); `job`: the job it is (app/jobs.py), None for a plain request;
- `estimate_s`: its cost check's model seconds, carried by its first run that is not cached (the scheduler refuses
  it at that turn when they no longer fit before the deadline); the later runs carry None;
- `memory`: what it has reserved of the memory budget (app/memory.py); `timings`: seconds waiting for and running
  the model, for the Server-Timing header;
- `deferred`: work the answer need not wait for (the run store making room: older runs' files), run after a plain
  request's response is sent (`after_response`).

How it travels. The middleware puts it in the one context variable, which crosses what we do not own: FastAPI's hop
of a sync endpoint to its worker thread. At the edge (app/streams.py `respond`, or a route that answers at once:
`current()`) it is taken once and from there passed as `ctx`. A job's worker thread makes the job's own with
`ctx.with_(job=…, deadline=job_timeout_s from its arrival, progress=its stream)` and passes that on; a request's first
run gets `ctx.with_(estimate_s=…)` from its cost check (work of several turns: `ctx.turns(estimate_s)`). The engine (models/) never sees it: the scheduler hands the
engine's per-layer listener (models/hooks.py on_each_layer, our own channel through transformers' attention function)
a closure over it.

Read from the context variable still (a function given no `ctx` reads `current()` at its top), for the work not yet
passed one: generation and transcription (app/routes/text.py generate, app/routes/audio.py transcribe: their job
threads have the job's context current), the image and speech routes' encoding before their job is built, the kept
runs' windows and rows (app/routes/runs.py), and work outside a request (the start-up timing, scripts, tests). Two
fields keep a `ContextField` under their old name (`.get()` reads the current context's field, `.set(value)` makes a
copy with it changed, `.reset(token)` puts back that field only):
- `request_deadline`: a first use's model load (Runtime.adapter, before the route takes its context) gives its time
  back to the request's deadline;
- `request_cancel` (app/lifecycle.py): the job board's wait for the client's earlier job (app/jobs.py JobBoard.accept,
  called by the cost checks with the job only).
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
    # work its answer need not wait for, run once the response is sent (a plain request's: app/streams.py respond);
    # None (a job, work outside a request): `after_response` runs it at once
    deferred: list[Callable[[], None]] | None = None

    def with_(self, **fields: Any) -> RequestContext:
        return dataclasses.replace(self, **fields)

    def turns(self, estimate_s: float) -> Callable[[], RequestContext]:
        """For work made of several model turns (a scan's batches): each call gives the next turn's context, the first
        with the cost check's `estimate_s` (refused at that turn when it no longer fits), the later ones without."""
        pending = [self.with_(estimate_s=estimate_s)]
        later = self.with_(estimate_s=None)
        return lambda: pending.pop() if pending else later


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


def after_response(ctx: RequestContext, work: Callable[[], None]) -> None:
    """`work()` once the request's response is sent where the request defers work (`deferred`), else now."""
    if ctx.deferred is None:
        work()
    else:
        ctx.deferred.append(work)


def add_timing(name: str, seconds: float, ctx: RequestContext | None = None) -> None:
    """Add `seconds` to the request's Server-Timing entry `name` (`ctx`: the request's context; None: the current)."""
    timings = (ctx or current()).timings
    if timings is not None:
        timings[name] = timings.get(name, 0.0) + seconds
