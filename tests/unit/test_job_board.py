"""The job board and the memory accountant's order (issue 36 §3, §5; issue 37 §6; issue 38 §4): a cap per client, a
job refused at once when its ETA is over what is left of its time, queue positions that count jobs from their
arrival, ETAs from a job's own rate, and memory granted first come, first served, or refused at once."""
from __future__ import annotations

import threading
import time

import pytest

from app.errors import ClientLimit, Overloaded
from app.jobs import Job, JobBoard
from app.context import RequestContext
from app.memory import MemoryBudget, RequestMemory
from app.runtime import ResultCache


def _job(client: str, events: list | None = None, deadline_s: float = 100.0) -> Job:
    return Job(what="POST /api/text/attention", client=client, deadline=time.monotonic() + deadline_s,
               emit=(events.append if events is not None else lambda event: None))


def test_a_client_over_its_cap_is_refused_at_once_naming_the_setting():
    board = JobBoard()
    for _ in range(2):
        board.register(_job("a"), max_per_client=2)
    with pytest.raises(Overloaded) as refused:
        board.register(_job("a"), max_per_client=2)
    assert "max_queued_jobs_per_client=2" in str(refused.value) and refused.value.retry_after >= 1
    assert refused.value.status == 429  # about the client, not the replica: nginx must not take the replica out
    board.register(_job("b"), max_per_client=2)  # another client is not locked out
    assert len(board) == 3


def test_forty_client_ids_from_one_address_get_that_addresss_cap():
    """Issue 53 §6: a new X-Attnlab-Client value is a new client, free to mint; the address's cap holds them all."""
    board = JobBoard()
    outcomes = []
    for i in range(40):
        job = _job(f"minted-{i}")
        job.source = "198.51.100.7"
        try:
            board.register(job, max_per_client=4, max_per_source=5)
            outcomes.append("accepted")
        except ClientLimit as exc:
            assert "max_queued_jobs_per_address=5" in str(exc) and "198.51.100.7" in str(exc) and exc.retry_after >= 1
            outcomes.append("refused")
    assert outcomes.count("accepted") == 5 and outcomes[:5] == ["accepted"] * 5
    other = _job("someone-else")
    other.source = "203.0.113.9"
    board.register(other, max_per_client=4, max_per_source=5)  # another address is still served
    assert len(board) == 6


def test_the_replicas_cap_on_all_jobs_is_a_503_not_a_client_limit():
    board = JobBoard()
    for i in range(3):
        board.register(_job(f"c{i}"), max_per_client=4, max_total=3)
    with pytest.raises(Overloaded) as refused:
        board.register(_job("c9"), max_per_client=4, max_total=3)
    assert not isinstance(refused.value, ClientLimit) and refused.value.status == 503
    assert "max_queued_jobs=3" in str(refused.value)


def test_a_job_whose_eta_is_over_what_is_left_of_its_time_is_refused():
    board = JobBoard()
    first = _job("a")
    board.accept(first, estimate_s=60.0, runs=1)
    late = _job("b")
    board.register(late)
    with pytest.raises(Overloaded) as refused:
        board.accept(late, estimate_s=50.0, runs=1)  # 60 s ahead + 50 s > 100 s
    assert "job_timeout_s" in str(refused.value)
    assert [j["what"] for j in board.snapshot()] == ["POST /api/text/attention"]  # the refused job left the board
    fits = _job("c")
    board.accept(fits, estimate_s=30.0, runs=1)  # 60 + 30 ≤ 100
    assert len(board) == 2


def test_a_second_job_of_a_client_counts_the_first_from_its_arrival():
    """The second job, accepted before the first (its cost check was quicker), is still second: queue position 1
    and on /api/jobs both are listed."""
    board = JobBoard()
    first, events = _job("a"), []
    board.register(first)
    second = _job("a", events)
    board.register(second)
    waiter = threading.Thread(target=board.accept, args=(second, 5.0, 1), daemon=True)
    waiter.start()  # accepted, then waits for the first job to end
    deadline = time.monotonic() + 5
    while not events and time.monotonic() < deadline:
        time.sleep(0.01)
    assert events and events[0]["queue_position"] == 1, events
    assert [j["state"] for j in board.snapshot()] == ["arriving", "queued"]
    board.finish(first)
    waiter.join(5)
    assert not waiter.is_alive()


