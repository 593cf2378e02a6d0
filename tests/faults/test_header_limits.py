"""Issue 19 §1: request heads are counted as they arrive and answered 431 past max_header_bytes (in all) or
max_header_line_bytes (one line), on both of uvicorn's HTTP protocols; a header flood costs the server no memory."""
from __future__ import annotations

import json
import select
import socket
import time
from pathlib import Path

import httpx
import pytest

from tests.faults.conftest import text_models


def rss_kib(pid: int) -> int:
    return int(Path(f"/proc/{pid}/status").read_text().split("VmRSS:")[1].split()[0])


def send_head_and_read(port: int, head_lines: list[bytes] | None = None, flood_bytes: int = 0,
                       line: bytes = b"X-A: b\r\n") -> tuple[bytes, int]:
    """Send a GET /api/health head: the given lines, or `flood_bytes` of `line` repeated (sent in 64 KiB writes
    until the server answers). Returns (what the server answered, bytes sent before the answer was readable)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sent = 0
    try:
        sock.sendall(b"GET /api/health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        if head_lines is not None:
            sock.sendall(b"".join(head_lines) + b"\r\n")
        else:
            chunk = line * (64 * 1024 // len(line))
            while sent < flood_bytes:
                try:
                    sock.sendall(chunk)
                except OSError:  # the server answered and closed
                    break
                sent += len(chunk)
                if select.select([sock], [], [], 0)[0]:  # the answer is there: stop flooding, as a client would
                    break
        answer = b""
        sock.settimeout(10)
        while True:
            try:
                data = sock.recv(65536)
            except ConnectionResetError:
                break
            if not data:
                break
            answer += data
            if b"\r\n\r\n" in answer and b"content-length" in answer.lower():
                head, _, body = answer.partition(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                if len(body) >= length:
                    break
        return answer, sent
    finally:
        sock.close()


def status_and_detail(answer: bytes) -> tuple[int, str]:
    head, _, body = answer.partition(b"\r\n\r\n")
    status = int(head.split(b" ")[1])
    detail = json.loads(body).get("detail", "") if body.startswith(b"{") else body.decode()
    return status, detail


@pytest.mark.parametrize("http", ["httptools", "h11"])
def test_header_floods_get_431_and_cost_no_memory(tiny_bert, start_server, http):
    server = start_server({**text_models(tiny_bert)}, "--http", http)
    server.wait_ready()
    port = server.port
    # within the limits: 60 KiB of headers in 1 KiB lines is served (nginx's default would refuse more)
    ok, _ = send_head_and_read(port, [f"X-H{i}: {'v' * 1000}\r\n".encode() for i in range(60)])
    assert ok.split(b" ")[1] == b"200", ok[:200]

    before = rss_kib(server.proc.pid)
    # 64 MB of small header lines (the probe's flood): 431 naming max_header_bytes, long before the 64 MB are sent
    answer, sent = send_head_and_read(port, flood_bytes=64 * 2**20)
    status, detail = status_and_detail(answer)
    assert status == 431 and "max_header_bytes" in detail, answer[:300]
    assert sent < 8 * 2**20, f"{http}: the 431 came after {sent:,} bytes of headers"
    # one endless header value (the probe's 108 MB value): 431 naming max_header_line_bytes
    answer, sent = send_head_and_read(port, flood_bytes=32 * 2**20, line=b"b" * 1024)
    status, detail = status_and_detail(answer)
    assert status == 431 and "max_header_line_bytes" in detail, answer[:300]
    assert sent < 8 * 2**20
    # a line over 8 KiB, alone: 431
    answer, _ = send_head_and_read(port, [b"X-Long: " + b"x" * 9000 + b"\r\n"])
    assert status_and_detail(answer)[0] == 431
    # three floods in parallel leave the server where it was (the probe saw +3.3 GB, never released)
    import threading
    threads = [threading.Thread(target=send_head_and_read, args=(port,), kwargs={"flood_bytes": 48 * 2**20})
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    grown_mib = (rss_kib(server.proc.pid) - before) / 1024
    assert grown_mib < 50, f"{http}: RSS grew {grown_mib:.0f} MiB under header floods"
    # and the server still serves, on a fresh connection and with keep-alive
    with httpx.Client(base_url=server.base, timeout=10) as client:
        for _ in range(2):
            assert client.get("/api/health").status_code == 200
        r = client.post("/api/text/attention", json={"model": "tiny", "text": "the cat sat", "layers": [0], "heads": [0]})
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("http", ["httptools", "h11"])
def test_header_limits_are_settings_and_a_trickled_head_is_counted(tiny_bert, start_server, http):
    server = start_server({**text_models(tiny_bert), "max_header_bytes": 4096, "max_header_line_bytes": 1024}, "--http", http)
    server.wait_ready()
    answer, _ = send_head_and_read(server.port, [f"X-H{i}: {'v' * 500}\r\n".encode() for i in range(6)])
    assert status_and_detail(answer)[0] == 200
    answer, _ = send_head_and_read(server.port, [f"X-H{i}: {'v' * 500}\r\n".encode() for i in range(9)])
    status, detail = status_and_detail(answer)
    assert status == 431 and "4,096 bytes" in detail and "max_header_bytes" in detail
    # a head sent a few bytes at a time is counted across reads
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    try:
        sock.sendall(b"GET /api/health HTTP/1.1\r\nX-Slow: ")
        answer = b""
        for _ in range(200):
            try:
                sock.sendall(b"z" * 16)
            except OSError:
                break
            time.sleep(0.002)
        sock.settimeout(5)
        while chunk := sock.recv(4096):
            answer += chunk
    except (ConnectionResetError, socket.timeout):
        pass
    finally:
        sock.close()
    assert answer.startswith(b"HTTP/1.1 431"), answer[:200]
    assert b"max_header_line_bytes" in answer
