"""GET /api/models states a model's last measured parity before it is loaded (issue 56 §12): the load-time probe's
figure (max |Δ logits| against the model's own eager attention) is kept in the weights folder at the load
(.measured/<id>.json) and listed beside the model, described from its files, after a restart, until its next load.
A listing that said nothing about fidelity until first use was a step back."""
from __future__ import annotations

from fastapi.testclient import TestClient

from app.main import create_app
from app.settings import Settings
from tests.tiny_models import build_text_model


def _listed(client, model_id: str) -> dict:
    [entry] = [m for m in client.get("/api/models").json()["models"] if m["id"] == model_id]
    return entry


def test_the_last_measured_parity_is_listed_before_the_load(tmp_path):
    llama = build_text_model("llama", tmp_path / "llama")
    weights = tmp_path / "weights"
    weights.mkdir()
    settings = dict(default_models=[], extra_models={"lm": str(llama)}, weights_dir=str(weights))
    with TestClient(create_app(Settings(**settings))) as client:
        before = _listed(client, "lm")
        assert before.get("parity") is None and "lm" not in [a.info.id for a in client.app.state.runtime.loaded_adapters()]
        assert client.post("/api/text/attention", json={"model": "lm", "text": "the cat sat"}).status_code == 200
        measured = client.app.state.runtime.adapter("lm").info.parity
        assert isinstance(measured, float)
    with TestClient(create_app(Settings(**settings))) as client:  # a restart: nothing loaded
        assert "lm" not in [a.info.id for a in client.app.state.runtime.loaded_adapters()]
        assert _listed(client, "lm").get("parity") == measured
    with TestClient(create_app(Settings(**settings, dtype="bfloat16"))) as client:  # measured at another dtype: not it
        assert _listed(client, "lm").get("parity") is None