def test_the_eta_includes_the_clients_earlier_job():
    board = JobBoard()
    first, events = _job("a"), []
    board.accept(first, estimate_s=20.0, runs=1)
    second = _job("a", events)
    threading.Thread(target=board.accept, args=(second, 5.0, 1), daemon=True).start()
    deadline = time.monotonic() + 5
    while not events and time.monotonic() < deadline:
        time.sleep(0.01)
    assert events[0]["queue_position"] == 1 and events[0]["eta_s"] >= 24.0, events
    board.finish(first)


def test_another_clients_first_job_is_not_behind_every_job_of_a_busy_client():
    board = JobBoard()
    busy = [_job("a", deadline_s=1000) for _ in range(5)]
    for job in busy:
        board.register(job)
    busy[0].accepted_at, busy[0].estimate_s, busy[0].started = time.monotonic(), 10.0, True
    for job in busy[1:]:
        job.accepted_at, job.estimate_s = time.monotonic(), 10.0
    events: list = []
    newcomer = _job("b", events, deadline_s=1000)
    board.accept(newcomer, estimate_s=10.0, runs=1)
    assert events[0]["queue_position"] == 1 and events[0]["eta_s"] <= 21.0, events  # only a's running job ahead


def test_the_remaining_time_follows_the_jobs_own_rate():
    job = _job("a")
    job.accepted_at = time.monotonic() - 12
    job.estimate_s = 100.0  # the estimate was pessimistic: half the work took 10 s
    job.started_at = time.monotonic() - 10
    eta = job.progressed(50, 100, time.monotonic())
    assert 9.0 <= eta <= 11.0, eta


def test_a_total_is_fixed_in_the_accepted_event():
    board, events = JobBoard(), []
    job = _job("a", events)
    job.layer_progress = True
    board.accept(job, estimate_s=3.0, runs=2, layers=30)
    assert events[0]["total"] == 60 and job.total == 60


# ---- memory -------------------------------------------------------------------------------------------------------
UNIT = 2**20


def _budget() -> MemoryBudget:
    cache = ResultCache(max_items=10, max_bytes=10_000 * UNIT, pin_s=60)
    return MemoryBudget(budget_bytes=1_500 * UNIT, reserved_bytes=500 * UNIT, cache=cache, measure_rss=False,
                        wait_s=30)


def _reserve_in_thread(budget: MemoryBudget, holder: RequestMemory, nbytes: int, granted: list, name: str,
                       deadline_s: float = 20.0) -> threading.Thread:
    def run() -> None:
        try:
            budget.reserve(RequestContext(memory=holder, deadline=time.monotonic() + deadline_s), nbytes, "text", name)
            granted.append(name)
        except Overloaded as exc:
            granted.append(f"{name}: {exc}")

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_memory_is_granted_in_arrival_order():
    """b waits for 400 MiB; c, later, asks for 300 MiB that would fit now: it waits behind b instead of taking
    the room b is waiting for."""
    budget = _budget()
    first = RequestMemory(client="a")
    budget.reserve(RequestContext(memory=first), 600 * UNIT, "text", "a's run")
    granted: list[str] = []
    b = _reserve_in_thread(budget, RequestMemory(client="b"), 500 * UNIT, granted, "b")
    time.sleep(0.3)
    c = _reserve_in_thread(budget, RequestMemory(client="c"), 300 * UNIT, granted, "c")
    time.sleep(0.5)
    assert granted == [], granted  # c did not overtake b
    budget.release(first)
    b.join(5)
    time.sleep(0.3)
    assert granted[0] == "b", granted


def test_memory_that_cannot_free_up_in_time_is_refused_at_once_with_the_reason():
    budget = _budget()
    holder = RequestMemory(client="a")
    budget.reserve(RequestContext(memory=holder), 900 * UNIT, "text", "a long compare", expected_s=600.0)  # for 10 min
    granted: list[str] = []
    asked = time.monotonic()
    _reserve_in_thread(budget, RequestMemory(client="b"), 400 * UNIT, granted, "b's compare", deadline_s=20).join(15)
    assert granted and "memory_wait_s" in granted[0] and "MiB held by 1 requests in flight" in granted[0], granted
    assert time.monotonic() - asked < 5.0, "refused at its deadline, not at once"
