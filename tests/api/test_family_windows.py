"""Issue 29 item 5: the long path on the families people study, against transformers' eager attention through the API.
Windows (POST /api/runs/{id}/window), rows and the retrieval view's span mass (POST /api/runs/{id}/row) of a long run
(the atlas: q̂/k̂ kept, P rebuilt on demand) equal the eager attention weights of the same weights, on
- Gemma 3 with its real head layout: head_dim 256, 4 query heads sharing 1 K/V head, q/k norms, a sliding window (8)
  on the local layer and a global one;
- Qwen2 with 2 K/V heads and q/k/v biases (non-zero here: a fresh model's are zero, which would hide them).
Tiny random models (tests/tiny_models.py's tokenizer), so the test is fast."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.api.helpers import TINY_ATLAS, tiny_lm_client
from tests.api.helpers import TINY_TEXT

# twice: transformers 5 gives a qwen2 folder its Qwen2Tokenizer over the tiny vocabulary (fewer, coarser tokens)
TEXT = f"{TINY_TEXT} {TINY_TEXT}"
from tests.float32 import assert_close_f32, attention_terms
from tests.tiny_models import CLS, PAD, SEP, save_tokenizer


def _gemma3(vocab: int):
    import transformers as tf

    config = tf.Gemma3TextConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
                                 sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                                 max_position_embeddings=128, pad_token_id=PAD, bos_token_id=CLS, eos_token_id=SEP,
                                 initializer_range=0.3)
    return tf.Gemma3ForCausalLM(config)


def _qwen2(vocab: int):
    import transformers as tf

    config = tf.Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                            pad_token_id=PAD, bos_token_id=CLS, eos_token_id=SEP, initializer_range=0.3)
    model = tf.Qwen2ForCausalLM(config)
    with torch.no_grad():
        biases = [m.bias for m in model.modules() if isinstance(m, torch.nn.Linear) and m.bias is not None]
        assert len(biases) == 6  # q, k, v of each layer
        for bias in biases:
            bias.normal_(0.0, 1.0)
    return model


BUILDERS = {"gemma3-hd256": _gemma3, "qwen2-biases": _qwen2}


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def family(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    vocab = save_tokenizer(folder)
    torch.manual_seed(0)
    model = BUILDERS[request.param](vocab).eval()
    model.save_pretrained(folder)
    eager = type(model).from_pretrained(folder, attn_implementation="eager").eval()
    empty = tmp_path_factory.mktemp("no-weights")  # no real weights listed beside the tiny model
    with tiny_lm_client(folder, **TINY_ATLAS, max_window_cells=20_000, weights_dir=str(empty)) as client:
        yield request.param, client, eager


def _eager_weights(eager, client, text: str) -> np.ndarray:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(eager.name_or_path)
    with torch.inference_mode():
        ids = tokenizer(text, return_tensors="pt").input_ids
        return torch.stack(eager(input_ids=ids, output_attentions=True).attentions)[:, 0].numpy()  # (L, H, T, T)


def test_windows_rows_and_span_mass_equal_eager(family):
    name, client, eager = family
    info = next(m for m in client.get("/api/models").json()["models"] if m["id"] == "lm")
    if name.startswith("gemma3"):
        assert (info["head_dim"], info["kv_heads"], info["sliding_window"]) == (256, 1, 8)
    else:
        assert (info["kv_heads"], info["model_type"]) == (2, "qwen2")
    response = client.post("/api/text/attention", json={"model": "lm", "text": TEXT})
    assert response.status_code == 200, response.text
    body = response.json()
    n = len(body["tokens"])
    assert body["attention"] is None and n > 3 * 8  # the long path: the run keeps its atlas
    weights = _eager_weights(eager, client, TEXT)
    assert weights.shape[-1] == n
    terms = attention_terms(eager.config, n)  # probabilities (≤ 1) to float32 rounding: tests/float32.py
    for layer in range(2):
        for head in range(4):
            window = client.post(f"/api/runs/{body['run_id']}/window",
                                 json={"layer": layer, "head": head, "rows": [0, n], "cols": [0, n]})
            assert window.status_code == 200, window.text
            assert_close_f32(window.json()["attention"], weights[layer, head], terms, scale=1.0)
    # a row of every layer and head (the row plot) and the retrieval view's mass on a far span, without the row
    row, span = n - 1, [2, 10]
    rows = client.post(f"/api/runs/{body['run_id']}/row", json={"row": row})
    assert rows.status_code == 200, rows.text
    assert_close_f32(rows.json()["attention"], weights[:, :, row], terms, scale=1.0)
    mass = client.post(f"/api/runs/{body['run_id']}/row", json={"row": row, "span": span, "include_row": False})
    assert mass.status_code == 200, mass.text
    expected = weights[:, :, row, span[0]:span[1]].sum(-1)  # (L, H)
    assert np.abs(np.array(mass.json()["span_mass"]) - expected).max() <= 1e-5
    if name.startswith("gemma3"):  # the span is a window or more behind the last row: nothing on the local layer
        assert max(mass.json()["span_mass"][0]) == 0.0 and min(mass.json()["span_mass"][1]) > 0.0
