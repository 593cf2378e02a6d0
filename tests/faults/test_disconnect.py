"""Issue 12, item 4: work stops when its client leaves. Before the fix a `samples=16` request kept the CPU
busy for about 6 s after its client disconnected; now the work stops at the next check between model runs."""
from __future__ import annotations

import socket
import json
import time

from tests.faults.conftest import long_request, text_models


def test_work_stops_soon_after_the_client_leaves(tiny_bert, big_bert, start_server):
    server = start_server({**text_models(tiny_bert, big_bert)})
    server.wait_ready()
    body = json.dumps(long_request(seed=7)).encode()
    s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    s.sendall(b"POST /api/text/attention HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    time.sleep(1.5)  # a few of its 17 forwards (about half a second each) have run
    busy_before = server.cpu_seconds()
    time.sleep(1.0)
    busy_rate = server.cpu_seconds() - busy_before  # CPU seconds per second while it works
    s.close()  # the client leaves
    time.sleep(1.5)  # the forward in progress finishes; the next check stops the request
    after = server.cpu_seconds()
    time.sleep(3.0)
    spent = server.cpu_seconds() - after
    print(f"\nworking: {busy_rate:.2f} CPU-s/s; in the 3 s after the client left (+1.5 s): {spent:.2f} CPU-s")
    assert busy_rate > 0.2, "the request was not running: the test proves nothing"
    assert spent < 0.25 * busy_rate * 3, (spent, busy_rate)  # it would have kept working the whole 3 s
    log = server.log()
    assert "client left during POST /api/text/attention" in log and "Traceback" not in log
