"""DistilBERT, the family added through the registry (issue 54: models/families/distilbert.py and its line in
models/families/__init__.py): a tiny random-weight DistilBERT masked LM and a bare DistilBERT backbone, named to the
server as an operator's models, are recognised as their own family, listed from their files as the load reports them,
answered on POST /api/text/attention with maps equal to transformers' own eager `output_attentions` (float32
rounding), and every intervention its family offers acts: masked keys get no attention, a temperature changes the
maps and the output, an ablated head changes the layer's output, value weighting finds W_O (`out_lin`), and the
positions op moves the maps."""
from __future__ import annotations

import base64

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from app.main import create_app
from app.settings import Settings
from models.families import detect_family, family_named
from tests.tiny_models import build_text_model

TEXT = "the cat sat on the [MASK] because it was tired"
PAIR = "the dog ran"


def _f32(field: dict) -> np.ndarray:
    return np.frombuffer(base64.b64decode(field["data"]), dtype="<f4").reshape(field["shape"])


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return {name: build_text_model(family, tmp_path_factory.mktemp(family))
            for name, family in (("distil", "distilbert"), ("distil-base", "distilbert_base"))}


@pytest.fixture(scope="module")
def client(folders):
    settings = Settings(default_models=[], extra_models={name: str(folder) for name, folder in folders.items()})
    with TestClient(create_app(settings)) as client:
        yield client


def _view(client, model="distil", **body) -> dict:
    r = client.post("/api/text/attention", json={"model": model, "text": TEXT, "encoding": "f32", **body})
    assert r.status_code == 200, r.text
    return r.json()


def _reference_attention(folder, text: str, pair: str | None = None) -> tuple[list[str], np.ndarray]:
    """transformers' own maps: the checkpoint loaded with eager attention, output_attentions=True, (L, H, T, T)."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModel.from_pretrained(folder, attn_implementation="eager").eval()
    inputs = tokenizer(text, pair, return_tensors="pt")
    assert "token_type_ids" not in inputs  # DistilBERT has no token types: its tokenizer sends none
    with torch.no_grad():
        out = model(**inputs, output_attentions=True)
    tokens = tokenizer.convert_ids_to_tokens(inputs["input_ids"][0].tolist())
    return tokens, torch.stack([a[0] for a in out.attentions]).numpy()


def test_it_is_its_own_family_and_listed_as_loaded(client, folders):
    assert detect_family(str(folders["distil"])) == "distilbert"
    assert family_named("distilbert").output_projection == "out_lin"
    listed = {m["id"]: m for m in client.get("/api/models").json()["models"]}
    assert listed["distil"]["architecture"] == "DistilBertForMaskedLM" and listed["distil"]["output"] == "mlm"
    assert listed["distil-base"]["architecture"] == "DistilBertModel" and listed["distil-base"]["output"] == "embedding"
    body = _view(client)  # loads it
    loaded = {m["id"]: m for m in client.get("/api/models").json()["models"]}["distil"]
    assert loaded["parity"] is not None and loaded["parity"] <= 1e-4
    assert {k: v for k, v in loaded.items() if k not in ("parity", "loaded", "state")} == \
        {k: v for k, v in listed["distil"].items() if k not in ("parity", "loaded", "state")}
    assert body["output"]["kind"] == "mlm" and body["output"]["masks"][0]["position"] == body["tokens"].index("[MASK]")


@pytest.mark.parametrize("model, pair", [("distil", None), ("distil", PAIR), ("distil-base", None)])
def test_maps_equal_transformers_output_attentions(client, folders, model, pair):
    body = _view(client, model, **({"text_pair": pair} if pair else {}))
    tokens, reference = _reference_attention(folders[model], TEXT, pair)
    assert body["tokens"] == tokens
    maps = _f32(body["attention"])  # (L, H, T, T): every layer and head asked by default
    assert maps.shape == reference.shape
    np.testing.assert_allclose(maps, reference, rtol=0, atol=2e-6)


def test_its_interventions_act(client):
    plain = _f32(_view(client)["attention"])
    masked = _view(client, interventions=[{"op": "mask_keys", "tokens": [2, 3]}], compare=True)
    maps = _f32(masked["attention"])
    assert float(np.abs(maps[..., [2, 3]]).max()) == 0.0 and np.allclose(maps.sum(-1), 1, atol=1e-5)
    assert max(max(row) for row in masked["effect"]["attention_tv_all"]) > 1e-3

    hot = _view(client, interventions=[{"op": "temperature", "beta": 0.05, "layers": [1]}], compare=True)
    hot_maps = _f32(hot["attention"])
    assert np.allclose(hot_maps[0], plain[0], atol=1e-6) and not np.allclose(hot_maps[1], plain[1], atol=1e-3)
    assert max(hot["effect"]["output"]["kl"]) > 1e-6  # the masked-token prediction moved

    ablated = _view(client, interventions=[{"op": "ablate_heads", "layers": [0], "heads": [1, 2]}], compare=True)
    assert min(ablated["effect"]["hidden_cosine"][1:]) < 1 - 1e-6  # the layer's output (and all after it) changed

    weighted = _f32(_view(client, weighting="value_norm")["attention"])  # W_O found on out_lin
    assert np.allclose(weighted.sum(-1), 1, atol=1e-5) and not np.allclose(weighted, plain, atol=1e-3)

    shuffled = _f32(_view(client, interventions=[{"op": "positions", "mode": "off"}])["attention"])
    assert not np.allclose(shuffled, plain, atol=1e-3)
