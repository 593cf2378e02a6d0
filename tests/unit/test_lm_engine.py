"""Decoder semantics on tiny random models (SPEC §9): causal zeros, grouped-query scoping, ε per position,
and continuations with the KV cache equal to those without it, interventions included."""
from __future__ import annotations

import pytest
import torch

from models.adapters.causal_lm import CausalLMAdapter
from models.interventions import Intervention, LayerCall, intervened_attention
from tests.float32 import assert_close_f32
from tests.tiny_models import build_text_model

TEXT = "the cat sat on the mat because it was tired"


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> CausalLMAdapter:
    """Llama with grouped-query attention: 4 query heads share 2 K/V heads (heads 0–1 → K/V 0, 2–3 → K/V 1)."""
    return CausalLMAdapter("tiny-llama", str(build_text_model("llama", tmp_path_factory.mktemp("llama"))))


def test_decoder_attention_is_causal_exactly(llama):
    result = llama.run(llama.encode(TEXT))
    assert llama.info.kv_heads == 2 and llama.info.heads == 4
    future = torch.ones(result.attention.shape[-2:], dtype=torch.bool).triu(1)  # j > i
    assert torch.all(result.attention[..., future] == 0)  # exactly 0, not small
    assert torch.all(result.attention[..., ~future] > 0)  # every j ≤ i is seen: the mask is j ≤ i, not i ≤ j
    assert torch.allclose(result.attention.sum(-1), torch.ones(result.attention.shape[:-1]), atol=1e-5)


def test_key_perturbation_scoped_to_one_query_head_leaves_its_kv_partner_alone(llama):
    encoded = llama.encode(TEXT)
    base = llama.run(encoded)
    iv = Intervention("perturb_keys", layers=(0,), heads=(0,), tokens=(2,), noise_std=3.0, seed=1)
    after = llama.run(encoded, (iv,))
    layer0 = after.attention[0]
    assert not torch.allclose(layer0[0], base.attention[0][0])  # head 0 moved
    assert torch.equal(layer0[1], base.attention[0][1])  # head 1 shares K/V head 0 with it: untouched
    assert torch.equal(layer0[2:], base.attention[0][2:])


def test_query_perturbation_changes_only_its_row_at_that_layer(llama):
    encoded = llama.encode(TEXT)
    base = llama.run(encoded)
    iv = Intervention("perturb_queries", layers=(1,), heads=(3,), tokens=(5,), noise_std=2.0, seed=2)
    after = llama.run(encoded, (iv,))
    rows = [r for r in range(len(encoded.tokens)) if r != 5]
    assert torch.equal(after.attention[1, 3, rows], base.attention[1, 3, rows])
    assert not torch.allclose(after.attention[1, 3, 5], base.attention[1, 3, 5])


def test_causal_intervention_with_a_query_offset_blocks_only_the_future():
    """A decoding step sees queries from position `offset` on; the causal op must mask j > offset + i."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 7, 4), torch.randn(1, 2, 7, 4)
    call = LayerCall(layer=0, native_beta=0.5, interventions=(Intervention("causal"),), query_offset=4)
    _, probs, _, _ = intervened_attention(q, k, v, None, call)
    for i in range(3):
        assert torch.all(probs[0, :, i, 4 + i + 1:] == 0) and torch.all(probs[0, :, i, : 4 + i + 1] > 0)


INTERVENTIONS = {
    "none": (),
    "perturb": (Intervention("perturb_keys", tokens=(1, 3), noise_std=2.0, seed=4),
                Intervention("perturb_queries", tokens=None, noise_std=1.0, seed=5)),
    "beta+mask": (Intervention("temperature", beta=3.0, layers=(1,)), Intervention("mask_keys", tokens=(2,))),
}


@pytest.mark.parametrize("name", sorted(INTERVENTIONS))
def test_continuation_with_kv_cache_equals_the_one_without(llama, name):
    prompt = llama.prompt_ids(TEXT)
    cached = [(s.id, s.prob) for s in llama.continuation(prompt, INTERVENTIONS[name], 12, use_cache=True)]
    uncached = [(s.id, s.prob) for s in llama.continuation(prompt, INTERVENTIONS[name], 12, use_cache=False)]
    assert [i for i, _ in cached] == [i for i, _ in uncached]
    assert [p for _, p in cached] == pytest.approx([p for _, p in uncached], abs=1e-5)


def test_plain_continuation_matches_transformers_generate(llama):
    prompt = llama.prompt_ids(TEXT)
    ours = [s.id for s in llama.continuation(prompt, (), 12)]
    with torch.inference_mode():
        theirs = llama.model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, num_beams=1)[0]
    assert ours == theirs[len(prompt):].tolist()[: len(ours)]


def test_perturbation_changes_the_continuation(llama):
    prompt = llama.prompt_ids(TEXT)
    plain = [s.id for s in llama.continuation(prompt, (), 10)]
    hot = [s.id for s in llama.continuation(prompt, (Intervention("perturb_keys", noise_std=20.0, seed=3),), 10)]
    assert plain != hot


def test_next_token_effect_reports_kl_and_ranks(llama):
    encoded = llama.at_position(llama.encode(TEXT), None)
    before, after = llama.run(encoded), llama.run(encoded, (Intervention("temperature", beta=0.01),))
    effect = llama.output_effect(before, after, encoded)
    p, q = llama.distribution(before, encoded.extra["position"]), llama.distribution(after, encoded.extra["position"])
    assert effect["kl"] == pytest.approx(float((p * (p / q).log()).sum()), rel=1e-6) and effect["kl"] > 1e-3
    first = effect["top_before"][0]
    assert effect["prob_change"] == pytest.approx(float(q[first["id"]] - p[first["id"]]))
    assert first["rank_after"] == int((q > q[first["id"]]).sum())
    assert [t["prob"] for t in effect["top_after"]] == sorted((t["prob"] for t in effect["top_after"]), reverse=True)


def test_logits_from_kept_hidden_states_equal_the_models_at_every_position(llama):
    encoded = llama.encode(TEXT)
    result = llama.run(encoded)
    with torch.inference_mode():
        logits = llama.model(**encoded.inputs).logits[0].double()  # (T, V)
    for position in range(len(encoded.tokens)):
        # the logits sum over the hidden size, the softmax over the vocabulary: probabilities, at most 1
        terms = llama.model.config.hidden_size + logits.shape[-1]
        assert_close_f32(llama.distribution(result, position), torch.softmax(logits[position], -1), terms, scale=1.0)
