"""Admission: a request's cost checks and a job's acceptance, with the numbers of app/costs.py.

A request estimated over its time limit (a job's job_timeout_s, else request_timeout_s; a generate stream's
generate_timeout_s) would only be admitted to time out after minutes of work (and gigabytes of recorded maps): it is
answered 413 before it starts, naming the field that drives the cost, and a plain request's 413 says when its
streamed form would be admitted. A job that passes is accepted on the job board (app/jobs.py: its accepted event
with its ETA, place and progress total, then its turn among its client's jobs). Each check takes the request's
context (app/context.py) and returns the estimated seconds: the caller passes them on to the scheduler with its first
run (`ctx.with_(estimate_s=…)`).
"""
from __future__ import annotations

from fastapi import HTTPException

from app import costs
from app.context import RequestContext, current
from app.costs import cost_field, forward_macs, model_shape


def time_limit(settings, ctx: RequestContext | None = None) -> tuple[float, str]:
    """The request `ctx`'s limit (None: the current context's): a job's job_timeout_s, else request_timeout_s."""
    if (ctx or current()).job is not None:
        return settings.job_timeout_s, "job_timeout_s"
    return settings.request_timeout_s, "request_timeout_s"


def _as_job_hint(settings, seconds: float, ctx: RequestContext) -> str:
    """A plain request's 413: whether the streamed form (a job) would be admitted."""
    if ctx.job is None and seconds <= settings.job_timeout_s:
        return (f"; sent with Accept: text/event-stream it runs as a job (limit job_timeout_s="
                f"{settings.job_timeout_s:g} s, progress and an ETA) and would be admitted")
    return ""


def accept_job(seconds: float, runs: int, adapter=None, ctx: RequestContext | None = None) -> None:
    """The request `ctx`'s job (if any; None: the current context's) passed its cost check: its accepted event (with
    its progress total: runs × the adapter's attention layers), then its turn among this client's jobs."""
    job = (ctx or current()).job
    if job is not None:
        layers = len(getattr(adapter, "layer_of", None) or ()) or None
        job.board.accept(job, seconds, runs, layers)


def check_request_cost(adapter, runtime, tokens: int, runs: int, interventions: int, input_field: str = "text",
                       extra=None, ctx: RequestContext | None = None) -> float:
    """413 before any work of the request `ctx` (None: the current context) when `runs` forwards over `tokens`, and
    its `extra` work besides them (an app/pipeline ExtraWork: field, what, multiply-adds, passes; the value-weighted
    overview of a long first view), would not finish within its limit (a job's job_timeout_s, else request_timeout_s); the message names the field
    that drives the cost. A job is then accepted (its ETA event). Returns the estimated seconds: the caller passes
    them with its first run as the context's `estimate_s` (the scheduler refuses a run that no longer fits at its
    turn). `runtime`: the app's (its settings, and its measures of the model's speed)."""
    ctx, settings = ctx or current(), runtime.settings
    shape = model_shape(adapter)
    macs = runs * forward_macs(shape, tokens, tokens, interventions)
    # work a family does besides its forwards, once per request (a long image's rollout: models/adapters/vit.py)
    macs += getattr(adapter, "summary_macs", lambda n: 0.0)(tokens)
    if extra is not None:  # counted here, with the runs, once
        macs += extra.macs
    seconds = costs.estimated_seconds(runtime.measures, adapter, settings, macs)
    limit, setting = time_limit(settings, ctx)
    passes = runs + (extra.passes if extra is not None else 0)
    if seconds > limit:
        field = (extra.field if extra is not None and extra.macs > macs / 2 else cost_field(
            shape, tokens, tokens, runs, interventions, input_field,
            lambda part: costs.estimated_seconds(runtime.measures, adapter, settings, part) <= limit))
        raise HTTPException(413, detail=(
            f"{field}: this request needs {runs} model run{'s' if runs > 1 else ''} over {tokens:,} tokens"
            f"{f' with {interventions} interventions' if interventions else ''}"
            f"{f' and {extra.what}' if extra is not None else ''}, about {seconds:,.0f} s of model "
            f"time on {adapter.info.id} at this machine's measured speed and load, over {setting}={limit:g} s"
            f"{_as_job_hint(settings, seconds, ctx)}; or ask for a shorter input, fewer samples or fewer interventions"
            f"{f' (or {extra.field} as before)' if extra is not None else ''}"))
    accept_job(seconds, passes, adapter, ctx)
    return seconds


def check_extra_cost(adapter, runtime, extra, ctx: RequestContext) -> None:
    """The request `ctx`'s `extra` work (field, what, multiply-adds, passes) when check_request_cost did not count it
    (every run was in the result cache: a weighting switch after a long first view): 413 naming its field when it
    alone would not finish within the request's limit; its job's passes over the layers are this work's only."""
    check_work_cost(adapter, runtime, extra.macs, max(1, extra.passes), extra.field, extra.what, ctx,
                    advice="use a shorter input")


def check_work_cost(adapter, runtime, macs: float, passes: int, field: str, what: str,
                    ctx: RequestContext, advice: str = "ask for less") -> float:
    """Any other work of the request `ctx` measured in multiply-adds (a patching scan's copies, the lens, a
    faithfulness check): 413 naming `field` (and `advice`) when it would not finish within the request's limit; a job
    is then accepted. Returns the seconds; the caller passes them on with its first turn (`ctx.turns(seconds)`)."""
    settings = runtime.settings
    seconds = costs.estimated_seconds(runtime.measures, adapter, settings, macs)
    limit, setting = time_limit(settings, ctx)
    if seconds > limit:
        raise HTTPException(413, detail=(
            f"{field}: {what} needs about {seconds:,.0f} s of model time on {adapter.info.id}, over "
            f"{setting}={limit:g} s{_as_job_hint(settings, seconds, ctx)}; {advice}"))
    accept_job(seconds, passes, adapter, ctx)
    return seconds


def check_stream_cost(adapter, runtime, prompt: int, new_tokens: int, interventions: int) -> None:
    """413 before a generate stream that would not finish within generate_timeout_s; the stream's job is accepted."""
    seconds = costs.stream_seconds(runtime.measures, adapter, runtime.settings, prompt, new_tokens, interventions)
    limit = runtime.settings.generate_timeout_s  # the seconds above: from the measured step times
    if seconds > limit:
        raise HTTPException(413, detail=(
            f"max_new_tokens: {new_tokens} steps on a {prompt:,}-token prompt with {interventions} interventions "
            f"need about {seconds:,.0f} s of model time on {adapter.info.id}, over generate_timeout_s={limit:g} s; "
            "ask for fewer tokens, a shorter prompt or fewer interventions"))
    accept_job(seconds, 2)
