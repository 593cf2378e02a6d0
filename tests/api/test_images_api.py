"""POST /api/images, GET /api/images/{id}/view, POST /api/image/attention and /image, on tiny
random-weight ViT-family models built here (API.md "Image")."""
from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from PIL import Image

from app.main import create_app
from app.settings import Settings
from attnlab.results import read_binary

UPLOAD_LIMIT = 300_000
PIXEL_LIMIT = 1_000_000
LABELS = ["cat", "dog", "bird", "fish", "frog", "horse", "ship"]


def build_tiny_vit(folder: Path, *, kind: str = "vit-classifier", seed: int = 0) -> Path:
    """A 2-layer, 2-head random ViT-family model (32 px, patch 8 → 4×4 patches), saved like a hub folder."""
    from transformers import (Dinov2Config, Dinov2WithRegistersConfig, Dinov2WithRegistersModel, Dinov2Model,
                              ViTConfig, ViTForImageClassification)

    torch.manual_seed(seed)
    common = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=8)
    if kind == "vit-classifier":
        config = ViTConfig(**common, intermediate_size=64, num_labels=len(LABELS),
                           id2label=dict(enumerate(LABELS)), label2id={n: i for i, n in enumerate(LABELS)})
        model = ViTForImageClassification(config)
    elif kind == "dinov2":
        model = Dinov2Model(Dinov2Config(**common, mlp_ratio=2))
    elif kind == "dinov2-registers":
        model = Dinov2WithRegistersModel(Dinov2WithRegistersConfig(**common, mlp_ratio=2, num_register_tokens=2))
    else:
        raise ValueError(kind)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def image_client(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-vits")
    settings = Settings(
        default_models=[],
        extra_image_models={
            "tiny-vit": str(build_tiny_vit(root / "vit")),
            "tiny-dino": str(build_tiny_vit(root / "dino", kind="dinov2", seed=1)),
            "tiny-reg": str(build_tiny_vit(root / "reg", kind="dinov2-registers", seed=2)),
        },
        max_upload_bytes=UPLOAD_LIMIT,
        max_image_pixels=PIXEL_LIMIT,
        image_cache_items=4,
        max_response_numbers=200_000,
    )
    with TestClient(create_app(settings)) as client:
        client.app.state.runtime.warm_up()
        yield client


def png_bytes(size=(64, 48), seed=0, mode="RGB") -> bytes:
    rng = np.random.default_rng(seed)
    array = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(array).convert(mode).save(buffer, "PNG")
    return buffer.getvalue()


def upload(client, data: bytes, filename="photo.png", content_type="image/png"):
    return client.post("/api/images", files={"file": (filename, data, content_type)})


def uploaded_id(client, seed=0, size=(64, 48)) -> str:
    r = upload(client, png_bytes(size, seed))
    assert r.status_code == 200, r.text
    return r.json()["image_id"]


# ---- uploads ---------------------------------------------------------------------------------------
def test_upload_returns_a_random_id_and_size(image_client):
    data = png_bytes((64, 48), seed=3)
    first = upload(image_client, data)
    assert first.status_code == 200
    body = first.json()
    assert (body["width"], body["height"]) == (64, 48)
    assert len(body["image_id"]) == 32
    # ids are capabilities (issue 19 §10): the same file uploaded again gets another id, never its content hash
    assert upload(image_client, data, filename="other-name.png").json()["image_id"] != body["image_id"]
    assert upload(image_client, png_bytes((64, 48), seed=4)).json()["image_id"] != body["image_id"]


def test_upload_too_many_bytes_refused_from_content_length_before_reading(image_client):
    """The server must answer 413 from the header alone: the body stream here fails if it is read."""
    read = {"chunks": 0}

    def body():
        read["chunks"] += 1
        yield b"x" * 1024
        raise AssertionError("the server read the body of an oversized upload")

    r = image_client.post(
        "/api/images", content=body(),
        headers={"content-type": "multipart/form-data; boundary=abc", "content-length": str(UPLOAD_LIMIT * 3)},
    )
    assert r.status_code == 413
    assert "max_upload_bytes" in r.text
    assert read["chunks"] <= 1


def test_upload_too_many_bytes_without_content_length_stops_streaming(image_client):
    """A chunked upload (no Content-Length): the app must stop pulling body chunks soon after the limit.
    Driven through raw ASGI, because TestClient buffers the whole body before the app sees it."""
    from tests.api.helpers import run_async

    pulled = {"bytes": 0}
    sent_messages = []
    chunk = b"\0" * 65536

    async def receive():
        pulled["bytes"] += len(chunk)
        return {"type": "http.request", "body": chunk, "more_body": pulled["bytes"] < 50 * len(chunk)}

    async def send(message):
        sent_messages.append(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": "/api/images", "raw_path": b"/api/images", "query_string": b"", "root_path": "",
        "headers": [(b"host", b"testserver"), (b"content-type", b"multipart/form-data; boundary=abc"),
                    (b"transfer-encoding", b"chunked")],
        "client": ("127.0.0.1", 1234), "server": ("testserver", 80), "app": image_client.app,
    }
    run_async(image_client.app(scope, receive, send))
    start = next(m for m in sent_messages if m["type"] == "http.response.start")
    assert start["status"] == 413
    assert pulled["bytes"] <= UPLOAD_LIMIT + 2 * 65536 + 65536  # the limit + multipart slack + one chunk


def test_upload_file_just_over_the_limit_is_413(image_client):
    data = b"\x89PNG\r\n\x1a\n" + b"\0" * (UPLOAD_LIMIT + 1 - 8)
    assert upload(image_client, data).status_code == 413


@pytest.mark.parametrize("fmt", ["GIF", "BMP", "TIFF"])
def test_other_formats_are_415(image_client, fmt):
    buffer = io.BytesIO()
    Image.new("RGB", (16, 16), "red").save(buffer, fmt)
    r = upload(image_client, buffer.getvalue(), filename=f"x.{fmt.lower()}")
    assert r.status_code == 415
    assert r.json()["detail"][0]["loc"] == ["body", "file"]


def test_text_named_png_is_415(image_client):
    r = upload(image_client, b"this is not an image\n" * 20, filename="fake.png", content_type="image/png")
    assert r.status_code == 415
    assert "text" in r.text


def test_bad_files_are_4xx(image_client):
    data = png_bytes((64, 64), seed=5)
    assert upload(image_client, b"").status_code == 400
    assert upload(image_client, data[: len(data) // 2]).status_code == 400  # truncated
    assert upload(image_client, b"\xff\xd8\xff" + bytes(range(256)) * 4).status_code == 400  # JPEG magic, garbage
    rng = np.random.default_rng(0)
    assert upload(image_client, rng.integers(0, 256, 5000, dtype=np.uint8).tobytes()).status_code == 415


def test_too_many_pixels_is_413(image_client):
    buffer = io.BytesIO()
    Image.new("L", (1001, 1000), 0).save(buffer, "PNG")  # tiny file, 1,001,000 pixels
    r = upload(image_client, buffer.getvalue())
    assert r.status_code == 413
    assert "pixels" in r.text


def test_missing_field_and_wrong_content_type(image_client):
    r = image_client.post("/api/images", files={"image": ("x.png", png_bytes(), "image/png")})
    assert r.status_code == 422 and "'file'" in r.text
    r = image_client.post("/api/images", content=png_bytes(), headers={"content-type": "image/png"})
    assert r.status_code == 415


def test_view_and_unknown_ids(image_client):
    image_id = uploaded_id(image_client, seed=6, size=(80, 40))
    r = image_client.get(f"/api/images/{image_id}/view?size=64")
    assert r.status_code == 200 and r.headers["content-type"] == "image/png"
    assert Image.open(io.BytesIO(r.content)).size == (64, 64)
    assert image_client.get(f"/api/images/{'0' * 32}/view").status_code == 404
    assert image_client.get("/api/images/..%2F..%2Fetc/view").status_code == 404


def test_evicted_id_is_404(image_client):
    first = uploaded_id(image_client, seed=100)
    for seed in range(101, 106):  # the store holds 4 (image_cache_items)
        uploaded_id(image_client, seed=seed)
    r = image_client.post("/api/image/attention", json={"model": "tiny-vit", "image_id": first})
    assert r.status_code == 404
    assert "upload" in r.json()["detail"]


# ---- attention -------------------------------------------------------------------------------------
def attention(client, **body):
    body.setdefault("model", "tiny-vit")
    return client.post("/api/image/attention", json=body)


def test_attention_classifier_shapes_rollout_predictions(image_client):
    image_id = uploaded_id(image_client, seed=7)
    r = attention(image_client, image_id=image_id, include_scores=True)
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["grid"] == [4, 4] and data["prefix_tokens"] == 1
    assert data["tokens"][0] == "CLS" and data["tokens"][1] == "p(0,0)" and data["tokens"][-1] == "p(3,3)"
    att = np.array(data["attention"])
    assert att.shape == (2, 2, 17, 17)
    assert np.allclose(att.sum(-1), 1, atol=1e-5)
    assert np.array(data["scores"]).shape == (2, 2, 17, 17)
    rollout = np.array(data["rollout"])
    assert rollout.shape == (4, 4) and 0 < rollout.sum() <= 1 + 1e-5
    predictions = data["predictions"]
    assert len(predictions) == 5 and {p["label"] for p in predictions} <= set(LABELS)
    probs = [p["prob"] for p in predictions]
    assert probs == sorted(probs, reverse=True) and 0 < sum(probs) <= 1 + 1e-6
    assert np.array(data["mean_distance"]).shape == (2, 2)


def test_attention_query_rows_and_slices(image_client):
    image_id = uploaded_id(image_client, seed=8)
    full = np.array(attention(image_client, image_id=image_id).json()["attention"])
    r = attention(image_client, image_id=image_id, layers=[1], heads=[0], queries=[0, 5])
    assert r.status_code == 200
    sliced = np.array(r.json()["attention"])
    assert sliced.shape == (1, 1, 2, 17)
    assert np.array_equal(sliced[0, 0], full[1, 0, [0, 5]])  # the same maps' rows


def test_mask_patch_keys_zeroes_columns_and_moves_predictions(image_client):
    image_id = uploaded_id(image_client, seed=9)
    masked = [1, 2, 3, 4, 5, 6]
    r = attention(image_client, image_id=image_id, compare=True,
                  interventions=[{"op": "mask_keys", "tokens": masked}])
    assert r.status_code == 200, r.text
    data = r.json()
    att = np.array(data["attention"])
    assert np.abs(att[:, :, :, masked]).max() == 0
    assert np.allclose(att.sum(-1), 1, atol=1e-5)
    output = data["effect"]["output"]
    assert output["kind"] == "classes" and output["kl"] > 0
    assert len(output["before"]) == 5 and len(output["after"]) == 5
    assert output["before"] == data["effect"]["output"]["before"]
    assert np.array(data["effect"]["attention_tv"]).shape == (2, 2)
    assert len(data["effect"]["hidden_cosine"]) == 3


def test_no_interventions_means_no_effect(image_client):
    image_id = uploaded_id(image_client, seed=10)
    output = attention(image_client, image_id=image_id, compare=True).json()["effect"]["output"]
    assert output["kl"] == pytest.approx(0, abs=1e-12) and output["top1_changed"] is False


def test_temperature_and_perturbations_on_patches(image_client):
    image_id = uploaded_id(image_client, seed=11)
    base = np.array(attention(image_client, image_id=image_id, layers=[0]).json()["attention"])
    hot = attention(image_client, image_id=image_id, layers=[0],
                    interventions=[{"op": "temperature", "beta": 1e-6, "layers": [0]}]).json()
    assert np.allclose(np.array(hot["attention"]), 1 / 17, atol=1e-5)  # β → 0: uniform
    r = attention(image_client, image_id=image_id, layers=[0], heads=[1], include_scores=True,
                  interventions=[{"op": "perturb_queries", "tokens": [3], "noise_std": 2.0, "layers": [0], "heads": [1]}])
    perturbed = np.array(r.json()["attention"])[0, 0]
    changed_rows = np.where(np.abs(perturbed - base[0, 1]).max(axis=-1) > 1e-6)[0]
    assert changed_rows.tolist() == [3]  # SPEC §4: only row i changes at that layer and head


def test_backbones_registers_and_higher_resolution(image_client):
    image_id = uploaded_id(image_client, seed=12, size=(120, 90))
    dino = attention(image_client, model="tiny-dino", image_id=image_id, compare=True,
                     interventions=[{"op": "ablate_heads", "heads": [0]}]).json()
    assert dino["predictions"] is None and dino["effect"]["output"]["kind"] == "embedding"
    assert -1 <= dino["effect"]["output"]["cls_cosine"] < 1
    reg = attention(image_client, model="tiny-reg", image_id=image_id, heads=[0]).json()
    assert reg["tokens"][:4] == ["CLS", "reg0", "reg1", "p(0,0)"] and reg["prefix_tokens"] == 3
    big = attention(image_client, image_id=image_id, image_size=64, layers=[0], heads=[0]).json()
    assert big["grid"] == [8, 8] and len(big["tokens"]) == 65 and big["image_size"] == 64
    assert np.array(big["attention"]).shape == (1, 1, 65, 65)


@pytest.mark.parametrize("body, field", [
    ({"image_size": 30}, "image_size"),  # not a multiple of the patch size
    ({"layers": [2]}, "layers"),
    ({"heads": [5]}, "heads"),
    ({"queries": [17]}, "queries"),
    ({"interventions": [{"op": "mask_keys", "tokens": [99]}]}, "interventions"),
    ({"interventions": [{"op": "temperature", "beta": float("nan")}]}, "interventions"),
    ({"interventions": [{"op": "explode"}]}, "interventions"),
    ({"model": "no-such-model"}, "model"),
    ({"image_id": "../../etc/passwd"}, "image_id"),
])
def test_bad_requests_are_422_naming_the_field(image_client, body, field):
    image_id = uploaded_id(image_client, seed=13)
    payload = {"model": "tiny-vit", "image_id": image_id, **body}
    import json
    r = image_client.post("/api/image/attention", content=json.dumps(payload), headers={"content-type": "application/json"})
    assert r.status_code == 422, r.text
    assert field in r.text


def test_response_cap_is_413(image_client):
    image_id = uploaded_id(image_client, seed=14)
    r = attention(image_client, image_id=image_id, image_size=160, include_scores=True)  # 401 tokens
    assert r.status_code == 413 and "queries" in r.json()["detail"]


def test_image_page_has_config_and_slider(image_client):
    r = image_client.get("/image")
    assert r.status_code == 200
    assert 'id="beta-slider"' in r.text and 'type="range"' in r.text
    assert "/static/js/image.js" in r.text


def test_attention_in_the_binary_form_is_the_json_forms_numbers(image_client):
    image_id = uploaded_id(image_client, seed=11)
    request = {"model": "tiny-vit", "image_id": image_id, "encoding": "f32", "include_scores": True}
    as_json = image_client.post("/api/image/attention", json=request)
    as_binary = image_client.post("/api/image/attention", json=request, headers={"Accept": "application/octet-stream"})
    assert as_json.status_code == as_binary.status_code == 200, as_binary.text[:300]
    assert as_binary.headers["content-type"] == "application/octet-stream"
    expected, got = as_json.json(), read_binary(bytearray(as_binary.content))
    for name in ("attention", "scores"):
        kept = expected[name]
        want = np.frombuffer(base64.b64decode(kept["data"]), dtype="<f4").reshape(kept["shape"])
        assert got[name].dtype == np.float32 and np.array_equal(got[name], want)
    assert got["tokens"] == expected["tokens"] and got["grid"] == expected["grid"]
    refused = image_client.post("/api/image/attention", json={**request, "layers": [9]},
                                headers={"Accept": "application/octet-stream"})
    assert refused.status_code == 422 and refused.headers["content-type"].startswith("application/json")
