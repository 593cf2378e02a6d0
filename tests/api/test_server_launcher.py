"""tests/server_launcher.py: a server forked from the worker's zygote is a real server process of its own. It serves
/api/ready, has its own environment and settings, dies of SIGKILL with returncode -9 and exits 0 on SIGTERM, as an
exec'd `python -m app.serve` does."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.api.helpers import wait_until
from tests.faults.conftest import free_port
from tests.server_launcher import EXEC_SETTING, ServerProcess, launch

ROOT = Path(__file__).resolve().parents[2]


def start(tmp_path: Path, name: str, tiny_bert: Path, **settings: str):
    """`python -m app.serve` through the launcher, on the tiny BERT, with ATTNLAB_* settings; (process, base URL)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTNLAB_")}
    env.update({"ATTNLAB_DEFAULT_MODELS": '["tiny"]', "ATTNLAB_EXTRA_TEXT_MODELS": json.dumps({"tiny": str(tiny_bert)}),
                **{f"ATTNLAB_{k.upper()}": v for k, v in settings.items()}})
    with open(tmp_path / f"{name}.log", "w") as log:
        proc = launch([sys.executable, "-m", "app.serve", "--host", "127.0.0.1", "--port", str(port)],
                      cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        assert proc.poll() is None, (tmp_path / f"{name}.log").read_text()
        try:
            return httpx.get(base + "/api/ready", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    wait_until(ready, f"{name} ready", limit_s=300)
    return proc, base


def environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


@pytest.mark.skipif(os.environ.get(EXEC_SETTING, "") not in ("", "0"), reason=f"{EXEC_SETTING} set: plain Popen")
def test_forked_servers_are_real_processes_with_their_own_settings(tmp_path, tiny_bert):
    first, first_base = start(tmp_path, "first", tiny_bert, max_tokens="20")
    second, second_base = start(tmp_path, "second", tiny_bert, max_tokens="60")
    try:
        assert isinstance(first, ServerProcess) and isinstance(second, ServerProcess)
        assert len({first.pid, second.pid, os.getpid()}) == 3
        assert parent_of(first.pid) == parent_of(second.pid) != os.getpid()  # both forked by the zygote
        # Each serves with its own settings: 32 tokens are cut to the first one's max_tokens, not the second's.
        body = {"model": "tiny", "text": " ".join(["the cat sat"] * 10), "layers": [0], "heads": [0]}
        first_view = httpx.post(first_base + "/api/text/attention", json=body, timeout=60).json()
        second_view = httpx.post(second_base + "/api/text/attention", json=body, timeout=60).json()
        assert len(first_view["tokens"]) == 20 and first_view["truncated"], first_view["tokens"]
        assert len(second_view["tokens"]) == 32 and not second_view["truncated"], second_view["tokens"]
        # The allocator bound an exec'd `python -m app.serve` re-executes itself with (app/allocator.py): glibc read
        # it when the zygote was exec'd (/proc/<pid>/environ is the environment a process was exec'd with).
        assert environ_of(parent_of(first.pid))["MALLOC_ARENA_MAX"] == "2"
        assert "allocator: MALLOC_ARENA_MAX=2" in (tmp_path / "first.log").read_text()
        # The zygote is single-threaded when it forks: the server's threads are its own.
        assert len(os.listdir(f"/proc/{parent_of(first.pid)}/task")) == 1

        first.send_signal(signal.SIGKILL)
        assert first.wait(timeout=30) == -9 and first.returncode == -9
        first.kill()  # a no-op once it has ended, as Popen's
        assert httpx.get(second_base + "/api/ready", timeout=10).status_code == 200  # the other one is its own

        second.terminate()
        assert second.wait(timeout=30) == 0  # app/serve.py's graceful SIGTERM
        with pytest.raises(httpx.TransportError):
            httpx.get(second_base + "/api/health", timeout=2)
    finally:
        for proc in (first, second):
            proc.kill()


def test_exec_setting_gives_a_plain_popen(tmp_path, monkeypatch):
    """ATTNLAB_TEST_EXEC=1 starts the command itself (to compare); so does anything but `-m uvicorn|app.serve`."""
    monkeypatch.setenv(EXEC_SETTING, "1")
    proc = launch([sys.executable, "-m", "app.serve", "--help"], cwd=ROOT, stdout=subprocess.PIPE)
    out, _ = proc.communicate(timeout=300)
    assert isinstance(proc, subprocess.Popen) and proc.returncode == 0 and b"--port" in out
    monkeypatch.delenv(EXEC_SETTING)
    other = launch([sys.executable, "-c", "print('x')"], cwd=tmp_path, stdout=subprocess.PIPE)
    assert isinstance(other, subprocess.Popen) and other.communicate(timeout=60)[0] == b"x\n"
