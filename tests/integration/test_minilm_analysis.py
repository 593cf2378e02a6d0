"""What applies to an encoder on the real all-MiniLM-L6-v2: value-weighted maps (the [CLS]/[SEP] sinks that P
overstates shrink) and the faithfulness check against its own sentence embedding."""
from __future__ import annotations

import pytest
import torch

from models.adapters.bert import BertAdapter, minilm_source
from models.attribution import run_value_norms, value_weighted
from models.faithfulness import faithfulness

SENTENCE = "The animal did not cross the street because it was too tired."


@pytest.fixture(scope="module")
def minilm():
    return BertAdapter("minilm", minilm_source(), device="cpu")


def test_value_weighting_shrinks_the_special_token_sinks(minilm):
    encoded = minilm.encode(SENTENCE)
    result = minilm.run(encoded)
    weighted = value_weighted(result.attention, run_value_norms(minilm, encoded))  # (L, H, T, T)
    assert torch.allclose(weighted.sum(-1), torch.ones(weighted.shape[:-1]), atol=1e-5)
    specials = [0, len(encoded.tokens) - 1]  # [CLS] and [SEP]
    p_share = float(result.attention[..., specials].sum(-1).mean())
    v_share = float(weighted[..., specials].sum(-1).mean())
    print(f"mean share of [CLS]+[SEP]: P {p_share:.3f}, value-weighted {v_share:.3f}")
    assert v_share < p_share - 0.05


def test_faithfulness_against_the_sentence_embedding(minilm):
    encoded = minilm.encode(SENTENCE)
    found = faithfulness(minilm, encoded, 0, [1, 2, 4, 8], ["attention", "value_norm", "rollout", "grad_attention"])
    for name, method in found["methods"].items():
        assert sorted(method["keys"]) == list(range(len(encoded.tokens)))
        assert all(0 <= c < 1 for c in method["change"]), (name, method["change"])
        print(name, [round(c, 4) for c in method["change"]])
    # masking more keys moves the embedding more, for the raw-attention ranking at least
    assert found["methods"]["attention"]["change"][-1] > found["methods"]["attention"]["change"][0]
