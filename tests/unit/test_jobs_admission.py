"""Jobs and the budget (docs/api.md "Jobs"), piece by piece: the fair model lock (interactive work goes before jobs and
a job hands the lock over between layers), one running job per client, pinned results, the memory accountant and the
measured throughput."""
from __future__ import annotations

import threading
import time

import pytest
from fastapi import HTTPException

from app.costs import Throughput
from app.jobs import Job, JobBoard
from app.context import RequestContext
from app.memory import MemoryBudget, RequestMemory
from app.openmp_teams import TeamStats
from app.runtime import ResultCache, Runtime
from app.settings import Settings
from models.hooks import _layer_listener


class _Result:
    """What ResultCache reads of a result: its bytes, the device part and its run id."""

    def __init__(self, host: int, run_id: str):
        self.nbytes, self.device_nbytes, self.run_id = host, 0, run_id
        self.host_and_device_nbytes = (host, 0)


def _runtime() -> Runtime:
    return Runtime(Settings(default_models=[], request_timeout_s=30))


def _job(client: str = "c1") -> Job:
    return Job(what="test", client=client, deadline=time.monotonic() + 30, emit=lambda event: None)


def test_a_running_job_hands_the_model_to_interactive_work_between_layers():
    runtime = _runtime()
    layers_done: list[float] = []
    job_started = threading.Event()

    def job_forward() -> None:
        with runtime.admitted(ctx=RequestContext(job=_job())):
            job_started.set()
            listener = _layer_listener.get()  # what the engine calls after each attention layer
            for layer in range(20):
                time.sleep(0.05)  # a layer's work
                listener(layer, 20)
                layers_done.append(time.monotonic())

    worker = threading.Thread(target=job_forward)
    worker.start()
    job_started.wait(5)
    time.sleep(0.12)
    asked = time.monotonic()
    with runtime.admitted():  # interactive (no job in this thread's context)
        got = time.monotonic()
        during = len(layers_done)
    worker.join(10)
    assert during < 20, "the short request waited for the whole job"
    assert got - asked < 0.5, f"waited {got - asked:.2f} s: more than about one layer"
    assert runtime.yields >= 1 and len(layers_done) == 20  # the job finished all its layers after handing over


def test_a_job_ends_its_openmp_team_as_it_hands_over():
    """The interactive forward then runs beside no other team (app/openmp_teams.py; the threads themselves are
    counted in tests/unit/test_openmp_teams.py). A job that hands nothing over keeps its team."""
    runtime = _runtime()
    seen_by_interactive: list[int] = []

    def interactive() -> None:
        with runtime.admitted():
            seen_by_interactive.append(TeamStats.released)

    def job_forward(layers: int, ask_at: int | None) -> None:
        with runtime.admitted(ctx=RequestContext(job=_job())):
            listener = _layer_listener.get()
            for layer in range(layers):
                time.sleep(0.02)  # a layer's work
                if layer == ask_at:
                    threading.Thread(target=interactive).start()
                    deadline = time.monotonic() + 10
                    while runtime.waiting == 0:  # until the interactive request waits for the model
                        assert time.monotonic() < deadline, "the interactive request never waited"
                        time.sleep(0.005)
                listener(layer, layers)

    before = TeamStats.released
    job_forward(5, ask_at=None)
    assert TeamStats.released == before and runtime.yields == 0
    job_forward(6, ask_at=2)
    assert runtime.yields == 1
    assert seen_by_interactive == [before + 1]  # ended before the interactive work got the model


def test_waiting_interactive_work_goes_before_waiting_jobs():
    runtime = _runtime()
    order: list[str] = []
    runtime.scheduler._run_lock.acquire()  # something holds the model

    def wait(name: str, job: Job | None) -> None:
        with runtime.admitted(ctx=RequestContext(job=job)):
            order.append(name)

    job_thread = threading.Thread(target=wait, args=("job", _job()))
    job_thread.start()
    while not runtime.scheduler._fifo:
        time.sleep(0.01)
    short_thread = threading.Thread(target=wait, args=("short", None))
    short_thread.start()
    while len(runtime.scheduler._fifo) < 2:
        time.sleep(0.01)
    runtime.scheduler._run_lock.release()
    with runtime.scheduler._turns:
        runtime.scheduler._turns.notify_all()
    job_thread.join(5)
    short_thread.join(5)
    assert order == ["short", "job"]


