"""A job of many short turns (a generate stream's steps) keeps the model between them (app/scheduler.py
keeping_turn): another job waiting meanwhile goes only after it has ended, while interactive work still goes between
its steps. Before, four parallel streams ran interleaved step by step, each at a quarter of its ETA's speed, until
three ran out of generate_timeout_s with 0 tokens (issue 53 §4). Real threads against the real scheduler; a step is
a short sleep, with a longer gap between steps (where another job used to take the model)."""
from __future__ import annotations

import threading
import time

from app.context import RequestContext
from app.jobs import Job
from app.runtime import Runtime
from app.settings import Settings

STEPS = 12


def _job(client: str) -> Job:
    return Job(what="test", client=client, deadline=time.monotonic() + 60, emit=lambda event: None)


def _stream(runtime: Runtime, ctx: RequestContext, order: list[str], first_turn: threading.Event,
            go: threading.Event, keep: bool) -> None:
    """STEPS job turns with a gap after each, inside keeping_turn when `keep`; after its first step it waits (in
    its gap, the model free) until the others have asked for the model."""
    def steps() -> None:
        for i in range(STEPS):
            with runtime.admitted(False, ctx):
                order.append(f"s{i}")
                time.sleep(0.005)
            first_turn.set()
            assert go.wait(30)
            time.sleep(0.01)  # the stream's own work between steps: emit, encode, check the deadline

    if keep:
        with runtime.scheduler.keeping_turn(ctx):
            steps()
    else:
        steps()


def _run(keep: bool) -> list[str]:
    runtime = Runtime(Settings(default_models=[], request_timeout_s=30, job_timeout_s=60))
    order: list[str] = []
    first_turn, go = threading.Event(), threading.Event()
    stream = threading.Thread(target=_stream, args=(runtime, RequestContext(client="a", job=_job("a")), order,
                                                    first_turn, go, keep))
    stream.start()
    assert first_turn.wait(30)

    def other(name: str, ctx: RequestContext, interactive: bool | None) -> None:
        with runtime.admitted(interactive, ctx):
            order.append(name)

    waiting = [threading.Thread(target=other, args=("job-b", RequestContext(client="b", job=_job("b")), None)),
               threading.Thread(target=other, args=("view-c", RequestContext(client="c"), True))]
    started: list[str] = []
    for thread, name in zip(waiting, ("job-b", "view-c")):
        thread.start()
        started.append(name)
        end = time.monotonic() + 30
        # each one started has run, or waits for the model
        while runtime.scheduler.waiting < sum(n not in order for n in started) or (
                name not in order and not runtime.scheduler.waiting):
            assert time.monotonic() < end
            time.sleep(0.005)
    go.set()
    for thread in [stream, *waiting]:
        thread.join(30)
    assert not any(t.is_alive() for t in [stream, *waiting])
    return order


def test_a_stream_keeps_the_model_between_its_steps_but_not_from_interactive_work():
    order = _run(keep=True)
    assert order.index("job-b") == len(order) - 1, order  # the other job only after the stream's last step
    assert order.index("view-c") < order.index(f"s{STEPS - 1}"), order  # a view still went between its steps


def test_without_keeping_the_turn_another_job_takes_the_model_between_steps():
    """The control: the same stream without keeping_turn is overtaken (so the test above can fail)."""
    order = _run(keep=False)
    assert order.index("job-b") < order.index(f"s{STEPS - 1}"), order
