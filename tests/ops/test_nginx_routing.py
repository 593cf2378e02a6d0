"""deploy/nginx.conf as shipped, run by Debian's nginx in front of three stand-in replicas (small HTTP servers that
answer as the app does), on what nginx does with each kind of answer (issue 53 §3): a cap about the client (429) is
passed back as it is, not tried elsewhere; a 503 that every replica gives alike (Redis down for uploads) is tried on
the others and then passed back, and takes no replica out: bystanders' reads and cancels (DELETE) after a burst of
either get 0 × 502 (before: `max_fails=1` with `http_503` marked every replica down, and nginx answered 502 to
everyone for fail_timeout: 24/30 bystanders, and the cancels). A 503 of one replica (loading, draining) still moves
new work to the next one, and so does a replica that is gone. The whole fleet with the app: tests/ops/test_fleet.py."""
from __future__ import annotations

import contextlib
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from tests.faults.conftest import free_port
from tests.ops.fleet import DEPLOY, Nginx, require_tools

PACE_S = 0.06  # under nginx's own per-address rate (20 r/s), so every 429 here is the replica's


class StandIn:
    """One stand-in replica on a loopback port: records what reached it; POST /api/cap → 429 (a client's cap), POST
    /api/uploads → 503 (Redis down: the same on every replica), POST /api/work → 503 when `loading`, else 200; any
    GET or DELETE → 200 naming the replica."""

    def __init__(self, name: str):
        self.name, self.port, self.seen, self.loading = name, free_port(), [], False
        self.connections: set = set()
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def setup(self):
                super().setup()
                stand_in.connections.add(self.connection)  # nginx keeps connections open (keepalive 32)

            def _answer(self, status: int, body: str, retry_after: str | None = None) -> None:
                data = body.encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                if retry_after:
                    self.send_header("Retry-After", retry_after)
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                stand_in.seen.append(("GET", self.path))
                self._answer(200, f'{{"replica": "{stand_in.name}"}}')

            def do_DELETE(self):
                stand_in.seen.append(("DELETE", self.path))
                self._answer(200, f'{{"replica": "{stand_in.name}", "cancelled": true}}')

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                stand_in.seen.append(("POST", self.path))
                if self.path == "/api/cap":
                    self._answer(429, '{"detail": "too many jobs: max_queued_jobs_per_client=4"}', "10")
                elif self.path == "/api/uploads" or stand_in.loading:
                    self._answer(503, '{"detail": "Redis unreachable"}', "5")
                else:
                    self._answer(200, f'{{"replica": "{stand_in.name}"}}')

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """Gone: no new connection is accepted, and the kept-alive ones are closed."""
        self.server.shutdown()
        self.server.server_close()
        for connection in list(self.connections):
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)


@pytest.fixture
def routed(tmp_path):
    require_tools()
    stand_ins = [StandIn(f"rep{i}") for i in range(3)]
    nginx = Nginx(tmp_path, [s.port for s in stand_ins])
    try:
        yield nginx, stand_ins
    finally:
        nginx.stop()
        for stand_in in stand_ins:
            stand_in.stop()


def _send(client: httpx.Client, method: str, path: str, who: str) -> httpx.Response:
    time.sleep(PACE_S)
    return client.request(method, path, headers={"X-Attnlab-Client": who}, content=b"{}" if method == "POST" else None)


def test_the_shipped_config_takes_no_replica_out_for_an_answer_about_the_client():
    conf = (DEPLOY / "nginx.conf").read_text()
    retried = re.findall(r"^\s*proxy_next_upstream (.*);", conf, re.M)
    assert retried, "no proxy_next_upstream in deploy/nginx.conf"
    for line in retried:
        conditions = set(line.split())
        assert "http_429" not in conditions and "http_500" not in conditions and "http_404" not in conditions
        assert {"error", "http_503"} <= conditions  # a replica gone, or one that refused before any work
    # a 503 counts as a failure for max_fails; some 503s are the same on every replica: no answer may take one out
    upstream = (DEPLOY / "nginx-upstream.conf").read_text()
    servers = re.findall(r"^server .*;", upstream, re.M)
    assert servers and all("max_fails=0" in line for line in servers), servers


def test_over_cap_and_fleet_wide_503_answers_leave_bystanders_and_cancels_served(routed):
    nginx, stand_ins = routed
    with httpx.Client(base_url=nginx.base, timeout=10) as client:
        capped = [_send(client, "POST", "/api/cap", f"over-cap-client-{i:02d}") for i in range(30)]
        assert [r.status_code for r in capped] == [429] * 30
        assert all("max_queued_jobs_per_client" in r.text and r.headers["Retry-After"] == "10" for r in capped)
        posts = sum(1 for s in stand_ins for method, path in s.seen if path == "/api/cap")
        assert posts == 30  # each 429 went back as it was: never tried on another replica
        uploads = [_send(client, "POST", "/api/uploads", f"uploader-{i:02d}") for i in range(10)]
        assert [r.status_code for r in uploads] == [503] * 10  # tried on each replica, then passed back (not 502)
        assert all("Redis" in r.text for r in uploads)
        bystanders = [_send(client, "GET", f"/api/runs/run{i}", f"bystander-{i:02d}") for i in range(30)]
        assert [r.status_code for r in bystanders].count(502) == 0
        assert all(r.status_code == 200 for r in bystanders), [r.status_code for r in bystanders]
        assert len({r.json()["replica"] for r in bystanders}) == 3  # every replica still in the ring
        cancels = [_send(client, "DELETE", f"/api/jobs/job{i}", f"over-cap-client-{i:02d}") for i in range(10)]
        assert [r.status_code for r in cancels] == [200] * 10


def test_one_replicas_503_or_its_absence_moves_new_work_to_another(routed):
    nginx, stand_ins = routed
    stand_ins[0].loading = True  # loading or draining: new work refused at once, before any work
    with httpx.Client(base_url=nginx.base, timeout=10) as client:
        answers = [_send(client, "POST", "/api/work", f"newcomer-{i:02d}") for i in range(20)]
        assert [r.status_code for r in answers] == [200] * 20
        assert "rep0" not in {r.json()["replica"] for r in answers}
        assert any(path == "/api/work" for _, path in stand_ins[0].seen)  # some were sent there first, then moved
        stand_ins[0].loading = False
        stand_ins[1].stop()  # gone: its connections are refused
        after = [_send(client, "POST", "/api/work", f"newcomer-{i:02d}") for i in range(20)]
        assert [r.status_code for r in after] == [200] * 20
        assert {r.json()["replica"] for r in after} <= {"rep0", "rep2"}
