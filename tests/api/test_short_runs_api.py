"""A short run's first view reads P only where the run keeps it (issue 20: on a GPU, nothing leaves the device unless
the response needs it): with `AttentionResult.attention` (the host view of all of P) made to fail, the first view with
compare, base maps, scores and thumbnails, the text mean distance and a window of the run still answer, and their
numbers are those of the maps."""
from __future__ import annotations

import numpy as np
import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from app.settings import Settings
from models.adapters.base import AttentionResult
from tests.float32 import assert_close_f32
from tests.tiny_models import build_text_model

TEXT = "the cat sat on the mat because it was tired , the dog ran on the street"


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    llama = str(build_text_model("llama", tmp_path_factory.mktemp("llama")))
    settings = Settings(default_models=["lm"], extra_models={"lm": llama}, max_response_numbers=200_000)
    with TestClient(create_app(settings)) as c:
        c.app.state.runtime.warm_up()
        yield c


@pytest.fixture
def no_host_view(monkeypatch):
    """`result.attention` raises: any reader of all of P on the host fails the request."""
    def refuse(result):
        raise AssertionError("the first view read all of P on the host (AttentionResult.attention)")
    monkeypatch.setattr(AttentionResult, "_host_view", refuse)  # what reading `attention` calls


def test_first_view_and_window_read_only_kept_maps(client, no_host_view):
    client.app.state.runtime.cache.clear()
    body = {"model": "lm", "text": TEXT, "layers": [1], "heads": [0, 2], "include_scores": True, "thumbnail_size": 4,
            "compare": True, "include_base": True,
            "interventions": [{"op": "temperature", "beta": 0.2, "layers": [1], "heads": [2]}]}
    response = client.post("/api/text/attention", json=body)
    assert response.status_code == 200, response.text
    out = response.json()
    attention, base = np.array(out["attention"]), np.array(out["base_attention"])  # (1, 2, T, T)
    n = len(out["tokens"])
    assert attention.shape == (1, 2, n, n)
    np.testing.assert_allclose(attention.sum(-1), 1.0, atol=1e-5)
    assert np.array_equal(attention[0, 0], base[0, 0])  # head 0 untouched by the intervention: the same numbers
    assert np.abs(attention[0, 1] - base[0, 1]).max() > 1e-3  # head 2 at β = 0.2
    tv = out["effect"]["attention_tv"]  # [l][h]
    assert tv[0][0] == pytest.approx(0.0, abs=1e-6)
    assert tv[0][1] == pytest.approx(0.5 * np.abs(attention[0, 1] - base[0, 1]).sum(-1).mean(), rel=1e-4)
    assert_close_f32(np.array(out["received"]), attention.mean(axis=2), n, scale=1.0)  # a float32 mean over n rows
    distance = np.abs(np.arange(n)[:, None] - np.arange(n)[None, :])
    assert out["mean_distance"][1][0] == pytest.approx((attention[0, 0] * distance).sum(-1).mean(), rel=1e-4)
    assert out["thumbnails"]["shape"][:2] == [len(out["entropy"]), len(out["entropy"][0])]
    window = client.post(f"/api/runs/{out['run_id']}/window", json={"layer": 1, "head": 2, "rows": [2, 6], "cols": [0, n]})
    assert window.status_code == 200, window.text
    assert np.array_equal(np.array(window.json()["attention"]), attention[0, 1, 2:6])  # a window of the kept maps
