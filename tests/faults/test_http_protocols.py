"""Issue 14 §3: app/serve.py serves with httptools (uvicorn's C parser) when it is installed, and h11 on
request; both keep the header timeout of issue 12 (a client trickling its headers is closed)."""
from __future__ import annotations

import socket
import time

import httpx
import pytest

from app.serve import HeaderTimeoutH11Protocol, HeaderTimeoutHttpToolsProtocol, header_timeout_protocol
from tests.faults.conftest import text_models


def test_auto_picks_httptools_with_the_header_timeout():
    assert HeaderTimeoutHttpToolsProtocol is not None, "httptools is in requirements.txt but not installed"
    assert header_timeout_protocol("auto") is HeaderTimeoutHttpToolsProtocol
    assert header_timeout_protocol("httptools") is HeaderTimeoutHttpToolsProtocol
    assert header_timeout_protocol("h11") is HeaderTimeoutH11Protocol
    custom = type("Custom", (), {})
    assert header_timeout_protocol(custom) is custom  # a class the caller passes is its own business


def trickled_headers_closed_after(port: int, limit_s: float = 8) -> float | None:
    """Send a request line, then one header byte every 0.25 s; seconds until the server closes (None: never)."""
    trickle = socket.create_connection(("127.0.0.1", port), timeout=10)
    trickle.sendall(b"GET /api/health HTTP/1.1\r\n")
    started = time.monotonic()
    try:
        for byte in b"Host: 127.0.0.1\r\nX-Slow: " + b"a" * 60:
            if time.monotonic() - started > limit_s:
                return None
            try:
                trickle.sendall(bytes([byte]))
                trickle.settimeout(0.25)
                if trickle.recv(1) == b"":
                    return time.monotonic() - started
            except socket.timeout:
                continue
            except OSError:
                return time.monotonic() - started
    finally:
        trickle.close()
    return None


@pytest.mark.parametrize("http", ["httptools", "h11"])
def test_each_protocol_times_out_slow_headers_and_serves_keep_alive(tiny_bert, start_server, http):
    server = start_server({**text_models(tiny_bert), "header_timeout_s": 2}, "--http", http)
    server.wait_ready()
    with httpx.Client(base_url=server.base, timeout=10) as client:  # one connection, several requests
        for i in range(3):
            r = client.post("/api/text/attention", json={"model": "tiny", "text": f"the cat sat {i}", "layers": [0], "heads": [0]})
            assert r.status_code == 200, r.text
            assert r.headers["x-content-type-options"] == "nosniff"
        time.sleep(0.5)  # idle, within header_timeout_s: the same connection serves the next request
        assert client.get("/api/health").json() == {"status": "ok"}
    closed_after = trickled_headers_closed_after(server.port)
    assert closed_after is not None and 1.5 <= closed_after < 5, f"{http}: slow-header connection closed after {closed_after}"


def test_serve_defaults_to_asyncio_loop_unless_told():
    from app.serve import build_args

    args = build_args([])
    assert args[args.index("--loop") + 1] == "asyncio"
    assert build_args(["--loop", "uvloop"]).count("--loop") == 1
