"""The server process: readiness (503 until warm), graceful SIGTERM (an in-flight request finishes, exit 0),
Server-Timing of the model run, one torch thread for small inputs."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from app.runtime import Runtime
from tests.api.helpers import make_settings, wait_until
from tests.server_launcher import launch

ROOT = Path(__file__).resolve().parents[2]


def test_ready_is_503_until_warm(tiny_bert, monkeypatch):
    release = threading.Event()
    original = Runtime.warm_up

    def gated_warm_up(self):
        release.wait(60)
        original(self)

    monkeypatch.setattr(Runtime, "warm_up", gated_warm_up)
    with TestClient(create_app(make_settings(tiny_bert))) as client:
        r = client.get("/api/ready")
        assert r.status_code == 503 and r.headers.get("Retry-After")
        assert client.get("/api/health").status_code == 200  # alive while loading
        release.set()
        wait_until(lambda: client.app.state.runtime.ready, "warm-up finished")
        r = client.get("/api/ready")
        assert r.status_code == 200 and "tiny" in r.json()["models"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_lets_in_flight_request_finish_and_exits_0(tmp_path):
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    server = launch(  # forked by tests/server_launcher.py, or exec'd with ATTNLAB_TEST_EXEC=1
        [sys.executable, "-m", "app.serve", "tests.api.slow_app:app", "--host", "127.0.0.1", "--port", str(port)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        def healthy() -> bool:
            assert server.poll() is None, server.stdout.read().decode(errors="replace")
            try:
                return httpx.get(base + "/api/health", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(healthy, "uvicorn serving", limit_s=240)  # a state change, not a speed check: 60 s was crossed under load
        marker = tmp_path / "in-flight"
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(
                httpx.get, base + "/test/slow", params={"seconds": 2.5, "marker": str(marker)}, timeout=30
            )
            wait_until(marker.exists, "slow request in flight")
            server.send_signal(signal.SIGTERM)
            response = pending.result(timeout=30)
        assert response.status_code == 200 and response.json() == {"slept": 2.5}
        assert server.wait(timeout=10) == 0
        with pytest.raises(httpx.TransportError):  # and it is gone
            httpx.get(base + "/api/health", timeout=2)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_server_timing_reports_the_model_run_only_when_it_ran(client):
    """Server-Timing: a fresh request names the model run and its queue wait; a cached repeat has no model run."""
    import re

    body = {"model": "tiny", "text": "server timing sentence one", "layers": [0], "heads": [0]}
    fresh = client.post("/api/text/attention", json=body)
    timing = dict(re.findall(r"(\w+);dur=([\d.]+)", fresh.headers["server-timing"]))
    assert {"queue", "model", "app"} <= set(timing)
    assert 0 < float(timing["model"]) <= float(timing["app"])
    repeat = client.post("/api/text/attention", json=body)
    assert "model;" not in repeat.headers["server-timing"] and "app;dur=" in repeat.headers["server-timing"]


def test_small_inputs_run_on_one_thread_and_the_count_is_restored(api_settings, monkeypatch):
    """single_thread_max_tokens: a short input runs with one torch thread, a long one with the usual count."""
    import torch

    from app.runtime import Runtime

    seen = []
    # a long input runs on the usual count when the cores are free (CpuShare.threads_for caps it by the cores other
    # processes leave free: beside the suite's other worker that could be 1 here; tests/unit/test_jobs_admission.py)
    monkeypatch.setattr("app.costs.CPU_SHARE.threads_for", lambda threads: threads)
    runtime = Runtime(api_settings.model_copy(update={"single_thread_max_tokens": 8}))
    adapter = runtime.adapter("tiny")
    real_run = adapter.run
    monkeypatch.setattr(adapter, "run", lambda *a, **k: (seen.append(torch.get_num_threads()), real_run(*a, **k))[1])
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        runtime.run(adapter, adapter.encode("a short one"), (), False)  # 5 tokens
        runtime.run(adapter, adapter.encode("a much longer sentence that has more than eight tokens in it"), (), False)
        assert seen == [1, 2] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
