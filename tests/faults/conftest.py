"""Fault tests (issue 12): the real server (`python -m app.serve`, uvicorn) on 127.0.0.1 and a free port,
driven by raw sockets and httpx the way a careless or hostile client would. Every loop is bounded in time
and every server is stopped (SIGTERM, then SIGKILL, by PID) when its test module ends."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import WORDS, build_tiny_bert
from tests.server_launcher import launch

ROOT = Path(__file__).resolve().parents[2]
LONG_TEXT = " ".join(WORDS[i % len(WORDS)] for i in range(460)) + "."  # about 460 tokens


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_big_bert(folder: Path) -> Path:
    """A random 12-layer BERT (hidden 384, 512 positions) with the tiny vocabulary: about half a second per
    forward at 460 tokens on 2 cores, so a `samples=16` request is long enough to leave or to shut down."""
    import torch
    from transformers import BertConfig, BertModel

    build_tiny_bert(folder)  # the vocabulary and tokenizer
    config = BertConfig(vocab_size=len((folder / "vocab.txt").read_text().split()), hidden_size=384,
                        num_hidden_layers=12, num_attention_heads=6, intermediate_size=1536, max_position_embeddings=512)
    torch.manual_seed(0)
    BertModel(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def big_bert(tmp_path_factory) -> Path:
    return build_big_bert(tmp_path_factory.mktemp("big-bert"))


class Server:
    """`python -m app.serve` on 127.0.0.1 with ATTNLAB_* settings; its log goes to a file. Started through
    tests/server_launcher.py (forked from a zygote that has imported torch and transformers), or exec'd when
    `exec_start` (a test of the start itself) or ATTNLAB_TEST_EXEC=1."""

    label = "server"

    def __init__(self, tmp: Path, settings: dict, extra_args: tuple[str, ...] = (), port: int | None = None,
                 log_name: str | None = None, exec_start: bool = False):
        self.port = port or free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / (log_name or f"server-{self.port}.log")
        env = {k: v for k, v in os.environ.items() if not k.startswith("ATTNLAB_")}
        env.update({f"ATTNLAB_{k.upper()}": v if isinstance(v, str) else json.dumps(v) for k, v in settings.items()})
        env["PYTHONPATH"] = str(ROOT)
        self._log = open(self.log_path, "w")
        self.started = time.monotonic()
        start = subprocess.Popen if exec_start else launch
        self.proc = start(
            [sys.executable, "-m", "app.serve", "--host", "127.0.0.1", "--port", str(self.port), *extra_args],
            cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT,
        )

    def wait_ready(self, limit_s: float = 180) -> None:
        end = time.monotonic() + limit_s
        while time.monotonic() < end:
            assert self.proc.poll() is None, f"{self.label} exited during start-up:\n{self.log()}"
            try:
                if httpx.get(self.base + "/api/ready", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"{self.label} not ready after {limit_s} s:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime

    def stop(self) -> int | str:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                return "killed"
        self._log.close()
        return self.proc.returncode


@pytest.fixture
def start_server(tmp_path):
    """start_server(settings, *uvicorn_args, exec_start=False) → a started Server (not waited for); all stopped at
    the end. exec_start: a real `python -m app.serve` exec, for a test of the start itself."""
    servers: list[Server] = []

    def start(settings: dict, *args: str, exec_start: bool = False) -> Server:
        server = Server(tmp_path, settings, args, exec_start=exec_start)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


def shared_server(tmp_path_factory, settings: dict):
    """A started, ready Server for a module's tests that need the same settings and leave it serving (a server's
    start is 10–20 s of imports on a busy 2-core machine); stopped when the module ends. Use it from a
    module-scoped fixture: `yield from shared_server(tmp_path_factory, {...})`."""
    server = Server(tmp_path_factory.mktemp("shared-server"), settings)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def text_models(tiny_bert: Path, big_bert: Path | None = None) -> dict:
    models = {"tiny": str(tiny_bert)}
    if big_bert is not None:
        models["big"] = str(big_bert)
    return {"default_models": ["tiny"] + (["big"] if big_bert is not None else []), "extra_text_models": models}


def long_request(seed: int, samples: int = 16) -> dict:
    """A slow request on the big model: 1 + samples forwards at about 460 tokens (each seed its own runs)."""
    return {"model": "big", "text": LONG_TEXT, "layers": [0], "heads": [0], "compare": True, "samples": samples,
            "interventions": [{"op": "perturb_keys", "noise_std": 0.5, "seed": seed}]}


@pytest.fixture
def make_client(tiny_bert):
    """make_client(**settings) → an in-process TestClient of the real app on the tiny models."""
    from fastapi.testclient import TestClient

    from app.main import create_app
    from app.settings import Settings

    clients = []

    def make(**overrides):
        settings = Settings(**{"default_models": ["tiny"], "extra_text_models": {"tiny": str(tiny_bert)}, **overrides})
        client = TestClient(create_app(settings))
        client.__enter__()
        client.app.state.runtime.warm_up()
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.__exit__(None, None, None)