def test_one_running_job_per_client_and_others_go_on():
    board = JobBoard()
    events: list[dict] = []
    first = Job(what="a", client="x", deadline=time.monotonic() + 30, emit=events.append)
    board.accept(first, estimate_s=10.0, runs=1)
    assert events[-1] == {"accepted": True, "eta_s": 10.0, "queue_position": 0, "runs": 1}
    started: dict[str, float] = {}

    def second_of(client: str) -> None:
        job = Job(what="b", client=client, deadline=time.monotonic() + 30, emit=events.append)
        board.accept(job, estimate_s=5.0, runs=2)  # returns when the job may start
        started[client] = time.monotonic()

    same = threading.Thread(target=second_of, args=("x",))
    other = threading.Thread(target=second_of, args=("y",))
    same.start()
    other.start()
    other.join(5)
    assert "y" in started and "x" not in started  # another client's job is not held back by x's
    queued = [e for e in events[1:] if e["runs"] == 2]
    assert all(e["queue_position"] >= 1 and e["eta_s"] >= 14.0 for e in queued)  # behind the first: its ETA too
    time.sleep(0.3)
    assert "x" not in started
    finished = time.monotonic()
    board.finish(first)
    same.join(5)
    assert started["x"] >= finished


def test_a_pinned_result_stays_until_its_pin_ends():
    cache = ResultCache(max_items=1, max_bytes=100, pin_s=0.4)
    cache.put(("a",), _Result(60, "a"), "client-1")
    cache.put(("b",), _Result(60, "b"), "client-1")  # over both bounds, but "a" is pinned: both are kept
    assert cache.by_run_id("a") is not None and cache.by_run_id("b") is not None
    time.sleep(0.5)
    cache.put(("c",), _Result(10, "c"), "client-2")  # pins over: the least recently used go
    assert cache.by_run_id("c") is not None
    assert cache.by_run_id("a") is None and cache.by_run_id("b") is None


def test_reading_a_run_renews_its_pin():
    cache = ResultCache(max_items=1, max_bytes=100, pin_s=0.5)
    cache.put(("a",), _Result(60, "a"))
    time.sleep(0.3)
    assert cache.by_run_id("a") is not None  # a window of the run: pinned again for 0.5 s
    time.sleep(0.3)
    cache.put(("b",), _Result(60, "b"))
    assert cache.by_run_id("a") is not None


def test_making_room_takes_unpinned_then_the_clients_own_runs_never_anothers():
    cache = ResultCache(max_items=10, max_bytes=1000, pin_s=60)
    cache.put(("mine",), _Result(100, "mine"), "me")
    cache.put(("theirs",), _Result(100, "theirs"), "them")
    cache.pin_s = 0
    cache.put(("loose",), _Result(100, "loose"), "them")
    assert cache.evict_for(100, "me") == 100 and cache.by_run_id("loose") is None  # the unpinned one first
    assert cache.evict_for(300, "me") == 100  # then my own pinned run, never theirs
    assert cache.by_run_id("mine") is None and cache.by_run_id("theirs") is not None


def test_the_accountant_waits_for_room_and_refuses_what_never_fits():
    unit = 2**20  # MiB: reservations over SMALL_BYTES (64 MiB) wait for room
    cache = ResultCache(max_items=10, max_bytes=10_000 * unit, pin_s=60)
    budget = MemoryBudget(budget_bytes=1_500 * unit, reserved_bytes=500 * unit, cache=cache, measure_rss=False)
    cache.put(("kept",), _Result(300 * unit, "kept"), "someone")  # pinned by another client
    with pytest.raises(HTTPException) as refused:
        budget.check_fits(1_001 * unit, "text", "one run")
    assert refused.value.status_code == 413 and refused.value.detail.startswith("text:")

    first = RequestMemory(client="a")
    budget.reserve(RequestContext(memory=first), 600 * unit, "text", "one run")  # 300 kept + 600 ≤ 1,000
    assert budget.in_flight_bytes == 600 * unit

    granted = threading.Event()

    def second() -> None:
        later = RequestContext(memory=RequestMemory(client="b"), deadline=time.monotonic() + 10)
        budget.reserve(later, 400 * unit, "text", "another run")  # 300 + 600 + 400 > 1,000: waits
        granted.set()

    threading.Thread(target=second, daemon=True).start()
    assert not granted.wait(0.4)
    small = RequestMemory(client="c")
    short = RequestContext(memory=small, deadline=time.monotonic() + 0.2)
    budget.reserve(short, 8 * unit, "text", "a short view")  # small: booked at once, no wait
    assert small.nbytes == 8 * unit
    budget.release(small)
    budget.release(first)
    assert granted.wait(5)
    assert cache.by_run_id("kept") is not None  # room came from the release, not from another client's pinned run


