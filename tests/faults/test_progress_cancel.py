"""Issue 20, the page's Cancel: a long first view streamed with layer progress (Accept: text/event-stream) stops at
the next layer once its client leaves, well before the run would have ended. The real server (uvicorn) and the
random 12-layer BERT at about 460 tokens, with full_map_tokens lowered so that the input is a long one (blockwise
atlas run). Without the cancel the same request streams every layer and then the overview."""
from __future__ import annotations

import json
import re
import socket
import time

from tests.faults.conftest import LONG_TEXT, text_models

N_LAYERS = 12  # big_bert


def _open_stream(server, text: str) -> socket.socket:
    body = json.dumps({"model": "big", "text": text, "layers": [0], "heads": [0], "encoding": "f32"}).encode()
    s = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    s.sendall(b"POST /api/text/attention HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Accept: text/event-stream\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    return s


def _read_until(s: socket.socket, pattern: bytes, limit_s: float = 120) -> bytes:
    data, end = b"", time.monotonic() + limit_s
    while pattern not in data:
        assert time.monotonic() < end, data[-400:]
        chunk = s.recv(65536)
        assert chunk, f"the server closed the connection: {data[-400:]!r}"
        data += chunk
    return data


def test_a_cancelled_long_first_view_stops_at_the_next_layer(tiny_bert, big_bert, start_server):
    # job_reattach_grace_s=0: a streamed job whose client left stops at once (by default it runs on for a while,
    # awaiting a re-attach: tests/api/test_job_reattach.py; the page's Cancel sends DELETE /api/jobs/{job_id})
    server = start_server({**text_models(tiny_bert, big_bert), "full_map_tokens": 64, "job_reattach_grace_s": 0})
    server.wait_ready()

    # the whole run, for comparison: every layer's progress, then the long response (an overview, no maps)
    s = _open_stream(server, LONG_TEXT)
    data = _read_until(s, b'"done":true')
    data += _read_until(s, b"\n\n") if not data.endswith(b"\n\n") else b""
    s.close()
    assert b"200 OK" in data.split(b"\r\n", 1)[0] and b"text/event-stream" in data
    progress = [int(m) for m in re.findall(rb'"progress":(\d+)', data)]
    assert progress == list(range(1, N_LAYERS + 1)), progress
    assert b'"attention":null' in data and b'"overview":{' in data

    # the same length of text, not cached: leave once the first layer is reported
    s = _open_stream(server, LONG_TEXT.replace("the", "a"))
    _read_until(s, b'"progress":1,')
    s.close()
    stopped = None
    for _ in range(200):  # the log says where the work stopped
        found = re.search(r"POST /api/text/attention stopped after (\d+) of (\d+) layers \(run 1\): the client left",
                          server.log())
        if found:
            stopped = int(found.group(1)), int(found.group(2))
            break
        time.sleep(0.1)
    assert stopped is not None, server.log()[-2000:]
    print(f"\nleft after layer 1; the run stopped after layer {stopped[0]} of {stopped[1]}")
    assert stopped[1] == N_LAYERS and stopped[0] <= N_LAYERS // 2, stopped  # well before the run's end
    assert "Traceback" not in server.log()
