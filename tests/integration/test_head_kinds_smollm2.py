"""Issue 30 item 2 on the real smollm2-135m: POST /api/text/head_scores finds the induction heads (layer 18 head 6,
L17 H3) and previous-token heads (L16 H0, L11 H1), with scores within 0.05 of the ones computed here with plain
transformers eager attention (output_attentions=True) on the probe the response reports, and labels them so.
The taxonomy is asked once per module (two runs of 81 and 273 tokens: ~10-25 s on a busy 2-core CPU)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from app.main import create_app
from app.settings import Settings
from tests.integration.helpers import SMOLLM2

INDUCTION_HEADS = [(18, 6), (17, 3)]
PREVIOUS_TOKEN_HEADS = [(16, 0), (11, 1)]


@pytest.fixture(scope="module")
def taxonomy():
    if not (SMOLLM2 / "prepared.json").is_file():
        pytest.fail("weights/smollm2-135m is missing: run `make weights`")
    with TestClient(create_app(Settings(default_models=["smollm2-135m"]))) as client:
        response = client.post("/api/text/head_scores", json={"model": "smollm2-135m", "text": None})
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture(scope="module")
def eager_probe_attention(taxonomy):
    """P (L, H, T, T) of the reported repeated-tokens probe from plain eager attention."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(SMOLLM2, attn_implementation="eager").eval()
    ids = taxonomy["probe"]["repeated_tokens"]["ids"]
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([ids]), output_attentions=True)
    return torch.stack(out.attentions)[:, 0].double().numpy()


def test_probe_is_bos_and_forty_seeded_tokens_repeated(taxonomy):
    probe = taxonomy["probe"]
    ids, n = probe["repeated_tokens"]["ids"], probe["period"]
    assert n == 40 and probe["seed"] == 0 and len(ids) == 81 and ids[1:41] == ids[41:]
    assert ids[0] == probe["first_token_id"] == 1  # smollm2's BOS, <|im_start|>


def test_induction_heads_match_eager_and_are_labelled(taxonomy, eager_probe_attention):
    n = taxonomy["probe"]["period"]
    rows = np.arange(n + 1, 2 * n + 1)  # the second repeat
    eager = eager_probe_attention[:, :, rows, rows - n + 1].mean(-1)  # (L, H): mean P[i, i − n + 1]
    ours = np.array(taxonomy["scores"]["induction"])
    for layer, head in INDUCTION_HEADS:
        assert abs(ours[layer, head] - eager[layer, head]) < 0.05
        assert ours[layer, head] > taxonomy["probe"]["thresholds"]["induction"]
        assert taxonomy["labels"][layer][head] == "induction"
    assert np.unravel_index(ours.argmax(), ours.shape) == INDUCTION_HEADS[0]


def test_previous_token_heads_match_eager_and_are_labelled(taxonomy, eager_probe_attention):
    eager = eager_probe_attention.diagonal(offset=-1, axis1=-2, axis2=-1).mean(-1)  # (L, H): mean P[i, i − 1]
    ours = np.array(taxonomy["scores"]["previous_token"])
    for layer, head in PREVIOUS_TOKEN_HEADS:
        assert abs(ours[layer, head] - eager[layer, head]) < 0.05
        assert taxonomy["labels"][layer][head] == "previous_token"
    top_two = {np.unravel_index(i, ours.shape) for i in np.argsort(ours, axis=None)[-2:]}
    assert top_two == set(PREVIOUS_TOKEN_HEADS)


def test_sink_and_distance_match_eager(taxonomy, eager_probe_attention):
    P = eager_probe_attention
    assert np.allclose(taxonomy["scores"]["sink"], P[..., 0].mean(-1), atol=1e-3)
    distance = np.abs(np.subtract.outer(np.arange(P.shape[-1]), np.arange(P.shape[-1])))
    assert np.allclose(taxonomy["scores"]["mean_distance"], (P * distance).sum(-1).mean(-1), atol=2e-2)


def test_retrieval_heads_copy_the_hidden_facts_back(taxonomy):
    """Issue 39: smollm2-135m writes every answer token of the four hidden facts, and the heads whose top-attended key
    is the copied token's source at most of those steps are the induction heads (L18 H6 at every step)."""
    needle = taxonomy["probe"]["needle"]
    assert needle["copied"] >= 0.9 and needle["steps"] >= 12
    listed = taxonomy["retrieval_heads"]
    assert (listed[0]["layer"], listed[0]["head"]) == INDUCTION_HEADS[0] and listed[0]["score"] >= 0.9
    top = {(h["layer"], h["head"]) for h in listed[:3]}
    assert INDUCTION_HEADS[1] in top
    scores = np.array(taxonomy["scores"]["retrieval"])
    assert {(h["layer"], h["head"]) for h in listed} == {tuple(int(i) for i in x) for x in np.argwhere(scores > 0.1)}
    assert taxonomy["labels"][18][6] == "induction"  # listed beside its label, which stays
