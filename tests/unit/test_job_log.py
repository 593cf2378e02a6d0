"""A job's event log (app/streams.py JobLog, docs/api.md "Re-attaching to a job"): events numbered from 1 and
replayed after a number, the latest job_event_buffer of them and the done event always; a job with no stream
listening is cancelled only after job_reattach_grace_s, and a re-attach within it keeps it running."""
from __future__ import annotations

import time

import pytest

from app.lifecycle import Lifecycle
from app.streams import JobCancel, JobLog, Sent


def _log(size: int = 8, grace_s: float = 0.3) -> JobLog:
    return JobLog("abcd1234." + "0" * 32, "h:someone", "POST /api/text/attention", size, grace_s, keep_s=60)


def test_events_are_numbered_and_the_buffer_keeps_the_latest_and_the_done_event():
    log = _log(size=8)
    for done in range(1, 31):
        log.put({"progress": done, "total": 30})
    log.put({"done": True, "run_id": "r"})
    backlog, pipe = log.subscribe(after=3)
    backlog = backlog[1:]  # after the gap event (test_a_replay_past_the_kept_events_starts_with_a_gap)
    assert [sent.n for sent in backlog] == list(range(25, 33))  # the latest 8: the accepted event (1) came first
    assert backlog[-1].last and b'"run_id":"r"' in backlog[-1].data
    assert backlog[0].data.startswith(b"id: abcd1234." + b"0" * 32 + b":25\ndata: ")
    assert pipe.get(0.01) is None  # the job has ended: nothing more comes, the stream ends after the backlog
    first, _ = log.subscribe(after=0)
    assert isinstance(first[1], Sent) and first[1].n == 25  # the accepted event rolled out of the buffer


def test_a_replay_past_the_kept_events_starts_with_a_gap():
    """More than job_event_buffer events missed: the replay says so first (`event: gap`, the numbers missed and the
    first kept id) instead of silently starting further on; within the buffer, or right after the last event seen,
    there is no gap event."""
    log = _log(size=8)
    for done in range(1, 21):
        log.put({"progress": done, "total": 30})  # events 1 (accepted) … 21; 14 … 21 kept
    backlog, _ = log.subscribe(after=5)
    gap = backlog[0].data.decode()
    assert gap.startswith("event: gap\ndata: ") and "\nid:" not in gap and not gap.startswith("id:")  # no id
    assert '"gap":{"after":5,"first":14,"missed":8,"first_id":"abcd1234.' in gap
    assert [sent.n for sent in backlog[1:]] == list(range(14, 22))
    assert [sent.n for sent in log.subscribe(after=13)[0]] == list(range(14, 22))  # nothing missed: no gap
    assert log.subscribe(after=21)[0] == []
    log.put({"done": True})
    assert [sent.n for sent in log.subscribe(after=21)[0]] == [22]


def test_ended_jobs_events_are_capped_in_bytes_oldest_dropped_first():
    """job_events_max_bytes: the ended jobs' kept events stay under the cap; the jobs that ended first are dropped
    (their re-attach is a 404 that says why), a running job's events are never dropped."""
    from types import SimpleNamespace

    from app.streams import JobLogs, missing_job

    logs = JobLogs()
    answer = {"done": True, "attention": "x" * 3000}  # a done event of about 3 kB
    ended = []
    for i in range(4):
        job = JobLog(f"abcd1234.{i:032x}", "h:someone", "POST /api/text/attention", 8, 1.0, keep_s=600)
        logs.add(job, max_bytes=8000)
        job.put({"progress": 1, "total": 1})
        job.put(answer)
        ended.append(job)
        assert logs.ended_bytes() <= 8000
    running = JobLog("abcd1234." + "f" * 32, "h:someone", "POST /api/text/attention", 8, 1.0, keep_s=600)
    logs.add(running, max_bytes=8000)
    running.put({"progress": 1, "total": 2})
    found = [logs.find(job.job_id) for job in ended]
    assert [why for _, why in found] == ["dropped", "dropped", "", ""]  # two of ~3.1 kB fit under 8,000 bytes
    assert logs.find(running.job_id)[0] is running
    settings = SimpleNamespace(job_events_max_bytes=8000, result_pin_s=120)
    assert "job_events_max_bytes=8,000" in missing_job(ended[0].job_id, "dropped", settings)


