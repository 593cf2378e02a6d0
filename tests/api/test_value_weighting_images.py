"""Value-weighted attention on images (issue 22 §3, "wherever P is"): POST /api/image/attention takes `weighting`
like the text route, and the kept run's windows and rows (/api/runs/{id}/window, /row) take `value_norm` for short
runs and for long ones (over full_map_tokens_image: an overview instead of P). Tiny random DINOv2 and ViT."""
from __future__ import annotations

import base64

import numpy as np
import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from app.settings import Settings
from tests.api.test_images_api import build_tiny_vit, png_bytes
from tests.float32 import assert_close_f32, attention_terms


def _f32(field: dict) -> np.ndarray:
    return np.frombuffer(base64.b64decode(field["data"]), dtype="<f4").reshape(field["shape"])


@pytest.fixture(scope="module")
def clients(tmp_path_factory):
    """(short, long): the same tiny DINOv2, with P kept (short) or over full_map_tokens_image (long: 37 tokens > 8)."""
    root = tmp_path_factory.mktemp("vw-images")
    models = {"tiny-dino": str(build_tiny_vit(root / "dino", kind="dinov2", seed=4)),
              "tiny-vit": str(build_tiny_vit(root / "vit", seed=5))}
    common = dict(default_models=[], extra_image_models=models, max_response_numbers=200_000)
    with TestClient(create_app(Settings(**common))) as short, \
            TestClient(create_app(Settings(**common, full_map_tokens_image=8, overview_blocks=5, atlas_block_rows=4))) as long:
        yield short, long


def _image(client) -> str:
    r = client.post("/api/images", files={"file": ("photo.png", png_bytes((64, 48), seed=11), "image/png")})
    assert r.status_code == 200, r.text
    return r.json()["image_id"]


MASK = {"op": "mask_keys", "tokens": [3, 7]}


@pytest.mark.parametrize("model", ["tiny-dino", "tiny-vit"])
def test_image_value_norm_differs_from_p_and_rows_sum_to_one(clients, model):
    short, _ = clients
    req = {"model": model, "image_id": _image(short), "image_size": 48, "encoding": "f32", "thumbnail_size": 4,
           "interventions": [MASK]}
    plain = short.post("/api/image/attention", json=req)
    weighted = short.post("/api/image/attention", json={**req, "weighting": "value_norm"})
    assert plain.status_code == 200 and weighted.status_code == 200, weighted.text
    body = weighted.json()
    assert body["weighting"] == "value_norm" and plain.json().get("weighting", "attention") == "attention"
    p, vw = _f32(plain.json()["attention"]), _f32(body["attention"])
    assert vw.shape == p.shape and np.allclose(vw.sum(-1), 1, atol=1e-5)
    assert not np.allclose(vw, p, atol=1e-3)
    assert float(np.abs(vw[..., [3, 7]]).max()) == 0.0  # masked keys stay at 0
    n = vw.shape[-1]
    assert_close_f32(_f32(body["received"]), vw.mean(axis=2), n, scale=1.0)  # a mean over n query rows
    assert body["thumbnails"]["data"] != plain.json()["thumbnails"]["data"]
    # the image's own summaries are those of P
    assert body["rollout"] == plain.json()["rollout"] and body["mean_distance"] == plain.json()["mean_distance"]
    # `queries` rows of the value-weighted maps
    rows = short.post("/api/image/attention", json={**req, "weighting": "value_norm", "queries": [0, 5]}).json()
    # another run: q·k over the head size, softmax over the keys, norms over the hidden size (their terms add)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(short.app.state.runtime.settings.extra_image_models[model])
    terms = attention_terms(config, n) + config.hidden_size
    assert_close_f32(_f32(rows["attention"]), vw[:, :, [0, 5]], terms, scale=1.0)
    assert_close_f32(_f32(rows["received"]), vw.mean(axis=2), terms + n, scale=1.0)  # over every query row
    bad = short.post("/api/image/attention", json={**req, "weighting": "values"})
    assert bad.status_code == 422 and bad.json()["detail"][0]["loc"] == ["body", "weighting"]


def test_windows_and_rows_of_kept_image_runs_equal_the_first_view(clients):
    """A window with weighting value_norm of a short run and of a long run (rebuilt from q̂/k̂ and the kept norms)
    equals the same slice of the first view's value-weighted map; a row too; the long first view's overview is the
    block means of that map."""
    short, long = clients
    image_id = _image(short)
    req = {"model": "tiny-dino", "image_id": image_id, "image_size": 48, "encoding": "f32", "interventions": [MASK]}
    full_body = short.post("/api/image/attention", json={**req, "weighting": "value_norm"}).json()
    full = _f32(full_body["attention"])  # (L, H, T, T)
    n = full.shape[-1]
    long_body = long.post("/api/image/attention", json={**req, "image_id": _image(long), "weighting": "value_norm",
                                                        "queries": [0]}).json()
    assert long_body["weighting"] == "value_norm" and long_body["overview"] is not None
    assert np.abs(_f32(long_body["attention"]) - full[:, :, [0]]).max() <= 1e-5
    edges, col_edges = long_body["overview"]["edges"], long_body["overview"]["col_edges"]
    overview = _f32(long_body["overview"]["maps"])
    for a, (r0, r1) in enumerate(zip(edges, edges[1:])):
        for b, (c0, c1) in enumerate(zip(col_edges, col_edges[1:])):
            assert np.abs(overview[:, :, a, b] - full[:, :, r0:r1, c0:c1].mean(axis=(-1, -2))).max() <= 1e-5
    for client, body in [(short, full_body), (long, long_body)]:
        run_id = body["run_id"]
        for layer, head, rows, cols in [(0, 1, [0, n], [0, n]), (1, 0, [2, 9], [1, 30])]:
            w = client.post(f"/api/runs/{run_id}/window", json={"layer": layer, "head": head, "rows": rows, "cols": cols,
                                                               "weighting": "value_norm", "encoding": "f32"})
            assert w.status_code == 200, w.text
            assert w.json()["weighting"] == "value_norm"
            got = _f32(w.json()["attention"])
            assert np.abs(got - full[layer, head, rows[0]:rows[1], cols[0]:cols[1]]).max() <= 1e-5
            plain = _f32(client.post(f"/api/runs/{run_id}/window", json={"layer": layer, "head": head, "rows": rows,
                                                                         "cols": cols, "encoding": "f32"}).json()["attention"])
            assert not np.allclose(plain, got, atol=1e-3)
        row = client.post(f"/api/runs/{run_id}/row", json={"row": 4, "weighting": "value_norm", "encoding": "f32"})
        assert row.status_code == 200, row.text
        assert np.abs(_f32(row.json()["attention"]) - full[:, :, 4]).max() <= 1e-5
