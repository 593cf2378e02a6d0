"""A job's event log (app/streams.py JobLog, docs/api.md "Re-attaching to a job"): events numbered from 1 and
replayed after a number, the latest job_event_buffer of them and the done event always; a job with no stream
listening is cancelled only after job_reattach_grace_s, and a re-attach within it keeps it running."""
from __future__ import annotations

import time

from app.streams import JobCancel, JobLog, Sent


def _log(size: int = 8, grace_s: float = 0.3) -> JobLog:
    return JobLog("abcd1234." + "0" * 32, "h:someone", "POST /api/text/attention", size, grace_s, keep_s=60)


def test_events_are_numbered_and_the_buffer_keeps_the_latest_and_the_done_event():
    log = _log(size=8)
    for done in range(1, 31):
        log.put({"progress": done, "total": 30})
    log.put({"done": True, "run_id": "r"})
    backlog, pipe = log.subscribe(after=3)
    assert [sent.n for sent in backlog] == list(range(25, 33))  # the latest 8: the accepted event (1) came first
    assert backlog[-1].last and b'"run_id":"r"' in backlog[-1].data
    assert backlog[0].data.startswith(b"id: abcd1234." + b"0" * 32 + b":25\ndata: ")
    assert pipe.get(0.01) is None  # the job has ended: nothing more comes, the stream ends after the backlog
    first, _ = log.subscribe(after=0)
    assert isinstance(first[0], Sent) and first[0].n == 25  # the accepted event rolled out of the buffer


def test_a_job_with_no_stream_runs_on_for_the_grace_and_a_re_attach_keeps_it():
    log = _log(grace_s=0.3)
    _, pipe = log.subscribe()
    cancel = JobCancel(None, log, pipe)
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
    cancel = JobCancel(None, log, pipe)
    assert not cancel.is_set()
    log.cancelled = True
    assert cancel.is_set()
