"""Swagger's "Try it out" sends the request example that /openapi.json shows (issue 18 §10): every POST operation
with a JSON body has explicit examples, one per kind of model where the bodies differ (encoder, decoder LM,
encoder–decoder, image models), each naming a model this server has, and each one answers 2xx.

Against the app with its own default models (minilm, smollm2-135m, the image models and the Gaussian run) plus a
tiny random BART added the way an operator adds an encoder–decoder (extra_models)."""
from __future__ import annotations

import pytest
from tests.api.helpers import sse_events
from fastapi.testclient import TestClient

from app.main import create_app
from app.settings import Settings
from tests.tiny_models import build_text_model


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    settings = Settings(
        default_models=["minilm"],  # the others load on first use
        extra_models={"tiny-bart": str(build_text_model("bart", tmp_path_factory.mktemp("bart")))},
    )
    with TestClient(create_app(settings)) as c:
        c.app.state.runtime.warm_up()
        yield c


@pytest.fixture(scope="module")
def runs_client():
    """A server whose runs over 16 tokens keep their atlas: the runs' window and row examples read one."""
    with TestClient(create_app(Settings(default_models=["minilm"], full_map_tokens=16))) as c:
        c.app.state.runtime.warm_up()
        yield c


def json_posts(schema: dict) -> dict[str, dict]:
    """path → the application/json media object of each POST operation that takes a JSON body."""
    out = {}
    for path, operations in schema["paths"].items():
        media = operations.get("post", {}).get("requestBody", {}).get("content", {}).get("application/json")
        if media is not None:
            out[path] = media
    return out


def examples(client) -> list[tuple[str, str, dict]]:
    schema = client.get("/openapi.json").json()
    return [(path, name, ex["value"]) for path, media in json_posts(schema).items() for name, ex in media.get("examples", {}).items()]


def test_every_json_post_operation_has_explicit_examples(client):
    posts = json_posts(client.get("/openapi.json").json())
    assert {"/api/text/attention", "/api/text/generate", "/api/image/attention"} <= set(posts)
    missing = [path for path, media in posts.items() if not media.get("examples")]
    assert missing == [], f"POST operations without request examples: {missing}"
    text = posts["/api/text/attention"]["examples"]
    # one per kind of text model, each naming a model of that kind on this server
    assert {ex["value"]["model"] for ex in text.values()} == {"minilm", "smollm2-135m", "tiny-bart"}
    lm = next(ex["value"] for ex in text.values() if ex["value"]["model"] == "smollm2-135m")
    assert "text_pair" not in lm and "target" not in lm  # fields a decoder refuses
    encoder = next(ex["value"] for ex in text.values() if ex["value"]["model"] == "minilm")
    assert "position" not in encoder and "target" not in encoder  # the example that was refused with 422


def kept_run(client) -> str:
    """A run kept with its atlas (over full_map_tokens), for the paths that take a run_id."""
    response = client.post("/api/text/attention", json={"model": "minilm", "text": " ".join(["the cat sat on the mat"] * 6),
                                                         "layers": [0], "heads": [0]})
    assert response.status_code == 200, response.text
    return response.json()["run_id"]


def test_each_example_answers_2xx(client, runs_client):
    found = examples(client)
    assert len(found) >= 7
    run_id = kept_run(runs_client) if any("{run_id}" in path for path, _, _ in found) else None
    for path, name, body in found:
        server = runs_client if "{run_id}" in path else client
        response = server.post(path.replace("{run_id}", run_id or ""), json=body)
        assert 200 <= response.status_code < 300, (path, name, response.status_code, response.text[:500])
        if path == "/api/text/generate":
            assert sse_events(response)[-1]["done"] is True  # a job: accepted, its tokens, then done
        elif path in ("/api/text/attention", "/api/image/attention"):
            assert response.json()["effect"] is not None  # the example's interventions ran and were compared