def test_memory_the_books_miss_is_counted_from_rss():
    """What the allocator keeps after runs are freed shows in RSS, not in the books: a request that fits the books but
    not the process's real memory waits (here until its deadline: 503)."""
    from app.memory import process_rss
    from app.runtime import Overloaded

    cache = ResultCache(max_items=10, max_bytes=10_000)
    rss = process_rss()
    assert rss > 0
    # the books: nothing kept, nothing in flight, 100 MB reserved; the process's RSS is far above that
    budget = MemoryBudget(budget_bytes=rss + 50 * 2**20, reserved_bytes=100 * 2**20, cache=cache)
    with pytest.raises(Overloaded):
        budget.reserve(RequestContext(memory=RequestMemory(client="a"), deadline=time.monotonic() + 0.5),
                       100 * 2**20, "text", "one run")
    books_only = MemoryBudget(budget_bytes=rss + 50 * 2**20, reserved_bytes=100 * 2**20, cache=cache,
                              measure_rss=False)
    books_only.reserve(RequestContext(memory=RequestMemory(client="a"), deadline=time.monotonic() + 0.5),
                       100 * 2**20, "text", "one run")  # the books alone admit it


def test_the_throughput_fit_is_not_made_slow_by_short_runs():
    """Short runs are mostly per-call overhead: with the old average of per-run rates, a few of them made a long
    input's estimate several times too long."""
    model, overhead, rate = "m", 0.15, 30e9
    fit = Throughput()
    for macs in (1e10, 2e10, 5e10, 1e10, 3e11, 1e10):  # seconds = overhead + macs / rate
        fit.observe(model, macs, overhead + macs / rate)
    seconds, measured = fit.seconds(model, 7e11, 1.0)
    assert measured and seconds == pytest.approx(overhead + 7e11 / rate, rel=0.02)
    # the same runs on a machine where the process had half the CPU: normalised to an idle machine
    loaded = Throughput()
    for macs in (1e10, 3e11):
        loaded.observe(model, macs, 2 * (overhead + macs / rate), share=0.5)
    assert loaded.seconds(model, 7e11, 1.0)[0] == pytest.approx(overhead + 7e11 / rate, rel=0.02)


def test_the_load_correction_follows_the_load_the_last_runs_met():
    """The CPU share says 0.5 throughout (two busy processes): the start-up timing was not slowed by it, short views
    on one thread 1.5x, then a scan 4x (two threads on cores the busy processes also want): the same scan's next
    estimate is about its real time. Before, the slowdown was a running mean of each run against the fit of its
    moment while the fit itself also moved toward the slow run: the load was counted twice (2.36x the real time)."""
    model, overhead, rate = "m", 0.05, 30e9
    fit = Throughput()
    for macs in (2e10, 1e11):  # the start-up timing
        fit.observe(model, macs, overhead + macs / rate, share=0.5)
    for _ in range(2):  # short views on one thread: 1.5x
        fit.observe(model, 2e9, 1.5 * (overhead + 2e9 / rate), share=0.5)
    scan = 3.3e11
    real = 4 * (overhead + scan / rate)
    fit.observe(model, scan, real, share=0.5)
    estimate = fit.seconds(model, scan, 1.0)[0] * fit.slowdown(model)
    assert 0.75 <= estimate / real <= 1.33, estimate / real


def test_a_work_clock_times_the_turns_not_the_waits_for_them():
    """A scan's batches, each in a model turn of its own: the clock counts the time inside the turns (the model's
    time), not the wait for each turn, and the whole scan is learnt from as one run."""
    import contextlib
    from types import SimpleNamespace

    from app.costs import CostMeasures, WorkClock

    @contextlib.contextmanager
    def turn():
        time.sleep(0.3)  # waiting for the model behind other work
        yield

    adapter = SimpleNamespace(info=SimpleNamespace(id="work-clock-test"), device=None)
    measures = CostMeasures()
    clock = WorkClock(adapter, measures)
    for _ in range(2):
        with clock.step(turn()):
            time.sleep(0.15)  # the batch's forward
    assert 0.29 <= clock.seconds < 0.5, clock.seconds
    assert measures.throughput.seconds("work-clock-test", 1e9, 1.0)[1] is False
    clock.observe(1e9)
    seconds, measured = measures.throughput.seconds("work-clock-test", 1e9, 1.0)
    assert measured and seconds == pytest.approx(clock.idle_s, rel=1e-6)
    assert measures.throughput.slowdown("work-clock-test") == pytest.approx(clock.seconds / clock.idle_s, rel=1e-6)


