"""Helpers shared by the integration tests on the real smollm2-135m: the prepared model, a real server in its own
process, and how much CPU that process still uses once a client has left."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.server_launcher import ServerProcess, launch

ROOT = Path(__file__).resolve().parents[2]
SMOLLM2 = ROOT / "weights" / "smollm2-135m"


def smollm2_adapter():
    """The prepared smollm2-135m on the CPU; the test fails (not skips) when `make weights` has not run."""
    if not (SMOLLM2 / "prepared.json").is_file():
        pytest.fail("weights/smollm2-135m is missing: run `make weights`")
    from models.adapters.causal_lm import CausalLMAdapter

    return CausalLMAdapter("smollm2-135m", str(SMOLLM2), device="cpu")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


@contextmanager
def real_server(env: dict[str, str], ready_s: float) -> Iterator[tuple[str, subprocess.Popen | ServerProcess]]:
    """`python -m app.serve` (through tests/server_launcher.py: forked from a zygote that has imported torch and
    transformers) on a free loopback port with `env` added: yields (base URL, process) once /api/ready is
    200 (the test fails past ready_s) and its start-up work (e.g. the example's first view, which may still run after
    ready) has settled; SIGTERM after, then a kill if it has not stopped within 15 s."""
    port = free_port()
    server = launch(
        [sys.executable, "-m", "app.serve", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"],
        cwd=ROOT, env={**os.environ, **env},
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_s
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{base}/api/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            pytest.fail(f"server not ready in {ready_s:g} s")
        for _ in range(30):  # up to 30 s for the start-up work: settled once a second passes with no CPU used
            used = cpu_seconds(server.pid)
            time.sleep(1.0)
            if cpu_seconds(server.pid) - used < 0.05:
                break
        yield base, server
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.kill()


def cpu_after_leaving(pid: int, settle_s: float, window_s: float = 3.0) -> float:
    """CPU seconds the process uses in `window_s`, after `settle_s` for the work in progress (a step, a batch) to
    finish: near 0 when the server stopped the work of a client that left."""
    time.sleep(settle_s)
    before = cpu_seconds(pid)
    time.sleep(window_s)
    return cpu_seconds(pid) - before
