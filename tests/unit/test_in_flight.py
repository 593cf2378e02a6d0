"""API POSTs in flight (app/in_flight.py): AdmissionGate (app/main.py) counts one it lets in until its response's last
byte has been handed to the server, and nothing else; the run store's writer waits for none."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from app.in_flight import API_POSTS, InFlight
from app.main import AdmissionGate


def _respond_and_record(seen: list[int]):
    """An ASGI app that answers in two body messages, noting API_POSTS.in_flight as it sends each."""

    async def app(scope, receive, send):
        seen.append(API_POSTS.in_flight)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"a", "more_body": True})
        seen.append(API_POSTS.in_flight)
        await send({"type": "http.response.body", "body": b"b", "more_body": False})
        seen.append(API_POSTS.in_flight)

    return app


def _call(app, method: str, path: str) -> None:
    """One request through `app`, on an event loop of its own in a thread of its own (a test before this one may have
    left a loop running in this thread), its exception raised here."""

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        await asyncio.sleep(0)

    raised: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(app({"type": "http", "method": method, "path": path, "headers": []}, receive, send))
        except BaseException as exc:  # noqa: BLE001  raised again in the test's thread
            raised.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    if raised:
        raise raised[0]


@pytest.mark.parametrize(("method", "path", "counted"), [("POST", "/api/text/attention", True),
                                                          ("GET", "/api/models", False), ("POST", "/other", False)])
def test_an_api_post_counts_until_its_response_is_sent(method, path, counted):
    seen: list[int] = []
    before = API_POSTS.in_flight
    _call(AdmissionGate(_respond_and_record(seen), limit=4), method, path)
    assert seen == [before + counted] * 3  # from its start to its last body message
    assert API_POSTS.in_flight == before


def test_an_api_post_that_fails_is_no_longer_counted():
    async def failing(scope, receive, send):
        raise RuntimeError("the app failed")

    before = API_POSTS.in_flight
    with pytest.raises(RuntimeError, match="the app failed"):
        _call(AdmissionGate(failing, limit=4), "POST", "/api/text/attention")
    assert API_POSTS.in_flight == before


def test_waiting_for_none_ends_when_the_last_one_leaves():
    requests = InFlight()
    assert requests.wait_for_none(0.0)
    requests.entered()
    requests.entered()
    assert not requests.wait_for_none(0.05)
    threading.Timer(0.2, requests.left).start()
    threading.Timer(0.4, requests.left).start()
    started = time.monotonic()
    assert requests.wait_for_none(10)
    assert 0.35 < time.monotonic() - started < 5  # woken by the second leave, not the first
