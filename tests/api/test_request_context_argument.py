"""The request's context is an argument (issue 40 §1): the text request's work, the engine call and the scheduler read
the `ctx` they are given, not the context variable. Each test passes a context that differs from the current one
(EMPTY here: no deadline, no cancel, no timings, shared cache scope) and checks that what was passed decided."""
from __future__ import annotations

import time

import numpy as np
import pytest

from app.context import RequestContext, current
from app.errors import Overloaded
from app.lifecycle import CancelEvent, RequestCancelled
from app.pipeline.text import text_work
from app.runtime import Runtime
from app.schemas import TextAttentionRequest
from app.settings import Settings
from tests.api.helpers import make_settings


def test_the_scheduler_reads_the_deadline_cancel_estimate_and_timings_it_is_given():
    runtime = Runtime(Settings(default_models=[], request_timeout_s=30))
    assert current().deadline is None and current().cancel is None  # nothing of this in the current context
    with pytest.raises(Overloaded, match="timed out"):  # its deadline has passed: no wait at all
        with runtime.admitted(ctx=RequestContext(deadline=time.monotonic() - 1)):
            pass
    left = CancelEvent()
    left.reason = "client"
    left.set()
    with pytest.raises(RequestCancelled):
        with runtime.admitted(ctx=RequestContext(cancel=left)):
            pass
    with pytest.raises(Overloaded, match="needs about 100 s"):  # the estimate no longer fits at its turn
        with runtime.admitted(ctx=RequestContext(deadline=time.monotonic() + 5, estimate_s=100.0)):
            pass
    assert current().estimate_s is None  # the given estimate was never written to the context variable
    timings: dict[str, float] = {}
    with runtime.admitted(ctx=RequestContext(timings=timings)):
        pass
    assert "queue" in timings  # Server-Timing's entry went to the given request's timings


def test_the_text_work_runs_under_the_context_it_is_called_with(tiny_bert):
    """text_work's work(ctx): its run is kept under ctx's cache scope and its model time goes to ctx's timings; a
    request in another scope does not read it."""
    runtime = Runtime(make_settings(tiny_bert))
    runtime.warm_up()
    req = TextAttentionRequest(model="tiny", text="the context travels as an argument", layers=[0], heads=[0])
    timings: dict[str, float] = {}
    first = text_work(runtime, req)(RequestContext(client="alice", cache_scope="alice", timings=timings))
    assert "model" in timings and "queue" in timings
    kept = runtime.get_run(first["run_id"])
    assert kept is not None
    again: dict[str, float] = {}
    same = text_work(runtime, req)(RequestContext(client="alice", cache_scope="alice", timings=again))
    assert same["run_id"] == first["run_id"] and "model" not in again  # from alice's cache entry: no model run
    other: dict[str, float] = {}
    bob = text_work(runtime, req)(RequestContext(client="bob", cache_scope="bob", timings=other))
    assert bob["run_id"] != first["run_id"] and "model" in other  # bob's scope has no entry: its own run
    assert np.array_equal(np.asarray(bob["attention"]), np.asarray(first["attention"]))  # the same numbers
