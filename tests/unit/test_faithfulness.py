"""The faithfulness check on tiny random models: ∂f/∂P from the head outputs equals autograd through transformers'
own eager attention, rankings follow the methods' scores, and each k's output change is that of masking those keys."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from models.adapters.bert import BertAdapter
from models.adapters.causal_lm import CausalLMAdapter
from models.effects import kl_divergence
from models.faithfulness import attention_gradients, chefer_relevance, faithfulness, ranked_keys
from models.interventions import Intervention
from tests.tiny_models import build_text_model

TEXT = "the cat sat on the mat because it was tired"


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    return build_text_model("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def lm(llama_folder) -> CausalLMAdapter:
    return CausalLMAdapter("tiny-llama", str(llama_folder), device="cpu")


def test_attention_gradients_equal_autograd_through_eager_attention(lm, llama_folder):
    encoded = lm.encode(TEXT)
    position, answer = len(encoded.tokens) - 1, 7
    ours = attention_gradients(lm, encoded, position, answer, {})  # (L, H, T, T)
    eager = AutoModelForCausalLM.from_pretrained(llama_folder, attn_implementation="eager").eval()
    out = eager(**encoded.inputs, output_attentions=True)
    for a in out.attentions:
        a.retain_grad()
    torch.log_softmax(out.logits[0, position], -1)[answer].backward()
    expected = torch.stack([a.grad[0] for a in out.attentions])
    assert torch.allclose(ours, expected, atol=1e-5)
    assert float(expected.abs().max()) > 1e-4  # not trivially zero


def test_chefer_relevance_by_hand():
    probs = torch.tensor([[[[1.0, 0.0], [0.5, 0.5]]]])  # (L=1, H=1, 2, 2)
    grads = torch.tensor([[[[2.0, 1.0], [-1.0, 4.0]]]])
    # Ā = (∇P ⊙ P)⁺ = [[2, 0], [0, 2]]; R = I + Ā I
    assert torch.allclose(chefer_relevance(probs, grads), torch.tensor([[3.0, 0.0], [0.0, 3.0]]))


def test_each_k_is_the_change_of_masking_that_methods_top_keys(lm):
    encoded = lm.encode(TEXT)
    position = len(encoded.tokens) - 1
    found = faithfulness(lm, encoded, position, [1, 2, 4], ["attention", "rollout", "value_norm", "grad_attention"])
    base = lm.run(encoded)
    p = lm.distribution(base, position)
    answer = found["answer"]["id"]
    assert answer == int(p.argmax())
    attention_scores = base.attention[:, :, position].mean(dim=(0, 1))
    assert found["methods"]["attention"]["keys"] == ranked_keys(attention_scores, position, causal=True)
    for name, method in found["methods"].items():
        assert len(method["kl"]) == 3 and all(kl >= 0 for kl in method["kl"])
        masked = lm.run(encoded, (Intervention("mask_keys", tokens=tuple(method["keys"][:2])),))
        q = lm.distribution(masked, position)
        assert method["kl"][1] == pytest.approx(kl_divergence(p, q), abs=1e-9)
        assert method["p_drop"][1] == pytest.approx(float(p[answer] - q[answer]), abs=1e-9)
        assert method["scores"] == sorted(method["scores"], reverse=True)


def test_encoder_gets_its_own_output_change(tmp_path_factory):
    bert = BertAdapter("tiny-bert", str(build_text_model("bert", tmp_path_factory.mktemp("bert"))), device="cpu")
    encoded = bert.encode("the cat sat on the [MASK] .")
    found = faithfulness(bert, encoded, 6, [1, 2], ["attention", "grad_attention"])
    assert set(found["methods"]) == {"attention", "grad_attention"}
    for method in found["methods"].values():
        assert sorted(method["keys"]) == list(range(len(encoded.tokens)))  # an encoder row sees every key
        assert all(v is not None and v >= 0 for v in method["kl"])


def test_attention_ranking_of_one_head_or_one_layer(lm):
    encoded = lm.encode(TEXT)
    position = len(encoded.tokens) - 1
    base = lm.run(encoded)
    one_head = faithfulness(lm, encoded, position, [1], ["attention"], layer=1, head=2)["methods"]["attention"]
    assert one_head["keys"] == ranked_keys(base.attention[1, 2, position], position, causal=True)
    one_layer = faithfulness(lm, encoded, position, [1], ["attention"], layer=0)["methods"]["attention"]
    assert one_layer["keys"] == ranked_keys(base.attention[0, :, position].mean(0), position, causal=True)
