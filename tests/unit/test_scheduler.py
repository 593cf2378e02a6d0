"""The model's turns (app/scheduler.py): turns go round the clients rather than first come, first served, a started
job keeps its turn, and interactive work still goes first. Real threads against the real scheduler; the model work
is a short sleep."""
from __future__ import annotations

import threading
import time

from app.context import RequestContext
from app.jobs import Job
from app.runtime import Runtime
from app.settings import Settings


def _runtime() -> Runtime:
    return Runtime(Settings(default_models=[], request_timeout_s=30))


def _queue_and_release(runtime: Runtime, work: list[tuple[str, str, Job | None]]) -> list[str]:
    """Hold the model, queue `work` as (name, client, job) one after another, then let go: the order they ran in."""
    scheduler = runtime.scheduler
    order: list[str] = []
    scheduler._run_lock.acquire()  # something holds the model

    def wait(name: str, client: str, job: Job | None) -> None:
        with runtime.admitted(ctx=RequestContext(client=client, job=job)):
            order.append(name)
            time.sleep(0.01)

    threads = []
    for i, (name, client, job) in enumerate(work):
        thread = threading.Thread(target=wait, args=(name, client, job))
        thread.start()
        threads.append(thread)
        while len(scheduler._fifo) < i + 1:
            time.sleep(0.005)
    scheduler._run_lock.release()
    with scheduler._turns:
        scheduler._turns.notify_all()
    for thread in threads:
        thread.join(10)
    return order


def _job(client: str) -> Job:
    return Job(what="test", client=client, deadline=time.monotonic() + 30, emit=lambda event: None)


def test_turns_go_round_the_clients_for_interactive_work():
    # a sent three requests before b sent one: b's goes second, not last
    order = _queue_and_release(_runtime(), [("a1", "a", None), ("a2", "a", None), ("a3", "a", None), ("b1", "b", None)])
    assert order == ["a1", "b1", "a2", "a3"]


def test_turns_go_round_the_clients_for_jobs():
    work = [(f"a{i}", "a", _job("a")) for i in range(1, 4)] + [("b1", "b", _job("b")), ("c1", "c", _job("c"))]
    order = _queue_and_release(_runtime(), work)
    assert order == ["a1", "b1", "c1", "a2", "a3"]


def test_one_clients_requests_keep_their_arrival_order():
    order = _queue_and_release(_runtime(), [(f"r{i}", "a", None) for i in range(5)])
    assert order == [f"r{i}" for i in range(5)]


def test_a_started_job_goes_before_jobs_that_have_not_started():
    runtime = _runtime()
    started = _job("a")
    started.started = True  # it ran a first run already (a compare's second run waits now)
    order = _queue_and_release(runtime, [("b1", "b", _job("b")), ("a-second-run", "a", started)])
    assert order == ["a-second-run", "b1"]


def test_interactive_work_still_goes_before_jobs():
    order = _queue_and_release(_runtime(), [("job", "a", _job("a")), ("view", "b", None)])
    assert order == ["view", "job"]


def test_a_full_queue_is_refused_at_once():
    from app.errors import Overloaded

    runtime = Runtime(Settings(default_models=[], request_timeout_s=30, queue_depth=1))
    scheduler = runtime.scheduler
    scheduler._run_lock.acquire()
    waiter = threading.Thread(target=lambda: runtime.admitted().__enter__())
    try:
        waiter.start()
        while scheduler.waiting < 1:
            time.sleep(0.005)
        started = time.monotonic()
        try:
            with runtime.admitted():
                raise AssertionError("admitted past queue_depth")
        except Overloaded as exc:
            assert "queue_depth" in str(exc) and time.monotonic() - started < 1.0
    finally:
        scheduler._run_lock.release()
        with scheduler._turns:
            scheduler._turns.notify_all()
        waiter.join(5)


def test_a_turn_that_no_longer_fits_names_the_limit_that_applies():
    """At its first turn, work whose estimate no longer fits before its deadline is refused naming its own limit: a
    job's job_timeout_s (it once said request_timeout_s=60 s for a streamed compare refused after 207 s of queue)."""
    from app.errors import Overloaded

    runtime = Runtime(Settings(default_models=[], request_timeout_s=30, job_timeout_s=900))
    for job, setting in ((_job("a"), "job_timeout_s=900 s"), (None, "request_timeout_s=30 s")):
        ctx = RequestContext(client="a", job=job, deadline=time.monotonic() + 5, estimate_s=50.0)
        try:
            with runtime.admitted(ctx=ctx):
                raise AssertionError("admitted with 50 s of work and 5 s left")
        except Overloaded as exc:
            assert setting in str(exc) and "are left after its wait in the queue" in str(exc), str(exc)
