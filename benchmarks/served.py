"""What the server benchmarks share (run them from the repository root as `python -m benchmarks.<name>`): a real
`python -m app.serve` on a free loopback port, optionally inside a fresh cgroup v1 memory group, stopped at the end;
and one streamed job read event by event."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
STREAM = {"Accept": "text/event-stream"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server(env: dict[str, str] | None = None, tree: Path = ROOT, log: Path | None = None, ready_s: float = 600,
           cgroup: Path | None = None, cgroup_bytes: int | None = None) -> Iterator[tuple[str, subprocess.Popen]]:
    """(base URL, process) of `python -m app.serve` from `tree` (an older checkout for a before/after: its app/
    served by this venv, the weights of this checkout) with the default settings (ATTNLAB_* of this shell left out)
    plus `env`, ready. With `cgroup` and `cgroup_bytes`: inside that cgroup v1 memory group, made with that limit
    (needs root) and removed at the end."""
    port = free_port()
    cmd = [sys.executable, "-m", "app.serve", "--host", "127.0.0.1", "--port", str(port)]
    env = {"HF_HUB_OFFLINE": "1", "ATTNLAB_WEIGHTS_DIR": str(ROOT / "weights"), **(env or {})}
    if cgroup is not None:
        cgroup.mkdir(exist_ok=True)
        (cgroup / "memory.limit_in_bytes").write_text(str(cgroup_bytes))
        with contextlib.suppress(OSError):
            (cgroup / "memory.max_usage_in_bytes").write_text("0")
        cmd = ["sh", "-c", f'echo $$ > {cgroup}/cgroup.procs && exec "$@"', "attnlab-in-cgroup", *cmd]
    output = open(log, "a") if log is not None else subprocess.DEVNULL
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("ATTNLAB_")}
    proc = subprocess.Popen(cmd, cwd=tree, env={**inherited, **env}, stdout=output, stderr=output)
    base = f"http://127.0.0.1:{port}"
    try:
        end = time.time() + ready_s
        while time.time() < end:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base}/api/ready", timeout=2).status_code == 200:
                    break
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}")
            time.sleep(1)
        else:
            raise RuntimeError("the server was not ready in time")
        yield base, proc
    finally:
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(20)
        if proc.poll() is None:
            proc.kill()
        for _ in range(20 if cgroup is not None else 0):  # the group empties once the kernel has reaped its tasks
            with contextlib.suppress(OSError):
                cgroup.rmdir()
                break
            time.sleep(0.5)


def job_events(base: str, path: str, body: dict, client: str, timeout: float,
               out: dict) -> Iterator[tuple[float, dict]]:
    """One request sent as a job (`Accept: text/event-stream`, as client `client`): (seconds since it was sent,
    event) for each data event until done or error. A refusal yields nothing and leaves `out` with its `status`,
    `detail` and `refused_after_s`; `out["status"]` is set either way."""
    sent = time.monotonic()
    with httpx.stream("POST", f"{base}{path}", json=body, timeout=timeout,
                      headers={**STREAM, "X-Attnlab-Client": client}) as response:
        out["status"] = response.status_code
        if response.status_code != 200:
            response.read()
            out.update(detail=response.text[:300], refused_after_s=round(time.monotonic() - sent, 2))
            return
        for line in response.iter_lines():
            if line.startswith("data: "):
                event = json.loads(line[6:])
                yield time.monotonic() - sent, event
                if "done" in event or "error" in event:
                    return
