"""POST /api/images decodes at most `max_concurrent_decodes` images at once; an upload that finds no
free slot within `decode_wait_s` is answered 503 + Retry-After (never a 500 or a hang)."""
from __future__ import annotations

import io
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image

import app.routes.images as images_route
from app.main import create_app
from app.uploads import decode_gate
from app.settings import Settings


def png_bytes(seed: int, size=(64, 48)) -> bytes:
    array = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, "PNG")
    return buffer.getvalue()


def upload(client, data: bytes):
    return client.post("/api/images", files={"file": ("photo.png", data, "image/png")})


def _client(**limits) -> TestClient:
    return TestClient(create_app(Settings(default_models=[], **limits)))


@pytest.fixture(scope="module")
def one_decode_client():
    with _client(max_concurrent_decodes=1, decode_wait_s=0.3) as client:
        yield client


@pytest.fixture(scope="module")
def two_decodes_client():
    with _client(max_concurrent_decodes=2, decode_wait_s=30) as client:
        yield client


def test_settings_read_from_environment(monkeypatch):
    monkeypatch.setenv("ATTNLAB_MAX_CONCURRENT_DECODES", "3")
    monkeypatch.setenv("ATTNLAB_DECODE_WAIT_S", "2.5")
    settings = Settings()
    assert (settings.max_concurrent_decodes, settings.decode_wait_s) == (3, 2.5)
    assert (Settings.model_fields["max_concurrent_decodes"].default, Settings.model_fields["decode_wait_s"].default) == (2, 10.0)


def test_upload_gets_503_with_retry_after_while_every_decode_slot_is_taken(one_decode_client):
    client = one_decode_client
    gate = client.portal.call(decode_gate, client.app)
    assert (gate.limit, gate.wait_s) == (1, 0.3)
    assert client.portal.call(gate.acquire)  # the test holds the only slot, as a long decode would
    try:
        start = time.monotonic()
        busy = upload(client, png_bytes(seed=11))
        waited = time.monotonic() - start
        assert busy.status_code == 503, busy.text
        assert busy.headers["Retry-After"] == "1"
        assert "max_concurrent_decodes" in busy.json()["detail"]
        assert 0.3 <= waited < 10  # it waited decode_wait_s for a slot, then gave up: no hang
    finally:
        client.portal.call(gate.release)
    ok = upload(client, png_bytes(seed=11))
    assert ok.status_code == 200, ok.text
    assert gate.in_use == 0


def test_upload_waits_for_a_slot_that_comes_free_within_decode_wait_s(one_decode_client):
    client = one_decode_client
    gate = client.portal.call(decode_gate, client.app)
    assert client.portal.call(gate.acquire)
    timer = threading.Timer(0.1, lambda: client.portal.call(gate.release))
    timer.start()
    try:
        r = upload(client, png_bytes(seed=12))
    finally:
        timer.join()
    assert r.status_code == 200, r.text
    assert gate.in_use == 0


def test_failed_decode_gives_its_slot_back(one_decode_client):
    client = one_decode_client
    gate = client.portal.call(decode_gate, client.app)
    for _ in range(3):  # with the only slot leaked, the 2nd and 3rd would be 503
        bad = upload(client, b"\x89PNG\r\n\x1a\n" + b"\0" * 64)
        assert bad.status_code == 400, bad.text
    assert gate.in_use == 0
    assert upload(client, png_bytes(seed=13)).status_code == 200


def test_at_most_max_concurrent_decodes_run_at_once(two_decodes_client, monkeypatch):
    """Six uploads at once through the real route; decode_image (wrapped to be slow and to count) must
    never run more than twice at the same time — and does reach twice, so the limit is not just 1."""
    real_decode = images_route.decode_image
    lock = threading.Lock()
    running = {"now": 0, "peak": 0, "calls": 0}

    def slow_counting_decode(*args, **kwargs):
        with lock:
            running["now"] += 1
            running["calls"] += 1
            running["peak"] = max(running["peak"], running["now"])
        try:
            time.sleep(0.4)
            return real_decode(*args, **kwargs)
        finally:
            with lock:
                running["now"] -= 1

    monkeypatch.setattr(images_route, "decode_image", slow_counting_decode)
    client = two_decodes_client
    with ThreadPoolExecutor(6) as pool:
        responses = list(pool.map(lambda seed: upload(client, png_bytes(seed=100 + seed)), range(6)))
    assert [r.status_code for r in responses] == [200] * 6, [r.text for r in responses]
    assert running["calls"] == 6
    assert running["peak"] == 2
    assert client.portal.call(decode_gate, client.app).in_use == 0
