"""One running job per client across replicas, by Redis (app/fleetjobs.py; issue 36 §3), on Debian's redis-server:
two job boards (app/jobs.py JobBoard, as two replicas hold them) sharing one Redis. A client's jobs on both run one at
a time in their arrival order, each told its place; one over the client's cap on the fleet is refused; the lease of a
replica that died (it stops renewing) expires within job_lease_ttl_s and the next job runs. The whole-fleet test with
real replicas and nginx is tests/ops/test_fleet.py::test_one_client_runs_one_job_at_a_time_across_replicas_by_redis."""
from __future__ import annotations

import threading
import time
import types

import pytest

from app.errors import ClientLimit, Overloaded
from app.fleet import Registry
from app.fleetjobs import FleetJobTurns
from app.jobs import Job, JobBoard
from tests.faults.conftest import free_port
from tests.ops.fleet import require_tools
from tests.ops.test_replicas import Redis


@pytest.fixture
def redis_settings(tmp_path):
    require_tools()
    server = Redis(free_port(), tmp_path / "redis.log")
    server.start()
    try:
        yield types.SimpleNamespace(job_lease_ttl_s=1.5, redis_url=f"redis://127.0.0.1:{server.port}/0",
                                    redis_timeout_s=0.5)
    finally:
        server.stop()


def _replica(settings) -> JobBoard:
    board = JobBoard()
    board.fleet = FleetJobTurns(settings, left_of=board.left_s)
    return board


def _job(name: str, events: list, client: str = "c") -> Job:
    return Job(what="POST /api/text/attention", client=client, deadline=time.monotonic() + 60, job_id=name,
               emit=lambda event: events.append((name, event)))


def test_a_clients_jobs_on_two_replicas_run_one_at_a_time(redis_settings):
    boards = [_replica(redis_settings), _replica(redis_settings)]
    events: list = []
    running: list[tuple[str, float, float]] = []

    registered = [threading.Event() for _ in range(4)]
    all_accepted = threading.Event()

    def run(i: int) -> None:
        board, job = boards[i % 2], _job(f"job{i}", events)
        board.register(job, 4)
        registered[i].set()
        board.accept(job, 0.3, 1)  # tells the job its place, then waits for its turn
        started = time.monotonic()
        # the work lasts until every job has been told its place: on a loaded machine a job that ended before a later
        # one arrived would make that one's place smaller (seen under 3 xdist workers at load 5)
        all_accepted.wait(timeout=10)
        time.sleep(0.3)  # the job's work
        running.append((job.job_id, started, time.monotonic()))
        board.finish(job)

    threads = []
    for i in range(4):
        threads.append(threading.Thread(target=run, args=(i,)))
        threads[-1].start()
        assert registered[i].wait(timeout=10)  # arrival order: job0 … job3
    deadline = time.monotonic() + 10
    while sum(1 for _, event in events if event.get("accepted")) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    all_accepted.set()
    for thread in threads:
        thread.join(timeout=30)
    assert [name for name, *_ in sorted(running, key=lambda r: r[1])] == ["job0", "job1", "job2", "job3"]
    ordered = sorted(running, key=lambda r: r[1])
    assert all(later[1] >= earlier[2] for earlier, later in zip(ordered, ordered[1:])), ordered  # never two at once
    places = {name: event["queue_position"] for name, event in events if event.get("accepted")}
    assert places == {"job0": 0, "job1": 1, "job2": 2, "job3": 3}  # each told the client's jobs ahead, fleet-wide


def test_over_the_cap_on_the_fleet_is_refused_and_a_dead_replicas_lease_expires(redis_settings):
    alive, dying = _replica(redis_settings), _replica(redis_settings)
    events: list = []
    first = _job("first", events)
    dying.register(first, 2)
    dying.accept(first, 1.0, 1)  # it holds the client's lease
    second = _job("second", events)
    alive.register(second, 2)
    with pytest.raises(Overloaded) as refused:  # two alive on the fleet: a third is over max_queued_jobs_per_client=2
        alive.register(_job("third", events), 2)
    assert "max_queued_jobs_per_client=2" in str(refused.value) and refused.value.retry_after >= 1
    assert alive.fleet.try_start("second") != True  # noqa: E712 - a list: the job ahead of it

    dying.fleet._stop.set()  # the replica dies: nothing renews its job or the lease, nothing releases them
    with dying.fleet._lock:
        dying.fleet._held.clear()
    died = time.monotonic()
    alive.accept(second, 0.1, 1)  # waits for the dead replica's lease to expire
    waited = time.monotonic() - died
    assert waited <= redis_settings.job_lease_ttl_s + 1.0, waited
    alive.finish(second)
    accepted = [event for name, event in events if name == "second" and event.get("accepted")]
    assert accepted and accepted[0]["queue_position"] == 1  # told of the job ahead of it on the other replica


def test_minted_client_ids_from_one_address_share_its_cap_over_the_fleet(redis_settings):
    """Issue 53 §6: jobs of many client ids from one address, on two replicas, count against the address's cap
    together (429, naming max_queued_jobs_per_address); another address is still served; a job's end frees its place."""
    boards = [_replica(redis_settings), _replica(redis_settings)]
    accepted, refused = [], []
    for i in range(10):
        job = _job(f"minted{i}", [], client=f"c{i}")
        job.source = "198.51.100.7"
        try:
            boards[i % 2].register(job, 4, 3)
            accepted.append(job)
        except ClientLimit as exc:
            assert "max_queued_jobs_per_address=3" in str(exc) and exc.status == 429
            refused.append(job)
    assert len(accepted) == 3 and len(refused) == 7
    other = _job("other", [], client="someone")
    other.source = "203.0.113.9"
    boards[1].register(other, 4, 3)
    assert accepted[0].job_id == "minted0"
    boards[0].finish(accepted[0])  # minted0 was registered on board 0 (i % 2)
    again = _job("again", [], client="c-new")
    again.source = "198.51.100.7"
    boards[1].register(again, 4, 3)  # the ended job's place is free fleet-wide
    for board in boards:
        board.fleet.stop()


def test_the_heartbeats_keep_a_replicas_entry_and_its_job_alive_past_their_ttl(redis_settings):
    """Both heartbeats (app/heartbeat.py start_heartbeat): the replica's registration and its jobs' renewal; nothing
    else refreshes either, so without them both are gone after their TTL (1.5 s here)."""
    settings = types.SimpleNamespace(**vars(redis_settings), replica_ttl_s=1.5)
    replica = Registry(settings, "http://127.0.0.1:1")
    replica.start()
    holder, other = _replica(settings), _replica(settings)
    first = _job("first", [])
    holder.register(first, 4)
    holder.accept(first, 0.1, 1)  # it holds the client's lease
    time.sleep(3 * settings.job_lease_ttl_s)
    assert Registry(settings, "http://127.0.0.1:2").url_of(replica.name) == "http://127.0.0.1:1"
    second = _job("second", [])
    other.register(second, 4)
    ahead = other.fleet.try_start("second")
    assert ahead is not True, "the first job's lease expired: nothing renewed it"
    assert [job.job_id for job in ahead] == ["first"]
    replica.stop()
    holder.finish(first)
    other.fleet.release("second")
    holder.fleet.stop()
    other.fleet.stop()
