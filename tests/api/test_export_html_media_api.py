"""POST /api/image/export.html and /api/audio/export.html (app/routes/export_media.py, issue 31 §3): the image page's
maps over its patch labels with their scores (tiny random ViT), the speech page's decoder self-attention with
Ŝ = ln P / β₀ (real whisper-tiny-en); the file's maps are the attention routes' own; bad input is a 4xx naming the
field."""
from __future__ import annotations

import json

import numpy as np
import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from app.settings import Settings
from tests.api.test_audio_api import audio_client, sample_id  # noqa: F401  (fixtures)
from tests.api.test_export_html_api import inlined, tensor
from tests.api.test_images_api import build_tiny_vit, png_bytes


@pytest.fixture(scope="module")
def vit_client(tmp_path_factory):
    folder = build_tiny_vit(tmp_path_factory.mktemp("export-vit") / "vit", seed=7)
    settings = Settings(default_models=[], extra_image_models={"tiny-vit": str(folder)}, max_response_numbers=200_000)
    with TestClient(create_app(settings)) as client:
        r = client.post("/api/images", files={"file": ("photo.png", png_bytes((64, 48), seed=3), "image/png")})
        assert r.status_code == 200, r.text
        yield client, r.json()["image_id"]


def test_image_export_holds_the_routes_maps_over_patch_labels(vit_client):
    client, image_id = vit_client
    body = {"model": "tiny-vit", "image_id": image_id, "image_size": 32}
    res = client.post("/api/image/export.html?layer=1&head=1", json={**body, "compare": True, "queries": [0]})
    assert res.status_code == 200, res.text
    assert res.headers["content-disposition"] == 'attachment; filename="attnlab-tiny-vit-image.html"'
    data = inlined(res.text, "attnlab-data")
    response = data["response"]
    assert (data["layer"], data["head"]) == (1, 1)
    assert response["tokens"][0] == "CLS" and response["tokens"][1] == "p(0,0)" and len(response["tokens"]) == 17
    P, S = tensor(response["attention"]), tensor(response["scores"])
    assert P.shape == S.shape == (2, 2, 17, 17)  # every row (queries ignored), every layer and head
    plain = client.post("/api/image/attention", json={**body, "include_scores": True}).json()
    assert np.array_equal(P, np.array(plain["attention"], dtype=np.float32))  # the same run's float32, exactly
    np.testing.assert_allclose(S, np.array(plain["scores"]), atol=1e-5)
    assert "views/embed.js" in inlined(res.text, "attnlab-modules") and " src=" not in res.text


def test_image_export_bad_input_names_the_field(vit_client):
    client, image_id = vit_client
    cases = [({"model": "tiny-vit", "image_id": image_id, "image_size": 30}, 422, "image_size"),
             ({"model": "tiny-vit", "image_id": image_id, "layers": [5]}, 422, "layers"),
             ({"model": "tiny-vit"}, 422, "image_id"),
             ({"model": "no-such-model", "image_id": image_id}, 422, "model")]
    for body, status, field in cases:
        res = client.post("/api/image/export.html", json=body)
        assert res.status_code == status, (body, res.text)
        assert field in json.dumps(res.json()["detail"]), (body, res.text)
    res = client.post("/api/image/export.html?head=-1", json={"model": "tiny-vit", "image_id": image_id})
    assert res.status_code == 422 and "head" in res.text


def test_audio_export_holds_the_decoder_self_attention_and_scores_that_give_it_back(audio_client, sample_id):  # noqa: F811
    body = {"audio_id": sample_id, "layers": [1, 2], "heads": [0, 3]}
    res = audio_client.post("/api/audio/export.html?layer=2&head=3", json=body)
    assert res.status_code == 200, res.text
    assert res.headers["content-disposition"] == 'attachment; filename="attnlab-whisper-tiny-en-decoder.html"'
    data = inlined(res.text, "attnlab-data")
    response = data["response"]
    plain = audio_client.post("/api/audio/attention", json={**body, "kinds": ["decoder"]}).json()
    expected = np.array(plain["attention"]["decoder"], dtype=np.float32)  # (2, 2, N, N), causal
    P, S = tensor(response["attention"]), tensor(response["scores"])
    assert response["tokens"] == plain["tokens"] and P.shape == S.shape == expected.shape
    assert np.array_equal(P, expected)  # the same run's float32, exactly
    # softmax(β₀·Ŝ) over the causal keys is P again; at 2·β₀ it is P² re-normalised
    beta0 = response["native_beta"]
    N = P.shape[-1]
    causal = np.tril(np.ones((N, N), dtype=bool))
    for factor in (1.0, 2.0):
        logits = np.where(causal, factor * beta0 * S.astype(np.float64), -np.inf)
        soft = np.exp(logits - logits.max(-1, keepdims=True))
        soft /= soft.sum(-1, keepdims=True)
        powered = P.astype(np.float64) ** factor
        np.testing.assert_allclose(soft, powered / powered.sum(-1, keepdims=True), atol=1e-5)
    assert data["request"]["text"].endswith(plain["transcript"].strip())


def test_audio_export_bad_input_names_the_field(audio_client, sample_id):  # noqa: F811
    cases = [({"audio_id": sample_id, "layers": [9]}, 422, "layers"),
             ({"layers": [1]}, 422, "audio_id"),
             ({"audio_id": sample_id, "task": "translate"}, 422, "task")]
    for body, status, field in cases:
        res = audio_client.post("/api/audio/export.html", json=body)
        assert res.status_code == status, (body, res.text)
        assert field in json.dumps(res.json()["detail"]), (body, res.text)
    res = audio_client.post("/api/audio/export.html", json={"audio_id": "0" * 32})
    assert res.status_code == 404 and "audio_id" in res.text


def test_audio_export_scores_start_from_the_runs_beta(audio_client, sample_id):  # noqa: F811
    """Issue 38 §1: a temperature on the decoder's layer 2 ran that layer at β = 2·β₀; the file's scores give the map it
    draws back at the run's β of each head (Ŝ = ln P / β), so its slider starts from the map drawn, and the file says
    which attention it shows (view_kind) so that the view reads the request's interventions for it."""
    beta0 = 0.125  # whisper-tiny-en: 1/√64
    run = [{"op": "temperature", "beta": 2 * beta0, "kind": "decoder", "layers": [2]},
           {"op": "temperature", "beta": 0.01, "kind": "cross"}]  # cross-attention: not the map in the file
    body = {"audio_id": sample_id, "layers": [1, 2], "heads": [0, 3], "interventions": run}
    res = audio_client.post("/api/audio/export.html", json=body)
    assert res.status_code == 200, res.text
    data = inlined(res.text, "attnlab-data")
    response = data["response"]
    assert response["view_kind"] == "decoder" and data["request"]["interventions"][0]["beta"] == 2 * beta0
    P, S = tensor(response["attention"]).astype(np.float64), tensor(response["scores"]).astype(np.float64)
    N = P.shape[-1]
    causal = np.tril(np.ones((N, N), dtype=bool))
    for li, beta in ((0, beta0), (1, 2 * beta0)):  # layer 1 at β₀, layer 2 at the run's 2·β₀
        logits = np.where(causal, beta * S[li], -np.inf)
        soft = np.exp(logits - logits.max(-1, keepdims=True))
        np.testing.assert_allclose(soft / soft.sum(-1, keepdims=True), P[li], atol=1e-5)
    assert "temperature β = 0.25 on decoder attention, layer 2" in res.text  # the footer names the run's interventions
