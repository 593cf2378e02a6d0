"""POST /api/audio with the inputs an outside probe found answered with 500 (issue 27, part 6), on the real server
(`python -m app.serve`, uvicorn) over one keep-alive connection: each is a 400/415 naming `file` (or, for a sample
rate or channel count that changes mid-stream, decoded segment by segment: 200), and the same connection then
answers the next request (uvicorn closes the connection after a 500). And the Redis replica path: a clip another
replica stored that does not decode on this one is its 400/413/415 naming `audio_id`, not a 500 or a 404."""
from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from app.imagestore import content_digest
from app.main import create_app
from app.settings import Settings
from tests.faults.conftest import Server, free_port
from tests.ops.test_replicas import REDIS_SERVER, Redis

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "audio"

REFUSED = [  # (fixture, status, words in the detail)
    ("unknown_format_tag.wav", 415, "WAV format tag 0x1234 is not one we decode"),
    ("zero_bits_per_sample.wav", 400, "declares bits_per_sample 0"),
    ("flipped_codec_id.webm", 415, "audio codec is unknown"),
    ("truncated.ogg", 400, "truncated or damaged: the page at byte 97 needs"),  # issue 53 §12: accepted before
    ("overdeclared.wav", 400, "data chunk declares 4,294,967,280 bytes"),
    # issue 56 §11: MP3s of other rates joined end to end: the times after the join would be off
    ("rate_change.mp3", 400, "sample rate changes part-way (44,100 Hz, then 8,000 Hz from 0.55 s on"),
]
RESAMPLED = [  # (fixture, the first segment's sample rate and channels, duration_s)
    ("channels_change.mp3", 44100, 1, 1.0971),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    started = Server(tmp_path_factory.mktemp("audio-server"), {"default_models": [], "max_audio_bytes": 200_000})
    try:
        started.wait_ready()
        yield started
    finally:
        started.stop()


@pytest.fixture
def client(server):
    """One connection at most: every request of a test goes over the same socket unless the server closes it."""
    with httpx.Client(base_url=server.base, timeout=30, limits=httpx.Limits(max_connections=1)) as c:
        yield c


def upload(client: httpx.Client, name: str) -> httpx.Response:
    return client.post("/api/audio", files={"file": (name, (FIXTURES / name).read_bytes(), "application/octet-stream")})


def connection(response: httpx.Response) -> tuple:
    """The client side (address, port) of the TCP connection that carried the response."""
    return response.extensions["network_stream"].get_extra_info("client_addr")


@pytest.mark.parametrize("name,status,words", REFUSED)
def test_refused_with_a_4xx_naming_file_and_the_connection_is_kept(client, server, name, status, words):
    refused = upload(client, name)
    assert refused.status_code == status, refused.text
    detail = refused.json()["detail"][0]
    assert detail["loc"] == ["body", "file"] and words in detail["msg"]
    assert refused.headers.get("connection", "").lower() != "close"
    ok = upload(client, "tone.wav")
    assert ok.status_code == 200 and ok.json()["format"] == "wav"
    assert connection(ok) == connection(refused)  # the same socket: the server kept the connection
    assert "Traceback" not in server.log()


@pytest.mark.parametrize("name,rate,channels,seconds", RESAMPLED)
def test_a_stream_that_changes_mid_way_is_decoded_segment_by_segment(client, name, rate, channels, seconds):
    response = upload(client, name)
    assert response.status_code == 200, response.text
    body = response.json()
    assert (body["format"], body["sample_rate"], body["channels"]) == ("mp3", rate, channels)
    assert abs(body["duration_s"] - seconds) < 0.002
    wav = client.get(f"/api/audio/{body['audio_id']}/wav")
    assert wav.status_code == 200 and connection(wav) == connection(response)


def test_every_probe_input_then_a_normal_request_on_one_connection(client):
    responses = [upload(client, name) for name, *_ in REFUSED + RESAMPLED]
    responses.append(client.get("/api/ready"))
    assert [r.status_code for r in responses] == [s for _, s, _ in REFUSED] + [200] * len(RESAMPLED) + [200]
    assert len({connection(r) for r in responses}) == 1


# ---- a replica reading another's upload from Redis -----------------------------------------------------------------
@pytest.fixture
def redis_server(tmp_path):
    if not Path(REDIS_SERVER).exists():
        pytest.skip(f"{REDIS_SERVER} is missing (`make redis` installs Debian's redis-server)")
    started = Redis(free_port(), tmp_path / "redis.log")
    started.start()
    try:
        yield started
    finally:
        started.stop()


def stored_by_another_replica(port: int, audio_id: str, data: bytes) -> None:
    """What a replica's upload writes (app/imagestore.py's layout under the audio prefix)."""
    import redis

    admin = redis.Redis(port=port)
    digest = content_digest(data)
    admin.set(f"attnlab:audio:blob:{digest}", data, ex=600)
    admin.set(f"attnlab:audio:id:{audio_id}", digest, ex=600)


@pytest.mark.parametrize("name,status,words", REFUSED)
def test_a_clip_from_redis_that_does_not_decode_here_is_a_4xx_naming_audio_id(redis_server, name, status, words):
    """Bytes no replica of this version stores (one of an older version could have): was a 500 (AttributeError)."""
    settings = Settings(default_models=[], redis_url=f"redis://127.0.0.1:{redis_server.port}/0", redis_timeout_s=0.5)
    audio_id = "ab" * 16
    stored_by_another_replica(redis_server.port, audio_id, (FIXTURES / name).read_bytes())
    with TestClient(create_app(settings)) as replica:
        spectrogram = replica.get(f"/api/audio/{audio_id}/spectrogram")
        assert spectrogram.status_code == status, spectrogram.text
        detail = spectrogram.json()["detail"][0]
        assert detail["loc"] == ["path", "audio_id"] and audio_id in detail["msg"] and words in detail["msg"]
        attention = replica.post("/api/audio/attention", json={"audio_id": audio_id})  # before any model loads
        assert attention.status_code == status and attention.json()["detail"][0]["loc"] == ["body", "audio_id"]
        assert replica.get("/api/ready").status_code == 200


def test_a_clip_over_this_replicas_limits_is_413_not_404(redis_server):
    """Replica A (max_audio_s 10) accepts a 1.1 s clip; replica B (max_audio_s 0.5) answers 413 naming the setting,
    not 404's 'upload it again' (B would refuse that upload too)."""
    url = f"redis://127.0.0.1:{redis_server.port}/0"
    with TestClient(create_app(Settings(default_models=[], redis_url=url, max_audio_s=10.0))) as first, \
            TestClient(create_app(Settings(default_models=[], redis_url=url, max_audio_s=0.5))) as second:
        uploaded = first.post("/api/audio", files={"file": ("c.mp3", (FIXTURES / "channels_change.mp3").read_bytes())})
        assert uploaded.status_code == 200, uploaded.text
        audio_id = uploaded.json()["audio_id"]
        assert first.get(f"/api/audio/{audio_id}/wav").status_code == 200
        refused = second.get(f"/api/audio/{audio_id}/wav")
        assert refused.status_code == 413 and "max_audio_s" in refused.json()["detail"][0]["msg"]
