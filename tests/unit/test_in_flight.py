"""API POSTs in flight (app/in_flight.py): RequestCounter (app/metrics.py) counts one from its arrival until its
response's last byte has been handed to the server, and nothing else; the run store's writer waits for none."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from app.in_flight import API_POSTS, InFlight
from app.metrics import RequestCounter


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


async def _call(app, method: str, path: str) -> None:
    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        await asyncio.sleep(0)

    await app({"type": "http", "method": method, "path": path, "headers": []}, receive, send)


@pytest.mark.parametrize(("method", "path", "counted"), [("POST", "/api/text/attention", True),
                                                          ("GET", "/api/models", False), ("POST", "/other", False)])
def test_an_api_post_counts_until_its_response_is_sent(method, path, counted):
    seen: list[int] = []
    before = API_POSTS.in_flight
    asyncio.run(_call(RequestCounter(_respond_and_record(seen)), method, path))
    assert seen == [before + counted] * 3  # from its start to its last body message
    assert API_POSTS.in_flight == before


def test_an_api_post_that_fails_is_no_longer_counted():
    async def failing(scope, receive, send):
        raise RuntimeError("the app failed")

    before = API_POSTS.in_flight
    with pytest.raises(RuntimeError):
        asyncio.run(_call(RequestCounter(failing), "POST", "/api/text/attention"))
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
