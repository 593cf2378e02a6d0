"""A real fleet on loopback for the fleet tests: Debian's redis-server, N replicas (`python -m app.serve`, each its own
name and the URL it registers), and Debian's nginx run from deploy/nginx.conf with only addresses substituted (the
`server` lines of the included nginx-upstream.conf and the `listen` port). Every process is stopped in `close()`."""
from __future__ import annotations

import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from tests.faults.conftest import Server, free_port
from tests.ops.test_replicas import REDIS_SERVER, Redis

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
NGINX = shutil.which("nginx") or "/usr/sbin/nginx"
WORDS = ("the cat sat on the mat because it was tired , the dog ran on the street . a big red car did not cross "
         "the small blue house , it was the capital of france").split()


def long_text(n_words: int, shift: int = 0) -> str:
    """About n_words tokens of the tiny vocabulary (each shift its own text: no cache hit between them)."""
    return " ".join(WORDS[(i * 7 + shift) % len(WORDS)] if i % 11 else WORDS[(i + shift) % len(WORDS)]
                    for i in range(n_words))


def build_long_llama(folder: Path) -> Path:
    """A random Llama (4 layers, 4 heads over 2 key/value heads, hidden 64) that takes 4,096 positions: long inputs
    take seconds on 2 cores (a job to kill or drain), with the tiny tokenizer of tests/tiny_models.py."""
    import torch
    import transformers as tf

    from tests.tiny_models import CLS, PAD, SEP, save_tokenizer

    vocab = save_tokenizer(folder)
    config = tf.LlamaConfig(vocab_size=vocab, pad_token_id=PAD, bos_token_id=CLS, eos_token_id=SEP,
                            initializer_range=0.3, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(config)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = PAD, SEP
    model.save_pretrained(folder)
    return folder


class Replica(Server):
    """One app process on a free port, named `name`, registering http://127.0.0.1:<port> in Redis."""

    def __init__(self, tmp: Path, name: str, settings: dict, port: int | None = None):
        self.name, port = name, port or free_port()
        self.label = f"replica {name}"
        super().__init__(tmp, {**settings, "replica_name": name, "replica_url": f"http://127.0.0.1:{port}"},
                         port=port, log_name=f"replica-{name}.log")

    def wait_ready(self, limit_s: float = 600) -> None:  # three start-up probes at once on a loaded 2-core machine
        super().wait_ready(limit_s)

    def jobs(self) -> list[dict]:
        return httpx.get(self.base + "/api/jobs", timeout=5).json()["jobs"]

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=20)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.send_signal(signal.SIGTERM)  # a second SIGTERM skips the drain
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def nginx_conf(folder: Path, listen_port: int, upstreams: list[int]) -> Path:
    """deploy/nginx.conf as shipped with `listen 80` on a loopback port, and nginx-upstream.conf listing `upstreams`."""
    conf = (DEPLOY / "nginx.conf").read_text()
    assert conf.count("listen 80;") == 1 and "include nginx-upstream.conf;" in conf
    (folder / "nginx.conf").write_text(conf.replace("listen 80;", f"listen 127.0.0.1:{listen_port};"))
    shipped = (DEPLOY / "nginx-upstream.conf").read_text()
    server_line = re.search(r"^server \S+ (?:resolve )?(.*)$", shipped, re.M).group(1)  # the options as shipped
    (folder / "nginx-upstream.conf").write_text("".join(f"server 127.0.0.1:{port} {server_line}\n" for port in upstreams))
    (folder / "logs").mkdir(exist_ok=True)
    return folder / "nginx.conf"


class Nginx:
    """Debian's nginx (1.22) in the foreground with its own prefix, pid and logs in `folder`."""

    def __init__(self, folder: Path, upstreams: list[int]):
        self.folder, self.port = folder, free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        conf = nginx_conf(folder, self.port, upstreams)
        globals_ = f"daemon off; pid {folder}/nginx.pid; error_log {folder}/error.log info;"
        test = subprocess.run([NGINX, "-t", "-p", str(folder), "-c", str(conf), "-g", globals_],
                              capture_output=True, text=True, timeout=30)
        assert test.returncode == 0, test.stderr
        self.proc = subprocess.Popen([NGINX, "-p", str(folder), "-c", str(conf), "-g", globals_],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        end = time.monotonic() + 20
        while time.monotonic() < end:
            assert self.proc.poll() is None, (folder / "error.log").read_text()
            try:
                if httpx.get(self.base + "/nginx-health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.1)
        raise AssertionError("nginx not answering after 20 s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGQUIT)  # graceful: workers finish, then exit
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def require_tools() -> None:
    import pytest

    for tool, how in ((REDIS_SERVER, "`make redis` (apt-get install redis-server)"),
                      (NGINX, "`make nginx` (apt-get install nginx-light)")):
        if not Path(tool).is_file():
            pytest.fail(f"{tool} is not installed: {how}")


class Fleet:
    """Redis, `n` replicas of the same settings and nginx in front; `replicas[i].name` is "rep<i>"."""

    def __init__(self, tmp: Path, settings: dict, n: int = 3):
        require_tools()
        self.tmp, self.replicas, self.nginx = tmp, [], None
        self.redis = Redis(free_port(), tmp / "redis.log")
        self.redis.start()
        self.settings = {**settings, "redis_url": f"redis://127.0.0.1:{self.redis.port}/0", "redis_timeout_s": 0.5}
        try:  # a start that fails part-way stops what it started
            for i in range(n):
                self.replicas.append(Replica(tmp, f"rep{i}", self.settings))
            for replica in self.replicas:
                replica.wait_ready()
            self.nginx = Nginx(tmp, [r.port for r in self.replicas])
        except BaseException:
            self.close()
            raise
        self._restarts = 0

    def by_name(self, name: str) -> Replica:
        return next(r for r in self.replicas if r.name == name)

    def restart(self, replica: Replica, wait: bool = True) -> Replica:
        """A fresh process (a new name: the old one's runs are gone) on the same port, so nginx's list holds."""
        self._restarts += 1
        fresh = Replica(self.tmp, f"{replica.name}x{self._restarts}", self.settings, port=replica.port)
        self.replicas[self.replicas.index(replica)] = fresh
        if wait:
            fresh.wait_ready()
        return fresh

    def close(self) -> None:
        if self.nginx is not None:
            self.nginx.stop()
        for replica in self.replicas:
            replica.stop()
        self.redis.stop()


@contextmanager
def running_fleet(tmp: Path, settings: dict, model: Path, n: int = 3) -> Iterator[Fleet]:
    """A Fleet of `n` replicas serving the model folder `model` as "lm" beside `settings`, closed afterwards."""
    started = Fleet(tmp, {**settings, "extra_models": {"lm": str(model)}}, n)
    try:
        yield started
    finally:
        started.close()