def test_a_job_with_no_stream_runs_on_for_the_grace_and_a_re_attach_keeps_it():
    log = _log(grace_s=0.3)
    _, pipe = log.subscribe()
    cancel = JobCancel(None, log, pipe, Lifecycle())
    log.put({"accepted": True, "eta_s": 1.0, "queue_position": 0, "runs": 1})
    assert not cancel.is_set()
    log.unsubscribe(pipe)  # its stream dropped
    assert not cancel.is_set()  # within the grace
    time.sleep(0.15)
    backlog, again = log.subscribe(after=0)  # re-attached within it
    assert [sent.n for sent in backlog] == [1] and b'"job_id"' in backlog[0].data
    time.sleep(0.3)
    assert not cancel.is_set()  # a stream listens
    log.unsubscribe(again)
    time.sleep(0.35)
    assert cancel.is_set() and cancel.reason == "client"  # no stream for the whole grace: cancelled


def test_delete_cancels_at_once():
    log = _log(grace_s=600)
    _, pipe = log.subscribe()
    cancel = JobCancel(None, log, pipe, Lifecycle())
    assert not cancel.is_set()
    log.cancelled = True
    assert cancel.is_set()


def test_a_running_jobs_kept_events_are_capped_in_bytes_and_a_re_attach_after_a_drop_says_so():
    """Issue 53 §5: a generate with every head's attention sends ~19 MB a step and 256 were kept with no byte cap.
    job_event_buffer_bytes: the oldest go first, the last one always stays (even past the cap), and a re-attach that
    missed dropped events is told which and why (`event: gap` naming job_event_buffer_bytes), then gets the rest."""
    import json

    cap = 64 * 1024
    log = JobLog("abcd1234." + "0" * 32, "h:someone", "POST /api/text/generate", 256, 1.0, keep_s=60, max_bytes=cap)
    step = "x" * 10_000  # a step's event of about 10 kB
    for n in range(1, 41):
        log.put({"token": n, "attention": step})
        assert log.held_bytes <= cap, (n, log.held_bytes)  # bounded while the job runs, not only once it ended
    kept, _ = log.subscribe(after=2)  # a client that saw the accepted event and the first token
    gap = json.loads(kept[0].data.decode().split("data: ", 1)[1])["gap"]
    assert gap["why"] == "job_event_buffer_bytes" and gap["after"] == 2
    first = kept[1].n
    assert gap["first"] == first and gap["missed"] == first - 3 and 0 < len(kept) - 1 < 40
    assert [sent.n for sent in kept[1:]] == list(range(first, 42))  # the newest ones, none skipped after the gap
    assert log.held_bytes == sum(len(sent.data) for sent in kept[1:])
    log.put({"done": True, "everything": "y" * (2 * cap)})  # the last event alone is over the cap: kept all the same
    backlog, _ = log.subscribe(after=41)
    assert [sent.n for sent in backlog] == [42] and backlog[0].last


def test_kept_events_count_in_the_memory_budget():
    """What jobs keep of their events counts against memory_budget_bytes like kept runs: a reservation that would
    fit without them is refused once they take the room (app/memory.py keepers)."""
    from app.context import RequestContext
    from app.errors import Overloaded
    from app.memory import MemoryBudget, RequestMemory
    from app.runtime import ResultCache
    from app.streams import JobLogs

    mib = 2**20
    budget = MemoryBudget(budget_bytes=1_000 * mib, reserved_bytes=500 * mib,
                          cache=ResultCache(max_items=10, max_bytes=10_000 * mib, pin_s=60), measure_rss=False,
                          wait_s=0.2)
    logs = JobLogs()
    budget.count_kept("job events", logs.held_bytes)
    budget.count_kept("job events", logs.held_bytes)  # idempotent
    job = JobLog("abcd1234." + "1" * 32, "h:someone", "POST /api/text/generate", 256, 1.0, keep_s=60,
                 max_bytes=400 * mib)
    logs.add(job)
    for _ in range(3):
        job.put({"attention": "z" * (100 * mib)})  # 300 MiB of kept events
    assert 300 * mib <= budget.used_bytes() <= 301 * mib
    holder = RequestMemory(client="b")
    with pytest.raises(Overloaded, match="MiB by jobs' kept events"):
        budget.reserve(RequestContext(memory=holder, deadline=time.monotonic() + 0.2), 300 * mib, "text", "a run")
    budget.reserve(RequestContext(memory=holder, deadline=time.monotonic() + 5), 150 * mib, "text", "a smaller run")
    assert holder.nbytes == 150 * mib
