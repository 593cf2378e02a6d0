"""Issue 12, item 1: clients that stall mid-body or trickle their headers must not lock anyone out.

Before the fix the admission gate counted a request before its body arrived and nothing timed a body:
36 stalled bodies made every API POST answer 503 for as long as they stayed open."""
from __future__ import annotations

import socket
import time

import httpx
import pytest

from tests.faults.conftest import shared_server, text_models

STALLED = 40


@pytest.fixture(scope="module")
def server(tiny_bert, tmp_path_factory):
    """One server for both tests: bodies time out after 4 s, heads after 2 s (neither test sends the other's kind of
    stall, and each leaves the server serving)."""
    yield from shared_server(tmp_path_factory, {**text_models(tiny_bert), "body_timeout_s": 4, "header_timeout_s": 2})


def stalled_body(port: int) -> socket.socket:
    """Headers announcing 1000 bytes of JSON, then 10 bytes, then nothing."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(b"POST /api/text/attention HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Content-Length: 1000\r\n\r\n" + b'{"text": "')
    return s


def timed_post(base: str, text: str) -> tuple[int, float]:
    started = time.perf_counter()
    r = httpx.post(base + "/api/text/attention", json={"model": "tiny", "text": text, "layers": [0], "heads": [0]},
                   timeout=30)
    return r.status_code, time.perf_counter() - started


def test_stalled_bodies_do_not_lock_out_posts_and_time_out_with_408(server):
    baseline = [timed_post(server.base, f"the cat sat on the mat {i}") for i in range(3)]
    assert all(status == 200 for status, _ in baseline), baseline
    cost = max(seconds for _, seconds in baseline)

    sockets = [stalled_body(server.port) for _ in range(STALLED)]
    try:
        time.sleep(0.5)  # every stalled request is now inside the server
        during = [timed_post(server.base, f"the dog ran on the rug {i}") for i in range(3)]
        assert all(status == 200 for status, _ in during), f"with {STALLED} stalled bodies: {during}"
        assert max(s for _, s in during) < cost + 1.5, (during, cost)
        print(f"\n{STALLED} stalled bodies: normal POST {max(s for _, s in during) * 1000:.0f} ms "
              f"(alone {cost * 1000:.0f} ms)")

        # body_timeout_s later each stalled request is answered 408 and its connection closed
        sockets[0].settimeout(10)
        started = time.monotonic()
        answer = b""
        while time.monotonic() - started < 10:
            chunk = sockets[0].recv(4096)
            if not chunk:
                break
            answer += chunk
        waited = time.monotonic() - started + 0.5
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert b"body_timeout_s" in answer
        assert 3 <= waited <= 8, waited
    finally:
        for s in sockets:
            s.close()


def test_slow_headers_and_idle_connections_are_closed(server):
    trickle = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    trickle.sendall(b"GET /api/health HTTP/1.1\r\n")
    started = time.monotonic()
    closed_after = None
    header = b"Host: 127.0.0.1\r\nX-Slow: " + b"a" * 40
    try:
        for byte in header:  # one header byte every 0.25 s: the keep-alive timer never fires for this
            try:
                trickle.sendall(bytes([byte]))
                trickle.settimeout(0.25)
                if trickle.recv(1) == b"":
                    closed_after = time.monotonic() - started
                    break
            except socket.timeout:
                continue
            except OSError:
                closed_after = time.monotonic() - started
                break
    finally:
        trickle.close()
    assert closed_after is not None and closed_after < 5, f"slow-header connection still open after {time.monotonic() - started:.1f} s"

    idle = socket.create_connection(("127.0.0.1", server.port), timeout=10)  # opens, then says nothing
    started = time.monotonic()
    try:
        assert idle.recv(1) == b""
    finally:
        idle.close()
    assert time.monotonic() - started < 5
    print(f"\nslow headers closed after {closed_after:.1f} s, idle connection after {time.monotonic() - started:.1f} s")
