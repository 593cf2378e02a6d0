"""The real default text model (all-MiniLM-L6-v2 from its PyPI package)."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModel

from models.adapters.bert import BertAdapter, minilm_source
from models.effects import attention_tv
from models.interventions import Intervention

SENTENCES = [
    "A quick brown fox jumps over the lazy dog near the riverbank.",
    "Attention is all you need, said the paper; the reviewers were unconvinced!",
    "Ünïcödé and emoji 🙂 survive tokenisation?",
]


@pytest.fixture(scope="module")
def minilm():
    return BertAdapter("minilm", minilm_source(), device="cpu")


@pytest.fixture(scope="module")
def eager():
    return AutoModel.from_pretrained(minilm_source(), attn_implementation="eager").eval()


@pytest.mark.parametrize("sentence", SENTENCES)
def test_no_intervention_equals_eager_attention(minilm, eager, sentence):
    encoded = minilm.encode(sentence)
    result = minilm.run(encoded)
    with torch.no_grad():
        ref = eager(**encoded.inputs, output_attentions=True, output_hidden_states=True)
    assert result.attention.shape == (6, 12, len(encoded.tokens), len(encoded.tokens))
    assert float((result.attention - torch.stack([a[0] for a in ref.attentions])).abs().max()) < 1e-4
    assert float((result.hidden_states[-1] - ref.hidden_states[-1][0]).abs().max()) < 1e-4


def test_sentence_similarity_is_sensible(minilm):
    close = minilm.encode("A man is playing a guitar.", "Someone plays an instrument.")
    far = minilm.encode("A man is playing a guitar.", "The stock market fell sharply today.")
    sim = lambda e: minilm.output_effect(minilm.run(e), minilm.run(e), e)["similarity_before"]  # noqa: E731
    assert sim(close) > sim(far) + 0.2


def test_scoped_beta_changes_only_downstream_layers(minilm):
    encoded = minilm.encode(SENTENCES[0])
    base = minilm.run(encoded)
    run = minilm.run(encoded, (Intervention("temperature", beta=2.0, layers=(3,)),))
    tv = attention_tv(run.attention, base.attention)
    assert float(tv[:3].max()) == 0.0
    assert float(tv[3].min()) > 0 and float(tv[4:].max()) > 0


def test_very_long_text_truncates_at_512(minilm):
    encoded = minilm.encode("word " * 5000)
    assert encoded.truncated and len(encoded.tokens) == 512
    result = minilm.run(encoded, (Intervention("mask_keys", tokens=(0, 511)),))
    assert torch.all(result.attention[..., 511] == 0)
    assert torch.allclose(result.attention.sum(-1), torch.ones(6, 12, 512), atol=1e-5)
