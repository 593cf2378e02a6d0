"""The logit lens and value-weighted attention on tiny random models, each against an independent computation
from the model's own weights and hidden states (docs/science.md "Beyond attention weights")."""
from __future__ import annotations

import pytest
import torch

from models.adapters.bert import BertAdapter
from models.adapters.causal_lm import CausalLMAdapter
from models.attribution import run_value_norms, value_weighted
from models.interventions import Intervention
from models.lens import lens_logits, logit_lens, residual_stream
from tests.tiny_models import build_text_model

TEXT = "the cat sat on the mat because it was tired"


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def lm(request, tmp_path_factory) -> CausalLMAdapter:
    folder = build_text_model(request.param, tmp_path_factory.mktemp(request.param))
    return CausalLMAdapter(f"tiny-{request.param}", str(folder), device="cpu")


@pytest.fixture(scope="module")
def bert(tmp_path_factory) -> BertAdapter:
    return BertAdapter("tiny-bert", str(build_text_model("bert", tmp_path_factory.mktemp("bert"))), device="cpu")


def _ids(lm: CausalLMAdapter) -> torch.Tensor:
    return lm.encode(TEXT).inputs["input_ids"]  # (1, T)


def test_lens_last_layer_equals_the_model_logits(lm):
    ids = _ids(lm)
    with torch.no_grad():
        logits = lm.model(input_ids=ids).logits[0]  # (T, V), the model's own head on every position
    rows = torch.cat([chunk for _, chunk in lens_logits(lm, residual_stream(lm, ids))])  # (L, T, V)
    assert rows.shape[0] == lm.info.layers
    assert torch.allclose(rows[-1], logits, atol=1e-4)
    assert not torch.allclose(rows[0], logits, atol=1e-2)  # an early layer reads differently


def test_lens_middle_layer_is_the_final_norm_and_head_on_that_layer_output(lm):
    """transformers' hidden_states[l + 1] is layer l's output for l < L − 1 (the last one is already normed)."""
    ids = _ids(lm)
    with torch.no_grad():
        hidden = lm.model(input_ids=ids, output_hidden_states=True).hidden_states
        base = lm.model.base_model
        norm = getattr(base, "norm", None) or getattr(base, "ln_f")
        expected = lm.model.get_output_embeddings()(norm(hidden[1][0]))  # (T, V)
    rows = torch.cat([chunk for _, chunk in lens_logits(lm, residual_stream(lm, ids))])
    assert torch.allclose(rows[0], expected, atol=1e-4)


def test_lens_top_k_with_an_intervention_changes_only_from_its_layer_on(lm):
    ids = _ids(lm)
    before = logit_lens(lm, ids, top=3)
    after = logit_lens(lm, ids, (Intervention("ablate_heads", layers=(1,)),), top=3)
    assert before.ids.shape == (lm.info.layers, ids.shape[1], 3)
    assert torch.equal(before.ids[0], after.ids[0]) and torch.allclose(before.probs[0], after.probs[0])
    assert not torch.allclose(before.probs[1], after.probs[1])
    assert torch.all(before.probs[..., :-1] >= before.probs[..., 1:])  # sorted


def _direct_value_weighted_llama(lm: CausalLMAdapter, ids: torch.Tensor) -> torch.Tensor:
    """‖P[i, j] · v_j W_O^h‖ from the layer's own v_proj/o_proj and input norm, per (i, j), then row-normalised."""
    result = lm.run(lm.encode(TEXT))
    n_heads, head_dim = lm.info.heads, lm.info.head_dim
    with torch.no_grad():
        hidden = lm.model(input_ids=ids, output_hidden_states=True).hidden_states
        maps = []
        for l, layer in enumerate(lm.model.model.layers):
            x = layer.input_layernorm(hidden[l][0])  # (T, D)
            v = layer.self_attn.v_proj(x).view(x.shape[0], -1, head_dim).transpose(0, 1)  # (H_kv, T, d)
            v = v.repeat_interleave(n_heads // v.shape[0], dim=0)  # (H, T, d)
            w_o = layer.self_attn.o_proj.weight  # (D, H·d)
            heads = []
            for h in range(n_heads):
                contribution = v[h] @ w_o[:, h * head_dim:(h + 1) * head_dim].T  # (T, D): v_j W_O^h
                size = result.attention[l, h].unsqueeze(-1) * contribution.unsqueeze(0)  # (T_q, T_k, D)
                norms = size.norm(dim=-1)  # (T_q, T_k)
                heads.append(norms / norms.sum(-1, keepdim=True))
            maps.append(torch.stack(heads))
    return torch.stack(maps), result.attention


def test_value_weighted_rows_equal_a_direct_computation_llama(tmp_path_factory):
    folder = build_text_model("llama", tmp_path_factory.mktemp("llama-vn"))
    lm = CausalLMAdapter("tiny-llama", str(folder), device="cpu")
    encoded = lm.encode(TEXT)
    expected, attention = _direct_value_weighted_llama(lm, encoded.inputs["input_ids"])
    ours = value_weighted(attention, run_value_norms(lm, encoded))
    assert torch.allclose(ours, expected, atol=1e-5)
    assert torch.allclose(ours.sum(-1), torch.ones(ours.shape[:-1]), atol=1e-5)
    assert not torch.allclose(ours, attention, atol=1e-2)  # it is not P again


def test_value_weighted_rows_equal_a_direct_computation_bert(bert):
    encoded = bert.encode(TEXT)
    result = bert.run(encoded)
    n_heads, head_dim = bert.info.heads, bert.info.head_dim
    with torch.no_grad():
        hidden = bert.model(**encoded.inputs, output_hidden_states=True).hidden_states
        expected = []
        for l, layer in enumerate(bert.model.bert.encoder.layer):
            v = layer.attention.self.value(hidden[l][0]).view(-1, n_heads, head_dim).transpose(0, 1)  # (H, T, d)
            w_o = layer.attention.output.dense.weight  # (D, H·d)
            heads = []
            for h in range(n_heads):
                contribution = v[h] @ w_o[:, h * head_dim:(h + 1) * head_dim].T  # (T, D)
                norms = (result.attention[l, h].unsqueeze(-1) * contribution.unsqueeze(0)).norm(dim=-1)  # (T, T)
                heads.append(norms / norms.sum(-1, keepdim=True))
            expected.append(torch.stack(heads))
    ours = value_weighted(result.attention, run_value_norms(bert, encoded))
    assert torch.allclose(ours, torch.stack(expected), atol=1e-5)


def test_value_weighted_keeps_dead_rows_at_zero():
    probs = torch.tensor([[[0.5, 0.5], [0.0, 0.0]]])  # (H=1, 2, 2), the second row fully masked
    out = value_weighted(probs, torch.tensor([[1.0, 3.0]]))
    assert torch.allclose(out[0, 0], torch.tensor([0.25, 0.75])) and torch.equal(out[0, 1], torch.zeros(2))
