"""Uploads need a same-origin signal (app/origin.py; issue 53 §12): a page on another origin could make its visitor's
browser upload images or audio (a multipart POST needs no preflight). A browser's cross-origin upload is refused with
403 naming why (the Sec-Fetch-Site it set, or an Origin that is not this server) before its body is read; this
server's own pages, clients that send neither header (attnlab.Lab, curl) and origins in cors_origins still upload."""
from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from app.settings import Settings
from tests.api.test_images_api import png_bytes

AUDIO = (Path(__file__).resolve().parents[1] / "fixtures" / "audio" / "tone.wav").read_bytes()
UPLOADS = [("/api/images", ("a.png", png_bytes(seed=3), "image/png")),
           ("/api/audio", ("tone.wav", AUDIO, "audio/wav"))]


@pytest.fixture(scope="module")
def client():
    with TestClient(create_app(Settings(default_models=[], cors_origins=["https://partner.example.org"]))) as c:
        yield c  # TestClient's Host is "testserver"


@pytest.mark.parametrize("path,file", UPLOADS)
@pytest.mark.parametrize("headers,words", [
    ({"Sec-Fetch-Site": "cross-site", "Origin": "https://evil.example"}, "Sec-Fetch-Site: cross-site"),
    ({"Sec-Fetch-Site": "same-site"}, "Sec-Fetch-Site: same-site"),
    ({"Origin": "https://evil.example"}, "Origin 'https://evil.example' is not this server (testserver)"),
    ({"Origin": "null"}, "Origin 'null' is not this server"),
])
def test_a_browsers_cross_origin_upload_is_403_naming_why(client, path, file, headers, words):
    answer = client.post(path, files={"file": file}, headers=headers)
    assert answer.status_code == 403, answer.text
    assert words in answer.json()["detail"] and "cors_origins" in answer.json()["detail"]


@pytest.mark.parametrize("path,file", UPLOADS)
@pytest.mark.parametrize("headers", [
    {},  # not a browser (attnlab.Lab, curl): no Origin, no Sec-Fetch-Site
    {"Sec-Fetch-Site": "same-origin", "Origin": "http://testserver"},  # this server's own page
    {"Origin": "http://testserver"},  # an older browser: Origin only
    {"Sec-Fetch-Site": "none"},  # typed or bookmarked by the user
    {"Sec-Fetch-Site": "cross-site", "Origin": "https://partner.example.org"},  # listed in cors_origins
])
def test_same_origin_and_non_browser_uploads_still_work(client, path, file, headers):
    answer = client.post(path, files={"file": file}, headers=headers)
    assert answer.status_code == 200, answer.text
    assert ("image_id" if path == "/api/images" else "audio_id") in answer.json()


def test_behind_a_proxy_that_drops_the_port_the_host_name_decides():
    """nginx passes `Host $host` (no port): a page at lab.example.org:8080 sends Origin with the port."""
    from app.origin import cross_origin_refusal

    assert cross_origin_refusal({"origin": "http://lab.example.org:8080", "host": "lab.example.org"}, []) is None
    assert cross_origin_refusal({"origin": "http://other.example.org:8080", "host": "lab.example.org"}, []) is not None
    assert cross_origin_refusal({"origin": "https://lab.example.org", "host": "lab.example.org:443"}, []) is None
    # with the port in Host, another port is another origin
    assert cross_origin_refusal({"origin": "http://lab.example.org:3000", "host": "lab.example.org:8000"}, [])
