"""Audio ids shared through a real Redis (Debian's redis-server, `make redis`): a clip uploaded to one app is served
by another app with the same redis_url (spectrogram and wav), under `…audio:id:<id>` → `…audio:blob:<sha256>`;
Redis down → 503 naming it."""
from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from app.settings import Settings
from tests.faults.conftest import free_port
from tests.ops.test_replicas import REDIS_SERVER, Redis
from tests.unit.test_audio_decode import encode, tone


@pytest.fixture
def redis_server(tmp_path):
    if not Path(REDIS_SERVER).exists():
        pytest.fail(f"{REDIS_SERVER} is missing: `make redis` installs Debian's redis-server")
    server = Redis(free_port(), tmp_path / "redis.log")
    server.start()
    try:
        yield server
    finally:
        server.stop()


def test_an_upload_to_one_replica_is_served_by_another(redis_server):
    settings = Settings(default_models=[], redis_url=f"redis://127.0.0.1:{redis_server.port}/0", redis_timeout_s=0.5)
    with TestClient(create_app(settings)) as first, TestClient(create_app(settings)) as second:
        clip = encode(tone(1.5), 16000, "ogg", "libopus", out_rate=48000)
        uploaded = first.post("/api/audio", files={"file": ("clip.ogg", clip, "audio/ogg")})
        assert uploaded.status_code == 200, uploaded.text
        audio_id = uploaded.json()["audio_id"]
        import redis

        admin = redis.Redis(port=redis_server.port)
        digest = admin.get(f"attnlab:audio:id:{audio_id}").decode()  # the images' layout under the audio prefix
        assert admin.get(f"attnlab:audio:blob:{digest}") == clip and not admin.keys("attnlab:image:*")
        spectrogram = second.get(f"/api/audio/{audio_id}/spectrogram")
        assert spectrogram.status_code == 200 and spectrogram.json()["frames"] == 150
        assert second.get(f"/api/audio/{audio_id}/wav").headers["content-type"] == "audio/wav"
        assert second.get("/api/audio/" + "1" * 32 + "/wav").status_code == 404

        redis_server.stop()
        down = first.post("/api/audio", files={"file": ("clip.ogg", clip, "audio/ogg")})
        assert down.status_code == 503 and "Redis" in down.json()["detail"] and "Retry-After" in down.headers
