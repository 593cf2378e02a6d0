"""Issue 29: a model with local (sliding-window) and global layers through the API: GET /api/models reports its
layer_types and sliding_window, and windows (POST /api/runs/{id}/window) of a long run equal transformers' eager
attention, zero outside the band on the local layer. The tiny Gemma 3 of tests/tiny_models.py (window 8)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.api.helpers import TINY_ATLAS, tiny_lm_client
from tests.api.helpers import TINY_TEXT as TEXT
from tests.float32 import assert_close_f32, attention_terms
from tests.tiny_models import build_text_model


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    return build_text_model("gemma3", tmp_path_factory.mktemp("gemma3"))


@pytest.fixture(scope="module")
def client(gemma3, tmp_path_factory):
    # an empty weights folder: GET /api/models then loads only the tiny model and minilm, not prepared real ones
    empty = tmp_path_factory.mktemp("no-weights")
    with tiny_lm_client(gemma3, **TINY_ATLAS, max_window_cells=2000, weights_dir=str(empty)) as c:
        yield c


def test_models_list_layer_types_and_window(client):
    models = {m["id"]: m for m in client.get("/api/models", params={"kind": "text"}).json()["models"]}
    assert models["lm"]["layer_types"] == ["sliding", "full"] and models["lm"]["sliding_window"] == 8
    assert models["lm"]["model_type"] == "gemma3_text"
    minilm = models.get("minilm")
    assert minilm is None or "sliding_window" not in minilm  # not a decoder LM: no layer facts


def test_long_run_windows_equal_eager(client, gemma3):
    import transformers as tf

    response = client.post("/api/text/attention", json={"model": "lm", "text": TEXT})
    assert response.status_code == 200, response.text
    body = response.json()
    n = len(body["tokens"])
    assert body["attention"] is None and n > 3 * 8  # a long input: atlas, overview only
    eager = tf.AutoModelForCausalLM.from_pretrained(gemma3, attn_implementation="eager").eval()
    tokenizer = tf.AutoTokenizer.from_pretrained(gemma3)
    with torch.inference_mode():
        ids = tokenizer(TEXT, return_tensors="pt").input_ids
        assert ids.shape[1] == n
        weights = torch.stack(eager(input_ids=ids, output_attentions=True).attentions)[:, 0].numpy()  # (L, H, T, T)
    outside = np.subtract.outer(np.arange(n), np.arange(n)) >= 8  # keys a window or more behind the query
    for layer in range(2):
        for head in range(4):
            window = client.post(f"/api/runs/{body['run_id']}/window",
                                 json={"layer": layer, "head": head, "rows": [0, n], "cols": [0, n]})
            assert window.status_code == 200, window.text
            got = np.array(window.json()["attention"])
            assert_close_f32(got, weights[layer, head], attention_terms(eager.config, n), scale=1.0)  # tests/float32.py
            if layer == 0:  # local: nothing outside the band
                assert got[outside].max() == 0.0
            else:  # global: reaches past it
                assert got[outside].sum() > 0.0


def test_unprepared_gguf_models_are_refused_with_the_command(client):
    listed = {m["id"] for m in client.get("/api/models", params={"kind": "text"}).json()["models"]}
    for model, command in (("gemma3-270m", "make gemma3-270m"), ("qwen2.5-0.5b", "make qwen2.5-0.5b"),
                           ("qwen2.5-1.5b", "make qwen2.5-1.5b")):
        assert model not in listed
        response = client.post("/api/text/attention", json={"model": model, "text": "the cat sat"})
        assert response.status_code == 422, response.text
        assert command in response.text and "model" in response.text
