"""The model's queue and a request's time: bounded queue (503 + Retry-After), the per-request time limit over
every wait, turns in arrival order, the event-loop admission gate, a queued request whose client left, a request whose
estimated work no longer fits when its turn comes."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from app.runtime import Overloaded, Runtime, request_deadline
from app.settings import Settings
from tests.api.helpers import make_settings, post_text, run_async, wait_until


def test_default_queue_depth_is_at_least_32():
    assert Settings().queue_depth >= 32


@pytest.mark.parametrize("limited_client", [{"queue_depth": 1, "request_timeout_s": 120}], indirect=True)
def test_queue_full_answers_503_with_retry_after(limited_client):
    runtime = limited_client.app.state.runtime
    runtime.scheduler._run_lock.acquire()  # a long forward is running
    try:
        with ThreadPoolExecutor(1) as pool:
            queued = pool.submit(post_text, limited_client, "the cat sat on the mat")
            wait_until(lambda: runtime.waiting == 1, "first request queued")
            refused = post_text(limited_client, "the dog sat on the rug")
            assert refused.status_code == 503
            assert int(refused.headers["Retry-After"]) >= 1
            assert "queue_depth" in refused.json()["detail"]
            assert not queued.done()  # the queued one still waits; nothing was dropped
            runtime.scheduler._run_lock.release()
            admitted = queued.result(timeout=60)
    finally:
        if runtime.scheduler._run_lock.locked() and runtime.waiting == 0:
            try:
                runtime.scheduler._run_lock.release()
            except RuntimeError:
                pass
    assert admitted.status_code == 200
    assert admitted.json()["tokens"][0] == "[CLS]"


@pytest.mark.parametrize("limited_client", [{"queue_depth": 8, "request_timeout_s": 0.3}], indirect=True)
def test_request_time_limit_answers_503(limited_client):
    runtime = limited_client.app.state.runtime
    runtime.scheduler._run_lock.acquire()
    try:
        r = post_text(limited_client, "it was tired because the street")
    finally:
        runtime.scheduler._run_lock.release()
    assert r.status_code == 503
    assert int(r.headers["Retry-After"]) >= 1
    assert "request_timeout_s" in r.json()["detail"]
    assert runtime.waiting == 0
    again = post_text(limited_client, "it was tired because the street")
    assert again.status_code == 200, again.text  # and it recovers


def test_deadline_spans_every_wait_of_a_request(tiny_bert):
    """A request whose deadline has passed is refused at its next wait even when the model is free."""
    runtime = Runtime(make_settings(tiny_bert, request_timeout_s=60))
    token = request_deadline.set(time.monotonic() - 1)
    try:
        with pytest.raises(Overloaded):
            with runtime.admitted():
                pass
    finally:
        request_deadline.reset(token)
    assert not runtime.scheduler._run_lock.locked() and runtime.waiting == 0
    with runtime.admitted():  # without a deadline (or a live one) it is admitted
        assert runtime.scheduler._run_lock.locked()


def test_model_lock_is_handed_over_in_arrival_order(tiny_bert):
    runtime = Runtime(make_settings(tiny_bert, queue_depth=8, request_timeout_s=60))
    order: list[int] = []

    def worker(i: int) -> None:
        with runtime.admitted():
            order.append(i)

    runtime.scheduler._run_lock.acquire()
    threads = []
    try:
        for i in range(4):
            t = threading.Thread(target=worker, args=(i,))
            t.start()
            threads.append(t)
            wait_until(lambda: runtime.waiting == i + 1, f"worker {i} queued")
    finally:
        runtime.scheduler._run_lock.release()
        with runtime.scheduler._turns:
            runtime.scheduler._turns.notify_all()
    for t in threads:
        t.join(60)
    assert order == [0, 1, 2, 3]
    assert runtime.waiting == 0 and not runtime.scheduler._run_lock.locked()


def test_admission_gate_refuses_on_the_event_loop():
    """Past `limit` API POSTs in flight, the gate answers 503 + Retry-After without calling the app."""
    import asyncio

    from app.main import AdmissionGate

    async def scenario():
        release, entered = asyncio.Event(), []

        async def slow_app(scope, receive, send):
            entered.append(scope["path"])
            await release.wait()
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})

        gate = AdmissionGate(slow_app, limit=2)
        transport = httpx.ASGITransport(app=gate)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            first = [asyncio.create_task(client.post("/api/text/attention")) for _ in range(2)]
            while len(entered) < 2:
                await asyncio.sleep(0.01)
            refused = await client.post("/api/text/attention")
            not_gated = asyncio.create_task(client.get("/api/health"))  # GETs are not gated
            while len(entered) < 3:
                await asyncio.sleep(0.01)
            release.set()
            done = [await t for t in first] + [await not_gated]
        return refused, done, entered, gate.in_flight

    refused, done, entered, in_flight = run_async(scenario())
    assert refused.status_code == 503 and int(refused.headers["Retry-After"]) >= 1
    assert [r.status_code for r in done] == [200, 200, 200]
    assert entered.count("/api/text/attention") == 2  # the refused one never reached the app
    assert in_flight == 0


def test_a_queued_request_whose_client_left_leaves_the_queue_and_never_runs(tiny_bert):
    """§3: requests waiting for the model kept their place after their client left and ran when their turn
    came (12 closed LM requests: 6 s of work). Now the wait ends on cancellation, and a request that gets the
    lock after its client left gives it back at once."""
    from app.lifecycle import CancelEvent, RequestCancelled, request_cancel

    runtime = Runtime(make_settings(tiny_bert))
    runtime.scheduler._run_lock.acquire()  # the model is busy
    cancel = CancelEvent()
    outcome: dict = {}

    def queued():
        request_cancel.set(cancel)
        try:
            with runtime.admitted():
                outcome["ran"] = True
        except RequestCancelled as exc:
            outcome["cancelled"] = exc.reason

    thread = threading.Thread(target=queued)
    thread.start()
    wait_until(lambda: runtime.waiting == 1, "the request queues")
    cancel.reason = "client"
    cancel.set()
    started = time.monotonic()
    thread.join(5)
    assert outcome == {"cancelled": "client"} and time.monotonic() - started < 1.0 and runtime.waiting == 0
    runtime.scheduler._run_lock.release()
    # cancelled after it got the lock: it never runs, and the lock is free again
    token = request_cancel.set(cancel)
    try:
        with pytest.raises(RequestCancelled):
            with runtime.admitted():
                raise AssertionError("ran although its client had left")
    finally:
        request_cancel.reset(token)  # this thread runs later tests: a cancelled request must not outlive this one
    assert runtime.scheduler._run_lock.acquire(blocking=False)
    runtime.scheduler._run_lock.release()


def test_a_request_whose_work_no_longer_fits_after_queueing_is_refused_at_its_turn(tiny_bert):
    """The cost check estimated 20 s of model time; the request gets the model with 5 s left before its deadline:
    503 at once (no work started to be thrown away at the deadline), the lock given back; with 30 s left it runs."""
    from app.context import RequestContext

    runtime = Runtime(make_settings(tiny_bert, request_timeout_s=60))
    for left_s, refused in ((5.0, True), (30.0, False)):
        turn = RequestContext(deadline=time.monotonic() + left_s).turns(20.0)  # the request's model turns
        if refused:
            with pytest.raises(Overloaded, match="needs about 20 s of model time"):
                with runtime.admitted(ctx=turn()):
                    raise AssertionError("the work started")
            assert not runtime.scheduler._run_lock.locked()
        else:
            with runtime.admitted(ctx=turn()):
                assert runtime.scheduler._run_lock.locked()
            # the same request's next run: the estimate was checked at its first turn
            with runtime.admitted(ctx=turn().with_(deadline=time.monotonic() + 1.0)):
                assert runtime.scheduler._run_lock.locked()
