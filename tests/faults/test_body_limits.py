"""Issue 12, item 3: JSON bodies are capped in bytes before they are read or parsed (max_json_bytes → 413),
and a body is never parsed while /api/health waits. Before the fix a 63 MB body took 7 s to reach its 422
and stalled /api/health meanwhile; a 200 MB body was read whole."""
from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from tests.faults.conftest import shared_server, text_models


@pytest.fixture(scope="module")
def server(tiny_bert, tmp_path_factory):
    """One server for the two tests that need one: max_json_bytes 1 MiB (the default, named here because the first
    test is about it); body_timeout_s 30 s: a server that waited for the announced body would answer (408) long after
    the first test's 5 s."""
    settings = {**text_models(tiny_bert), "max_json_bytes": 1024 * 1024, "body_timeout_s": 30}
    yield from shared_server(tmp_path_factory, settings)


def test_oversized_json_is_413_before_it_is_read(server):
    # declared: 63 MB announced, nothing sent; the answer comes at once, not after waiting for the body
    s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    started = time.monotonic()
    s.sendall(b"POST /api/text/attention HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Content-Length: 63000000\r\n\r\n")
    answer = b""
    while time.monotonic() - started < 5:  # until the server closes (Connection: close): headers and body may come apart
        chunk = s.recv(4096)
        if not chunk:
            break
        answer += chunk
    s.close()
    took = time.monotonic() - started
    assert answer.startswith(b"HTTP/1.1 413") and b"max_json_bytes" in answer, answer[:300]
    # at once (1.07 s was seen in the whole suite on two busy workers), far under body_timeout_s
    assert took < 5.0, took
    # chunked (no Content-Length): counted as it arrives, refused past the cap
    def chunks():
        yield b'{"text": "'
        for _ in range(64):
            yield b"a" * 65536
    r = httpx.post(server.base + "/api/text/attention", content=chunks(), headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 413 and "max_json_bytes" in r.json()["detail"]


def test_health_stays_fast_while_large_bodies_arrive(server):  # max_json_bytes 1 MiB, the default
    # ~1 MB: parsed whole, then refused by the request check (text over max_text_chars: 422)
    big = json.dumps({"model": "tiny", "text": "x" * 1_000_000, "heads": [0]}).encode()
    assert len(big) < 1024 * 1024
    stop = time.monotonic() + 6
    statuses: list[int] = []

    def hammer():
        with httpx.Client(timeout=30) as client:
            while time.monotonic() < stop:
                statuses.append(client.post(server.base + "/api/text/attention", content=big,
                                            headers={"content-type": "application/json"}).status_code)

    workers = [threading.Thread(target=hammer) for _ in range(3)]
    for w in workers:
        w.start()
    latencies = []
    with httpx.Client(timeout=10) as client:
        while time.monotonic() < stop:
            started = time.perf_counter()
            assert client.get(server.base + "/api/health").status_code == 200
            latencies.append(time.perf_counter() - started)
            time.sleep(0.05)
    for w in workers:
        w.join(timeout=30)
    latencies.sort()
    p99 = latencies[int(0.99 * (len(latencies) - 1))]
    print(f"\n{len(statuses)} 1-MB bodies in 6 s ({set(statuses)}); /api/health p50 {latencies[len(latencies) // 2] * 1000:.0f} ms, "
          f"p99 {p99 * 1000:.0f} ms, max {latencies[-1] * 1000:.0f} ms over {len(latencies)} requests")
    assert statuses and set(statuses) == {422}  # a clear 422 naming the field, after a full parse
    assert p99 < 0.25, p99


def test_the_body_is_parsed_once_by_the_guard(make_client, monkeypatch):
    """FastAPI takes the value RequestGuard parsed (in a worker thread for large bodies) instead of calling
    json.loads again on the event loop: with Starlette's json.loads broken, requests still work."""
    import types

    import starlette.requests

    client = make_client()

    def no_second_parse(*args, **kwargs):
        raise AssertionError("the body was parsed a second time")

    monkeypatch.setattr(starlette.requests, "json", types.SimpleNamespace(loads=no_second_parse))  # Request.json()'s
    big = {"model": "tiny", "text": "the cat sat on " * 1200, "layers": [0], "heads": [0]}  # > 16 KiB
    for body in ({"model": "tiny", "text": "the cat", "layers": [0], "heads": [0]}, big):
        r = client.post("/api/text/attention", json=body)
        assert r.status_code == 200, r.text[:300]
    assert client.post("/api/health").status_code == 405  # a POST to a GET-only path: not taken for JSON