def test_no_more_torch_threads_than_the_cores_other_processes_leave_free():
    """With every core kept busy by other processes, one thread: a second one waits for a core at every parallel
    region (a 151-token forward 8 s on one thread, 69-87 s on two, beside busy processes on 2 cores)."""
    import multiprocessing

    import torch

    from app.costs import CPU_SHARE, CpuShare

    share, runtime = CpuShare(), _runtime()
    threads = torch.get_num_threads()
    busy = [multiprocessing.Process(target=_spin, args=(time.time() + 6,), daemon=True) for _ in range(share.cores)]
    for process in busy:
        process.start()
    try:
        time.sleep(1.5)
        CPU_SHARE.now()  # the process's own measure starts a new interval here (its smoothed value may be old)
        time.sleep(1.0)
        assert share.threads_for(share.cores) == 1
        with runtime._threads_for(4000):  # a long input, that ran on every thread whatever the load
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == threads
    finally:
        for process in busy:
            process.terminate()


def test_the_busy_cores_are_the_fewer_of_the_last_seconds_and_now():
    """Other processes that kept the cores busy over the last seconds but are asleep now leave them free; busy over
    the last seconds and runnable now, they keep them (one thread). Before, the last seconds alone decided."""
    from app.costs import threads_worth_running

    assert threads_worth_running(2, 2, 1.8, 0) == 2  # busy a moment ago (a client's own forward), asleep now
    assert threads_worth_running(2, 2, 1.8, 2) == 1 and threads_worth_running(2, 2, 1.8, 1) == 1
    assert threads_worth_running(2, 2, 0.0, 3) == 2  # never fewer threads than the smoothed measure gives
    assert threads_worth_running(2, 2, 1.8, None) == 1  # without /proc: the smoothed measure alone
    assert threads_worth_running(4, 8, 3.0, 1) == 4 and threads_worth_running(8, 8, 3.0, 2) == 6


def test_processes_busy_a_moment_ago_but_asleep_now_leave_their_cores_free():
    """The smoothed measure still counts processes that kept every core busy a moment ago; once they sleep (stopped
    here, like a client waiting for the response) the run gets every core, and one thread again when they run. Before,
    a benchmark's or a browser's busy moment made the next view run on one thread (1.4x a raw forward)."""
    import multiprocessing
    import os
    import signal

    from app.costs import CpuShare

    share = CpuShare()
    share.MIN_INTERVAL_S = 3600.0  # the smoothed measure stays the busy interval's for the rest of the test
    busy = [multiprocessing.Process(target=_spin, args=(time.time() + 60,), daemon=True) for _ in range(share.cores)]
    for process in busy:
        process.start()
    try:
        time.sleep(1.5)
        share.MIN_INTERVAL_S = 1.0
        assert share.threads_for(share.cores) == 1  # busy now, and over the last 1.5 s
        share.MIN_INTERVAL_S = 3600.0
        for process in busy:
            os.kill(process.pid, signal.SIGSTOP)
        deadline, threads, idle_instants = time.monotonic() + 10, 1, 0
        while threads != share.cores and time.monotonic() < deadline:  # an instant when no one else is runnable
            idle_instants += share.runnable_others() == 0
            threads = share.threads_for(share.cores)
            time.sleep(0.001)
        if threads != share.cores and idle_instants < 20:
            pytest.skip(f"other processes' threads were runnable at all but {idle_instants} instants in 10 s: "
                        "no core was free now to give")
        assert threads == share.cores, idle_instants
        for process in busy:
            os.kill(process.pid, signal.SIGCONT)
        time.sleep(0.05)
        assert share.threads_for(share.cores) == 1
    finally:
        for process in busy:
            process.kill()


def _spin(stop_at: float) -> None:
    while time.time() < stop_at:
        pass


def test_a_given_rate_is_taken_as_it_is():
    fit = Throughput()
    fit.set_rate("m", 1e9)
    assert fit.seconds("m", 2e9, 5.0) == (2.0, False)  # no load correction for a rate that was not measured
    assert fit.seconds("other", 10.0, 5.0) == (2.0, False)
