"""POST /api/text/score_stats on tiny random models (a BERT encoder and a Llama with GQA and RoPE): the variance and
mean against numpy's on q and k taken here independently, with hooks on transformers' own q/k projections (RoPE
applied with transformers' own function); the theory's formula; the entropies; the counting against the real
parameter shapes."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForMaskedLM, AutoTokenizer
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from fastapi.testclient import TestClient

from app.main import create_app
from app.settings import Settings
from tests.tiny_models import build_text_model

TEXT = "the cat sat on the mat because it was tired , the dog ran on the street"


@pytest.fixture(scope="module")
def folders_client(tmp_path_factory):
    families = {"tiny-bert": "bert", "tiny-llama": "llama", "tiny-bart": "bart"}
    folders = {name: str(build_text_model(family, tmp_path_factory.mktemp(family))) for name, family in families.items()}
    with TestClient(create_app(Settings(extra_models=folders, default_models=["tiny-bert"]))) as client:
        client.app.state.runtime.warm_up()
        yield client, folders


def stats(client, **body):
    return client.post("/api/text/score_stats", json={"text": TEXT, **body})


def captured(model, modules) -> dict[str, torch.Tensor]:
    """The outputs of `modules` ({name: module}) in one forward, by forward hooks."""
    out, handles = {}, []
    for name, module in modules.items():
        handles.append(module.register_forward_hook(lambda _m, _a, o, name=name: out.__setitem__(name, o.detach())))
    return out, handles


def bert_qk(folder: str, layer: int, head: int):
    model = AutoModelForMaskedLM.from_pretrained(folder, attn_implementation="eager").eval()
    ids = AutoTokenizer.from_pretrained(folder)(TEXT, return_tensors="pt")["input_ids"]
    attention = model.bert.encoder.layer[layer].attention.self
    out, handles = captured(model, {"q": attention.query, "k": attention.key})
    with torch.no_grad():
        model(input_ids=ids)
    for handle in handles:
        handle.remove()
    d = model.config.hidden_size // model.config.num_attention_heads
    q, k = (out[n][0, :, head * d:(head + 1) * d].double().numpy() for n in ("q", "k"))  # (T, d)
    return q, k, model


def llama_qk(folder: str, layer: int, head: int):
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    ids = AutoTokenizer.from_pretrained(folder)(TEXT, return_tensors="pt")["input_ids"]
    attention = model.model.layers[layer].self_attn
    out, handles = captured(model, {"q": attention.q_proj, "k": attention.k_proj})
    with torch.no_grad():
        model(input_ids=ids)
        for handle in handles:
            handle.remove()
        config = model.config
        d = config.head_dim if getattr(config, "head_dim", None) else config.hidden_size // config.num_attention_heads
        n = ids.shape[1]
        q = out["q"].view(1, n, -1, d).transpose(1, 2)  # (1, H, T, d)
        k = out["k"].view(1, n, -1, d).transpose(1, 2)  # (1, H_kv, T, d)
        cos, sin = model.model.rotary_emb(q, torch.arange(n)[None])
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
    rep = q.shape[1] // k.shape[1]
    return q[0, head].double().numpy(), k[0, head // rep].double().numpy(), model


@pytest.mark.parametrize("name,layer,head,causal", [("tiny-bert", 1, 2, False), ("tiny-llama", 1, 3, True)])
def test_variance_and_mean_equal_numpys_on_independently_taken_q_and_k(folders_client, name, layer, head, causal):
    client, folders = folders_client
    response = stats(client, model=name, layer=layer, head=head)
    assert response.status_code == 200, response.text
    body = response.json()
    q, k, _ = (llama_qk if causal else bert_qk)(folders[name], layer, head)
    scores = q @ k.T
    allowed = np.tril(np.ones_like(scores, dtype=bool)) if causal else np.ones_like(scores, dtype=bool)
    values = scores[allowed]
    assert len(body["tokens"]) == q.shape[0] and body["pairs"] == values.size
    assert body["variance"] == pytest.approx(np.var(values), rel=1e-5)
    assert body["mean"] == pytest.approx(np.mean(values), rel=1e-5, abs=1e-6)
    assert sum(body["histogram"]["counts"]) == values.size
    assert len(body["histogram"]["edges"]) == len(body["histogram"]["counts"]) + 1 == 41
    # the theory, from the fitted μ, σ by the formula stated in docs/science.md
    d, fit = q.shape[1], body["theory"]["fit"]
    assert fit["std_q"] == pytest.approx(q.std(), rel=1e-5) and fit["mean_k"] == pytest.approx(k.mean(), rel=1e-5, abs=1e-7)
    expected = d * (q.var() * k.var() + q.mean() ** 2 * k.var() + k.mean() ** 2 * q.var())
    assert body["theory"]["variance"] == pytest.approx(expected, rel=1e-5)
    assert body["theory"]["mean"] == pytest.approx(d * q.mean() * k.mean(), rel=1e-5, abs=1e-7)
    # entropy at 1/√d, by hand: softmax over the allowed keys of each row
    logits = np.where(allowed, scores / math.sqrt(d), -np.inf)
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    entropy = -np.where(allowed, p * np.log(np.where(p > 0, p, 1)), 0).sum(axis=1).mean()
    assert body["entropy"]["scale_inv_sqrt_d"] == pytest.approx(entropy, rel=1e-5)
    assert body["entropy"]["scale_1"] <= body["entropy"]["scale_inv_sqrt_d"] + 1e-9  # sharper without the scale


@pytest.mark.parametrize("name,causal", [("tiny-bert", False), ("tiny-llama", True)])
def test_counting_against_the_real_parameter_shapes(folders_client, name, causal):
    client, folders = folders_client
    body = stats(client, model=name, layer=0, head=0).json()
    _, _, model = (llama_qk if causal else bert_qk)(folders[name], 0, 0)
    config, counting = model.config, body["counting"]
    dim = config.hidden_size
    assert counting["textbook"] == {"weights": 4 * dim**2, "biases": 4 * dim, "qkv_weights": 3 * dim**2,
                                    "output_weights": dim**2}
    if causal:
        attention = model.model.layers[0].self_attn
        projections = [attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj]
        assert counting["kv_heads"] == config.num_key_value_heads < counting["heads"]
    else:
        attention = model.bert.encoder.layer[0].attention
        projections = [attention.self.query, attention.self.key, attention.self.value, attention.output.dense]
    assert counting["layer0"]["weights"] == sum(p.weight.numel() for p in projections)
    assert counting["layer0"]["biases"] == sum(p.bias.numel() for p in projections if p.bias is not None)
    n = len(body["tokens"])
    assert body["maps"]["per_head"] == n * n
    assert body["maps"]["allowed_per_head"] == (n * (n + 1) // 2 if causal else n * n)


@pytest.mark.parametrize("body,field", [
    ({"model": "tiny-bert", "layer": 9, "head": 0}, "layer"),
    ({"model": "tiny-bert", "layer": 0, "head": 99}, "head"),
    ({"model": "tiny-bert", "layer": 0, "head": 0, "bins": 1}, "bins"),
    ({"model": "tiny-bert", "layer": -1, "head": 0}, "layer"),
    ({"model": "tiny-bart", "layer": 0, "head": 0}, "model"),
    ({"model": "tiny-bert", "layer": 0, "head": 0, "text": "   "}, "text"),
    ({"model": "nope", "layer": 0, "head": 0}, "model"),
])
def test_bad_request_is_422_naming_the_field(folders_client, body, field):
    client, _ = folders_client
    response = client.post("/api/text/score_stats", json={"text": TEXT, **body})
    assert response.status_code == 422, response.text
    assert field in response.text


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-bart"])
def test_permutation_check_refuses_decoders_and_encoder_decoders(folders_client, name):
    client, _ = folders_client
    response = client.post("/api/text/permutation_check", json={"model": name, "text": TEXT})
    assert response.status_code == 422, response.text
    assert "model" in response.text


def test_positions_op_on_a_decoder_and_refused_for_an_encoder_decoder(folders_client):
    client, _ = folders_client
    body = {"model": "tiny-llama", "text": TEXT, "layers": [0], "heads": [0]}
    plain = client.post("/api/text/attention", json=body).json()
    off = client.post("/api/text/attention", json={**body, "interventions": [{"op": "positions", "mode": "off"}]})
    assert off.status_code == 200, off.text
    assert np.abs(np.array(off.json()["attention"]) - np.array(plain["attention"])).max() > 1e-3
    refused = client.post("/api/text/attention", json={"model": "tiny-bart", "text": TEXT,
                                                       "interventions": [{"op": "positions", "mode": "off"}]})
    assert refused.status_code == 422, refused.text
    assert "op" in refused.text and "encoder–decoder" in refused.text
