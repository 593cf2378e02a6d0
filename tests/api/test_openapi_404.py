"""The 404s are in the OpenAPI schema (app/openapi_404.py; issue 53 §12: schemathesis found 35 operations answering a
404 their schema did not list). The operations below answer 404 when an id they name is not held here (docs/api.md);
each must list it, and the ones that name nothing must not. Two real 404s are checked against their schema."""
from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from app.settings import Settings

NAMES_AN_ID = [  # (method, path): an id in the path, or a body field naming an upload or a kept run
    ("post", "/api/text/attention"),  # interventions[].source: a patch's clean run
    ("post", "/api/text/generate"),
    ("post", "/api/text/patching"),
    ("post", "/api/text/lens"),
    ("post", "/api/text/qk_attribution"),
    ("post", "/api/image/attention"),  # image_id
    ("post", "/api/audio/attention"),  # audio_id
    ("post", "/api/audio/transcribe"),
    ("get", "/api/audio/{audio_id}/wav"),
    ("get", "/api/audio/{audio_id}/spectrogram"),
    ("get", "/api/images/{image_id}/view"),
    ("post", "/api/runs/{run_id}/window"),
    ("post", "/api/runs/{run_id}/row"),
    ("get", "/api/jobs/{job_id}/events"),
    ("delete", "/api/jobs/{job_id}"),
    ("post", "/api/text/export.html"),
    ("post", "/api/image/export.html"),
    ("post", "/api/audio/export.html"),
]
NAMES_NOTHING = [("get", "/api/health"), ("get", "/api/ready"), ("post", "/api/text/tokenize")]


@pytest.fixture(scope="module")
def client():
    with TestClient(create_app(Settings(default_models=[]))) as c:
        yield c


@pytest.fixture(scope="module")
def schema(client):
    return client.get("/openapi.json").json()


@pytest.mark.parametrize("method,path", NAMES_AN_ID)
def test_an_operation_naming_an_id_lists_its_404(schema, method, path):
    responses = schema["paths"][path][method]["responses"]
    assert "404" in responses, (method, path, sorted(responses))
    assert responses["404"]["description"]


@pytest.mark.parametrize("method,path", NAMES_NOTHING)
def test_an_operation_naming_nothing_lists_no_404(schema, method, path):
    assert "404" not in schema["paths"][path][method]["responses"]


@pytest.mark.parametrize("kind", ["wav", "spectrogram"])
def test_a_real_404_is_one_its_schema_lists(client, schema, kind):
    answer = client.get(f"/api/audio/{'0' * 32}/{kind}")
    assert answer.status_code == 404 and "audio_id" in answer.json()["detail"], answer.text
    assert "404" in schema["paths"][f"/api/audio/{{audio_id}}/{kind}"]["get"]["responses"]
