"""Every route that takes a model name answers an unknown one, or one of another kind, the same way
(app/deps.adapter_for): a 422 at body.model whose message says the name and lists the models of that kind."""
from __future__ import annotations

import ast
import io
from pathlib import Path

import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parents[2]
SPEECH_SAMPLE = ROOT / "weights" / "samples" / "speech-sample.wav"


def _png() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (32, 32), (120, 30, 200)).save(out, format="PNG")
    return out.getvalue()


TEXT_ROUTES = [
    ("/api/text/attention", {"text": "the cat sat"}, "text"),
    ("/api/text/generate", {"text": "the cat sat"}, "text"),
    ("/api/text/patching", {"clean": "the cat", "corrupt": "the dog", "answer": " sat", "wrong": " ran"}, "text"),
    ("/api/text/lens", {"text": "the cat sat"}, "text"),
    ("/api/text/faithfulness", {"text": "the cat sat"}, "text"),
]


def _assert_unknown_model(response, name: str, kind: str) -> None:
    assert response.status_code == 422, response.text
    error = response.json()["detail"][0]
    assert error["loc"] == ["body", "model"]
    assert error["msg"].startswith(f"unknown {kind} model {name!r}; available: ["), error["msg"]


@pytest.mark.parametrize("path,body,kind", TEXT_ROUTES, ids=[r[0] for r in TEXT_ROUTES])
def test_text_routes_name_the_model_field(client, path, body, kind):
    _assert_unknown_model(client.post(path, json={**body, "model": "no-such-model"}), "no-such-model", kind)


def test_a_text_route_refuses_a_model_of_another_kind(client):
    response = client.post("/api/text/attention", json={"text": "the cat", "model": "dinov2-small"})
    _assert_unknown_model(response, "dinov2-small", "text")
    assert "'tiny'" in response.json()["detail"][0]["msg"]  # the text models it has


def test_the_image_route_names_the_model_field(client):
    image_id = client.post("/api/images", files={"file": ("a.png", _png(), "image/png")}).json()["image_id"]
    _assert_unknown_model(client.post("/api/image/attention", json={"image_id": image_id, "model": "tiny"}),
                          "tiny", "image")


def test_the_audio_routes_name_the_model_field(client):
    if not SPEECH_SAMPLE.is_file():
        pytest.fail("the speech sample is missing: run `make speech weights`")
    audio_id = client.get("/api/audio/sample").json()["audio_id"]
    for path in ("/api/audio/attention", "/api/audio/transcribe"):
        _assert_unknown_model(client.post(path, json={"audio_id": audio_id, "model": "tiny"}), "tiny", "audio")


def test_the_models_listed_as_available_are_the_ones_prepared_here(tmp_path_factory):
    """Issue 37 §5: the 422 listed qwen2.5-0.5b and qwen2.5-1.5b as available though neither was prepared nor in
    GET /api/models. Here no weights are prepared (an empty weights folder): the 422 lists exactly the text models
    GET /api/models lists, and none of the unprepared decoder LMs."""
    from tests.api.helpers import tiny_models_client

    with tiny_models_client(tmp_path_factory, {"tiny-llama": "llama"}, default_models=["tiny-llama"],
                            weights_dir=str(tmp_path_factory.mktemp("no-weights"))) as client:
        response = client.post("/api/text/attention", json={"model": "no-such-model", "text": "the cat sat"})
        _assert_unknown_model(response, "no-such-model", "text")
        message = response.json()["detail"][0]["msg"]
        named = set(ast.literal_eval(message.split("available: ", 1)[1]))  # the message's own Python list
        for unprepared in ("qwen2.5-0.5b", "qwen2.5-1.5b", "gemma3-270m", "smollm2-135m"):
            assert unprepared not in named, message
        listed = {m["id"] for m in client.get("/api/models", params={"kind": "text"}).json()["models"]}
        assert named == listed and "tiny-llama" in named, (named, listed)
