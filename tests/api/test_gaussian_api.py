"""/api/gaussian/* (API.md "Gaussian attention") and the /gaussian page, on app.main:app.

A small fake run (random centers, three saved epochs) is registered for the whole module, so these
tests do not depend on the committed training run; one test checks the committed default too.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from models import gaussian as g

FAKE = "test-fake-gaussian"


@pytest.fixture(scope="module")
def fake_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gaussian-run")
    cfg = g.GaussianConfig(n_layers=2, hidden=18, ffn_hidden=18)
    torch.manual_seed(0)
    model = g.GaussianEncoder(cfg)
    epochs = []
    for epoch in range(3):
        with torch.no_grad():
            for block in model.blocks:
                block.attn.centers.mul_(1.7)
                block.attn.alpha_raw.add_(0.5)
        epochs.append({"epoch": epoch, "accuracy": 0.1 + 0.3 * epoch, "train_loss": None if epoch == 0 else 1.0 / epoch,
                       "layers": model.centers_and_alphas()})
    history = {"model": FAKE, "dataset": "fashion-mnist", "config": cfg.to_dict(), "parameters": g.param_count(model),
               "epochs": epochs}
    (folder / "history.json").write_text(json.dumps(history))
    g.GAUSSIAN_REGISTRY[FAKE] = str(folder)
    yield history
    del g.GAUSSIAN_REGISTRY[FAKE]
    g.load_history.cache_clear()


@pytest.fixture(scope="module")
def client(fake_run):
    from app.main import app

    return TestClient(app)


def test_models_lists_the_default_first_and_the_fake(client, fake_run):
    models = client.get("/api/gaussian/models").json()["models"]
    ids = [m["id"] for m in models]
    assert ids[0] == g.DEFAULT_GAUSSIAN_MODEL
    fake = next(m for m in models if m["id"] == FAKE)
    assert fake["layers"] == 2 and fake["heads"] == 9 and fake["grid"] == [14, 14]
    assert fake["epochs"] == [0, 1, 2] and fake["accuracy"] == pytest.approx(0.7)
    assert {"id", "dataset", "layers", "heads", "grid", "epochs", "accuracy"} <= set(fake)


def test_centers_default_to_the_last_epoch_and_follow_the_history(client, fake_run):
    last = client.get(f"/api/gaussian/centers?model={FAKE}").json()
    assert last["epoch"] == 2 and last["accuracy"] == pytest.approx(0.7)
    assert last["layers"] == fake_run["epochs"][2]["layers"]
    first = client.get(f"/api/gaussian/centers?model={FAKE}&epoch=0").json()
    assert first["layers"] != last["layers"]
    head = first["layers"][1]["heads"][4]
    assert len(head["center"]) == 2 and head["alpha"] > 0
    history = client.get(f"/api/gaussian/history?model={FAKE}").json()["epochs"]
    assert [e["epoch"] for e in history] == [0, 1, 2]
    assert history[1]["layers"] == fake_run["epochs"][1]["layers"]


def test_attention_is_a_distribution_and_sharpens_to_query_plus_center(client, fake_run):
    head = fake_run["epochs"][2]["layers"][0]["heads"][3]
    query = [6, 8]
    body = {"model": FAKE, "epoch": 2, "layer": 0, "head": 3, "query": query}
    res = client.post("/api/gaussian/attention", json=body).json()
    probs = np.array(res["probs"])
    assert res["grid"] == [14, 14] and probs.shape == (14, 14)
    assert probs.sum() == pytest.approx(1.0, abs=1e-9)
    assert res["alpha"] == pytest.approx(head["alpha"])
    # the same pattern as the engine computes from the stored center and width
    assert np.allclose(probs, g.attention_over_grid(head["center"], head["alpha"], (14, 14), query))
    target = [round(query[0] + head["center"][0]), round(query[1] + head["center"][1])]
    assert 0 <= target[0] < 14 and 0 <= target[1] < 14
    previous = 0.0
    for alpha in (0.01, 1.0, 100.0, 1e6):
        r = client.post("/api/gaussian/attention", json={**body, "alpha": alpha}).json()
        assert r["nearest_pixel"] == target
        assert r["prob_at_nearest"] >= previous
        previous = r["prob_at_nearest"]
    assert previous > 1 - 1e-9


def test_attention_differs_between_epochs(client, fake_run):
    body = {"model": FAKE, "layer": 1, "head": 0, "query": [7, 7]}
    a = np.array(client.post("/api/gaussian/attention", json={**body, "epoch": 0}).json()["probs"])
    b = np.array(client.post("/api/gaussian/attention", json={**body, "epoch": 2}).json()["probs"])
    assert np.abs(a - b).max() > 1e-3


@pytest.mark.parametrize("bad,field", [
    ({"layer": 2}, "layer"), ({"layer": -1}, "layer"), ({"head": 9}, "head"), ({"query": [14, 0]}, "query"),
    ({"query": [0, -1]}, "query"), ({"query": [1]}, "query"), ({"epoch": 3}, "epoch"), ({"alpha": 0}, "alpha"),
    ({"alpha": -2.0}, "alpha"), ({"alpha": 1e7}, "alpha"), ({"alpha": "big"}, "alpha"), ({"extra": 1}, "extra"),
])
def test_attention_bad_inputs_are_422_naming_the_field(client, bad, field):
    body = {"model": FAKE, "layer": 0, "head": 0, "query": [3, 3], **bad}
    res = client.post("/api/gaussian/attention", json=body)
    assert res.status_code == 422, res.text
    assert any(field in [str(x) for x in d["loc"]] for d in res.json()["detail"]), res.json()


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_alpha_is_422(client, literal):
    raw = '{"model": "%s", "layer": 0, "head": 0, "query": [3, 3], "alpha": %s}' % (FAKE, literal)
    res = client.post("/api/gaussian/attention", content=raw, headers={"content-type": "application/json"})
    assert res.status_code == 422
    assert res.json()["detail"][0]["loc"][-1] == "alpha"
    raw = '{"kernel_size": 3, "alpha": %s}' % literal
    res = client.post("/api/gaussian/conv-equivalence", content=raw, headers={"content-type": "application/json"})
    assert res.status_code == 422
    assert res.json()["detail"][0]["loc"][-1] == "alpha"


def test_unknown_model_is_404_and_epoch_out_of_range_is_422(client):
    assert client.get("/api/gaussian/centers?model=nope").status_code == 404
    assert client.get("/api/gaussian/history?model=../../etc").status_code == 404
    res = client.post("/api/gaussian/attention", json={"model": "nope", "layer": 0, "head": 0, "query": [0, 0]})
    assert res.status_code == 404
    res = client.get(f"/api/gaussian/centers?model={FAKE}&epoch=99")
    assert res.status_code == 422 and res.json()["detail"][0]["loc"] == ["query", "epoch"]
    assert client.get(f"/api/gaussian/centers?model={FAKE}&epoch=-1").status_code == 422
    assert client.get(f"/api/gaussian/centers?model={FAKE}&epoch=x").status_code == 422


@pytest.mark.parametrize("kernel_size,dilation", [(3, 1), (3, 2), (5, 1), (5, 2)])
def test_conv_equivalence_holds_at_large_alpha(client, kernel_size, dilation):
    body = {"kernel_size": kernel_size, "dilation": dilation, "padding": "zeros", "alpha": 1e4, "image_size": 12,
            "channels_in": 2, "channels_out": 3, "seed": 4}
    res = client.post("/api/gaussian/conv-equivalence", json=body).json()
    assert res["max_abs_error"] < 1e-5 and res["interior_max_abs_error"] < 1e-5
    conv, mhsa = np.array(res["conv"]), np.array(res["mhsa"])
    assert conv.shape == mhsa.shape == (3, 12, 12)
    assert np.abs(conv - mhsa).max() == pytest.approx(res["max_abs_error"])
    alphas = [a for a, _ in res["error_by_alpha"]]
    assert min(alphas) <= 1 and max(alphas) >= 100
    errors = [e for _, e in res["error_by_alpha"]]
    assert errors[0] > 1e3 * errors[-1]
    assert "stride" in res["stride_note"].lower()


def test_conv_equivalence_without_padding_mismatches_on_the_border(client):
    res = client.post("/api/gaussian/conv-equivalence",
                      json={"kernel_size": 3, "padding": "none", "alpha": 1e4, "image_size": 10}).json()
    assert res["interior_max_abs_error"] < 1e-5 and res["max_abs_error"] > 0.1
    seeded = client.post("/api/gaussian/conv-equivalence",
                         json={"kernel_size": 3, "padding": "none", "alpha": 1e4, "image_size": 10, "seed": 1}).json()
    assert seeded["conv"] != res["conv"]


@pytest.mark.parametrize("bad,field", [
    ({"kernel_size": 4}, "kernel_size"), ({"kernel_size": 9}, "kernel_size"), ({"kernel_size": 0}, "kernel_size"),
    ({"image_size": 65}, "image_size"), ({"image_size": 0}, "image_size"), ({"alpha": 0}, "alpha"),
    ({"alpha": 1e7}, "alpha"), ({"padding": "reflect"}, "padding"), ({"dilation": 0}, "dilation"),
    ({"dilation": 6, "kernel_size": 5, "image_size": 10}, "dilation"), ({"channels_out": 1000}, "channels_out"),
    ({"seed": -1}, "seed"),
])
def test_conv_equivalence_bad_inputs_are_422(client, bad, field):
    res = client.post("/api/gaussian/conv-equivalence", json={"kernel_size": 3, **bad})
    assert res.status_code == 422, res.text
    assert any(field in [str(x) for x in d["loc"]] for d in res.json()["detail"]), res.json()


def test_blocks_and_page(client):
    blocks = client.get(f"/api/gaussian/blocks?model={FAKE}").json()
    assert blocks["cost"]["gaussian"]["total"] < blocks["cost"]["content"]["total"]
    assert 0 < blocks["gelu"]["max_abs_difference"] < 1e-3
    page = client.get("/gaussian")
    assert page.status_code == 200
    assert 'id="epoch-slider"' in page.text and "/static/js/gaussian.js" in page.text
    assert "cdn" not in page.text.lower()


def test_committed_default_run_is_served(client):
    info = client.get("/api/gaussian/models").json()["models"][0]
    assert info["id"] == g.DEFAULT_GAUSSIAN_MODEL and info["dataset"] == "fashion-mnist"
    assert info["epochs"][0] == 0 and len(info["epochs"]) >= 11 and info["accuracy"] >= 0.88
    hist = client.get(f"/api/gaussian/history?model={info['id']}").json()["epochs"]
    assert len(hist) == len(info["epochs"]) and len(hist[0]["layers"]) == info["layers"]
