"""Two replicas sharing uploads through a real Redis (Debian's redis-server, `make redis`), all on loopback:
upload through one, attention through the other; Redis stopped → uploads 503 naming Redis while text still
works; Redis started again → uploads recover, no restart of the app. Every loop is bounded; every process is
stopped in `finally`."""
from __future__ import annotations

import io
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from tests.conftest import build_tiny_bert
from tests.faults.conftest import Server, free_port

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


class Redis:
    """`redis-server` on 127.0.0.1:port, no persistence; stop() and start() again on the same port."""

    def __init__(self, port: int, log_path: Path, policy: str = "volatile-lru"):
        self.port, self.log_path, self.proc, self.policy = port, log_path, None, policy

    def start(self) -> None:
        self._log = open(self.log_path, "a")
        self.proc = subprocess.Popen(
            [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--maxmemory", "64mb", "--maxmemory-policy", self.policy],
            stdout=self._log, stderr=subprocess.STDOUT)
        import redis

        client = redis.Redis(port=self.port, socket_connect_timeout=0.5)
        end = time.monotonic() + 20
        while time.monotonic() < end:
            assert self.proc.poll() is None, self.log_path.read_text()
            try:
                if client.ping():
                    return
            except redis.exceptions.ConnectionError:
                time.sleep(0.1)
        raise AssertionError(f"redis-server not answering after 20 s:\n{self.log_path.read_text()}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc is not None:
            self._log.close()
        self.proc = None


def png(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (40, 56, 3), dtype=np.uint8)).save(buffer, "PNG")
    return buffer.getvalue()


def upload(server: Server, data: bytes) -> httpx.Response:
    return httpx.post(server.base + "/api/images", files={"file": ("x.png", data, "image/png")}, timeout=30)


def image_attention(server: Server, image_id: str) -> httpx.Response:
    return httpx.post(server.base + "/api/image/attention", timeout=60, json={
        "model": "vit-fashion", "image_id": image_id, "layers": [0], "heads": [0]})


def text_attention(server: Server) -> httpx.Response:
    return httpx.post(server.base + "/api/text/attention", timeout=60,
                      json={"model": "tiny", "text": "the cat sat on the mat", "layers": [0], "heads": [0]})


@pytest.fixture(scope="module")
def tiny_text(tmp_path_factory) -> Path:
    return build_tiny_bert(tmp_path_factory.mktemp("replica-tiny-bert"))


def test_replicas_share_uploads_through_redis(tmp_path, tiny_text):
    if not Path(REDIS_SERVER).is_file():
        pytest.fail("redis-server is not installed: `make redis` (apt-get install redis-server)")
    redis_port = free_port()
    redis_server = Redis(redis_port, tmp_path / "redis.log")
    settings = {
        "redis_url": f"redis://127.0.0.1:{redis_port}/0",
        "redis_timeout_s": 0.5,
        "default_models": ["vit-fashion"],  # light: no minilm/smollm2 at start-up
        "extra_text_models": {"tiny": str(tiny_text)},
    }
    servers: list[Server] = []
    try:
        redis_server.start()
        a, b = Server(tmp_path, settings), Server(tmp_path, settings)
        servers += [a, b]
        a.wait_ready()
        b.wait_ready()

        # Upload through A, use through B: B never saw the upload, it reads the bytes from Redis.
        first = upload(a, png(1))
        assert first.status_code == 200, first.text
        image_id = first.json()["image_id"]
        got = image_attention(b, image_id)
        assert got.status_code == 200, got.text
        body = got.json()
        assert body["image_id"] == image_id and body["stored_size"] == [56, 40]
        assert len(body["attention"][0][0]) == len(body["tokens"])  # one head's (T, T) map
        view = httpx.get(f"{b.base}/api/images/{image_id}/view?size=64", timeout=30)
        assert view.status_code == 200 and view.headers["content-type"] == "image/png"
        # A never-uploaded id is still a 404 on either replica (Redis was asked and has nothing).
        missing = image_attention(b, "0" * 32)
        assert missing.status_code == 404 and "upload the image again" in missing.text

        # Redis down: uploads answer 503 naming Redis, with Retry-After; text keeps working; B still serves
        # the image it already decoded (its own LRU).
        redis_server.stop()
        down = upload(a, png(2))
        assert down.status_code == 503, down.text
        assert "Redis" in down.json()["detail"] and down.headers.get("retry-after", "").isdigit()
        unseen = image_attention(a, "f" * 32)  # not in A's LRU, Redis needed
        assert unseen.status_code == 503 and "Redis" in unseen.json()["detail"]
        for server in (a, b):
            text = text_attention(server)
            assert text.status_code == 200, text.text
        assert image_attention(b, image_id).status_code == 200

        # Redis back on the same port: uploads recover without restarting A or B.
        redis_server.start()
        end = time.monotonic() + 30
        again = upload(a, png(2))
        while again.status_code != 200 and time.monotonic() < end:
            time.sleep(0.5)
            again = upload(a, png(2))
        assert again.status_code == 200, again.text
        shared = image_attention(b, again.json()["image_id"])
        assert shared.status_code == 200, shared.text
        assert "is back after" in a.log()  # the store logs the outage's end
    finally:
        for server in servers:
            server.stop()
        redis_server.stop()


def test_every_redis_error_is_a_503_naming_redis_and_bad_content_is_absent(tmp_path, tiny_text):
    """Issue 19 §6: WRONGTYPE, OOM under maxmemory + noeviction, an ACL denying GETEX and READONLY after a
    failover each gave a 500 with a traceback. Now: 503 naming Redis (WRONGTYPE: the id is absent, 404); bytes
    over redis_max_item_bytes or not hashing to their key are absent too. A real redis-server throughout."""
    import hashlib

    import redis
    from fastapi.testclient import TestClient

    from app.main import create_app
    from app.settings import Settings

    if not Path(REDIS_SERVER).is_file():
        pytest.fail("redis-server is not installed: `make redis` (apt-get install redis-server)")
    port = free_port()
    server = Redis(port, tmp_path / "redis.log", policy="noeviction")
    prefix = "attnlab:image:"
    try:
        server.start()
        admin = redis.Redis(port=port)
        settings = Settings(redis_url=f"redis://127.0.0.1:{port}/0", redis_timeout_s=0.5, default_models=["tiny"],
                            extra_text_models={"tiny": str(tiny_text)}, redis_max_item_bytes=64 * 1024)
        with TestClient(create_app(settings), raise_server_exceptions=False) as client:
            client.app.state.runtime.warm_up()

            def view(image_id: str):
                client.app.state.image_store.local.clear()  # as a replica that never decoded it
                client.app.state.image_store.ids.clear()
                return client.get(f"/api/images/{image_id}/view", params={"size": 32})

            def put(seed: int):
                return client.post("/api/images", files={"file": ("x.png", png(seed), "image/png")})

            ok = put(1)
            assert ok.status_code == 200, ok.text
            image_id = ok.json()["image_id"]
            digest = hashlib.sha256(png(1)).hexdigest()
            assert admin.get(f"{prefix}id:{image_id}") == digest.encode()  # random id → content digest
            assert view(image_id).status_code == 200
            # the same bytes again: another id, the same blob (kept once)
            again = put(1).json()["image_id"]
            assert again != image_id and len(admin.keys(f"{prefix}blob:*")) == 1

            # WRONGTYPE: the id key holds a list → absent (404), no 500
            admin.delete(f"{prefix}id:{image_id}")
            admin.rpush(f"{prefix}id:{image_id}", "x")
            r = view(image_id)
            assert r.status_code == 404, r.text
            # bytes that do not hash to their key, or over the size cap → absent
            admin.set(f"{prefix}id:{again}", digest)
            admin.set(f"{prefix}blob:{digest}", png(9))
            assert view(again).status_code == 404
            admin.set(f"{prefix}blob:{digest}", b"\x89PNG" + b"0" * 70_000)
            assert view(again).status_code == 404

            # ACL: the default user may not GETEX → 503 naming Redis (the id is not decoded here)
            fresh = put(2).json()["image_id"]
            admin.execute_command("ACL", "SETUSER", "default", "-getex")
            r = view(fresh)
            assert r.status_code == 503 and "Redis" in r.json()["detail"] and "NOPERM" in r.json()["detail"], r.text
            assert r.headers["retry-after"].isdigit() and "Traceback" not in r.text
            admin.execute_command("ACL", "SETUSER", "default", "+getex")
            assert view(fresh).status_code == 200

            # OOM under maxmemory with noeviction → the upload answers 503 naming Redis
            admin.config_set("maxmemory", "1")
            r = put(3)
            assert r.status_code == 503 and "Redis" in r.json()["detail"] and "OOM" in r.json()["detail"], r.text
            admin.config_set("maxmemory", "64mb")

            # READONLY (this Redis turned into a replica, as after a failover) → 503 naming Redis
            admin.execute_command("REPLICAOF", "127.0.0.1", str(free_port()))
            r = put(4)
            assert r.status_code == 503 and "READONLY" in r.json()["detail"], r.text
            admin.execute_command("REPLICAOF", "NO", "ONE")
            assert put(4).status_code == 200
    finally:
        server.stop()
