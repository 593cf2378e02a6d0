"""Each intervention as a pure function on random tensors, against the properties of SPEC §2–4."""
from __future__ import annotations

import math

import pytest
import torch

from models.interventions import Intervention, LayerCall, intervened_attention, noise_for, row_entropy
from models.recording import NOTHING, AttentionRecorder
from tests.float32 import assert_close_f32

B, H, T, D = 1, 3, 7, 8
BETA0 = D**-0.5


@pytest.fixture
def qkv():
    g = torch.Generator().manual_seed(1234)
    q = torch.randn(B, H, T, D, generator=g)
    k = torch.randn(B, H, T, D, generator=g)
    v = torch.randn(B, H, T, D, generator=g)
    return q, k, v


def run(qkv, *ivs, layer=0, allowed=None):
    q, k, v = qkv
    return intervened_attention(q, k, v, allowed, LayerCall(layer=layer, native_beta=BETA0, interventions=tuple(ivs)))


def test_no_intervention_is_scaled_dot_product_attention(qkv):
    q, k, v = qkv
    out, probs, scores, _ = run(qkv)
    expected = torch.softmax(q @ k.transpose(-1, -2) * BETA0, dim=-1)
    assert_close_f32(probs, expected, D + T, scale=1.0)  # q·k over D, then the softmax over T keys
    assert_close_f32(scores, q @ k.transpose(-1, -2), D)  # Ŝ is unscaled: a sum of D products
    assert torch.allclose(out, expected @ v, atol=1e-5)
    assert_close_f32(probs.sum(-1), torch.ones(B, H, T), T, scale=1.0)  # T probabilities summed


def test_large_beta_is_one_hot_on_the_largest_score(qkv):
    _, probs, scores, _ = run(qkv, Intervention("temperature", beta=1e4))
    argmax = scores.argmax(dim=-1)
    assert torch.allclose(probs.gather(-1, argmax.unsqueeze(-1)).squeeze(-1), torch.ones(B, H, T), atol=1e-3)
    out, _, _, _ = run(qkv, Intervention("temperature", beta=1e4))
    v = qkv[2]
    copied = torch.stack([v[0, h, argmax[0, h]] for h in range(H)])[None]  # the value vector of that key
    assert torch.allclose(out, copied, atol=1e-2)


def test_small_beta_is_uniform_over_unmasked_keys(qkv):
    _, probs, _, _ = run(qkv, Intervention("temperature", beta=1e-7), Intervention("mask_keys", tokens=(2, 5)))
    expected = torch.full((T,), 1 / (T - 2))
    expected[[2, 5]] = 0
    assert torch.allclose(probs, expected.expand_as(probs), atol=1e-5)


def test_entropy_falls_from_log_n_to_zero_as_beta_grows(qkv):
    entropies = [float(row_entropy(run(qkv, Intervention("temperature", beta=b))[1]).mean()) for b in (1e-6, 0.1, 1, 10, 1e4)]
    assert entropies[0] == pytest.approx(math.log(T), abs=1e-4)
    assert all(a >= b - 1e-6 for a, b in zip(entropies, entropies[1:]))
    assert entropies[-1] < 1e-2


def test_temperature_scoped_to_one_head_leaves_the_others(qkv):
    _, base, _, _ = run(qkv)
    _, probs, _, _ = run(qkv, Intervention("temperature", beta=5.0, heads=(1,)))
    assert torch.equal(probs[:, 0], base[:, 0]) and torch.equal(probs[:, 2], base[:, 2])
    assert not torch.allclose(probs[:, 1], base[:, 1])
    _, other_layer, _, _ = run(qkv, Intervention("temperature", beta=5.0, layers=(3,)), layer=0)
    assert torch.equal(other_layer, base)


def test_key_mask_zeroes_the_column_and_renormalises(qkv):
    _, base, _, _ = run(qkv)
    _, probs, _, _ = run(qkv, Intervention("mask_keys", tokens=(3,)))
    assert torch.all(probs[..., 3] == 0)
    kept = base.clone()
    kept[..., 3] = 0
    assert_close_f32(probs, kept / kept.sum(-1, keepdim=True), D + T, scale=1.0)  # q·k over D, softmax over T keys


def test_all_masked_rows_are_zero_not_nan_and_output_zero(qkv):
    out, probs, _, dead = run(qkv, Intervention("mask_keys", tokens=tuple(range(T)), heads=(0,)))
    assert not torch.isnan(probs).any() and not torch.isnan(out).any()
    assert torch.all(probs[:, 0] == 0) and torch.all(out[:, 0] == 0)
    assert dead[:, 0].all() and not dead[:, 1:].any()


def test_causal_mask_blocks_the_future(qkv):
    _, probs, _, _ = run(qkv, Intervention("causal"))
    assert torch.all(probs.triu(1) == 0)
    assert torch.allclose(probs[..., 0, 0], torch.ones(B, H))  # the first query can only see itself
    assert_close_f32(probs.sum(-1), torch.ones(B, H, T), T, scale=1.0)  # T probabilities summed


def test_model_padding_mask_applies(qkv):
    allowed = torch.ones(B, 1, T, T, dtype=torch.bool)
    allowed[..., 6] = False
    _, probs, _, _ = run(qkv, allowed=allowed)
    assert torch.all(probs[..., 6] == 0)


def test_ablation_zeroes_only_that_heads_output(qkv):
    base_out, base_p, _, _ = run(qkv)
    out, probs, _, _ = run(qkv, Intervention("ablate_heads", heads=(2,)))
    assert torch.all(out[:, 2] == 0)
    assert torch.equal(out[:, :2], base_out[:, :2]) and torch.equal(probs, base_p)


@pytest.mark.parametrize("scale,std", [(1.0, 0.7), (2.5, 0.0), (0.3, 1.5)])
def test_key_perturbation_changes_only_column_j_and_keeps_row_ratios(qkv, scale, std):
    j = 4
    _, base, base_s, _ = run(qkv)
    _, probs, scores, _ = run(qkv, Intervention("perturb_keys", tokens=(j,), noise_std=std, scale=scale, seed=7))
    others = [c for c in range(T) if c != j]
    assert torch.equal(scores[..., others], base_s[..., others])  # only column j of S moves: the rest is the same q·k
    # Ŝ[i, j] = α S[i, j] + q_i · ε with the seeded ε
    q = qkv[0]
    for h in range(H):
        eps = noise_for(7, 0, h, [j], D, std)[0]
        assert torch.allclose(scores[0, h, :, j], scale * base_s[0, h, :, j] + q[0, h] @ eps, atol=1e-5)
    ratio = probs[..., others] / base[..., others]  # the same for every k ≠ j in a row
    assert torch.allclose(ratio, ratio[..., :1].expand_as(ratio), rtol=1e-4)


def test_key_elongation_sharpens_by_the_sign_of_the_score(qkv):
    j = 2
    _, base, base_s, _ = run(qkv)
    _, probs, _, _ = run(qkv, Intervention("perturb_keys", tokens=(j,), scale=3.0))
    positive = base_s[..., j] > 0.5
    negative = base_s[..., j] < -0.5
    assert positive.any() and negative.any()
    assert torch.all(probs[..., j][positive] > base[..., j][positive])
    assert torch.all(probs[..., j][negative] < base[..., j][negative])


def test_query_perturbation_changes_only_row_i(qkv):
    i = 5
    _, base, base_s, _ = run(qkv)
    _, probs, scores, _ = run(qkv, Intervention("perturb_queries", tokens=(i,), noise_std=1.0, seed=3))
    rows = [r for r in range(T) if r != i]
    assert torch.equal(scores[..., rows, :], base_s[..., rows, :])
    assert torch.equal(probs[..., rows, :], base[..., rows, :])
    assert not torch.allclose(probs[..., i, :], base[..., i, :])


def test_noise_is_seeded_per_layer_and_head():
    a = noise_for(5, 1, 2, [0, 1, 2], D, 1.0)
    assert torch.equal(a, noise_for(5, 1, 2, [0, 1, 2], D, 1.0))
    assert not torch.equal(a, noise_for(6, 1, 2, [0, 1, 2], D, 1.0))
    assert not torch.equal(a, noise_for(5, 1, 1, [0, 1, 2], D, 1.0))
    assert not torch.equal(a, noise_for(5, 0, 2, [0, 1, 2], D, 1.0))
    assert float(noise_for(0, 0, 0, list(range(4000)), D, 2.0).std()) == pytest.approx(2.0, rel=0.05)


def test_noise_is_a_function_of_the_token_position_only():
    """ε_t does not depend on which other positions are drawn nor on the sequence length (SPEC §9: a token
    keeps its ε as a continuation grows)."""
    every = noise_for(3, 2, 1, list(range(200)), D, 1.0)  # (200, D), spans several blocks
    assert torch.equal(noise_for(3, 2, 1, [130], D, 1.0)[0], every[130])
    assert torch.equal(noise_for(3, 2, 1, [5, 70, 199], D, 1.0), every[[5, 70, 199]])
    assert not torch.equal(every[0], every[1])


def test_same_request_same_effect(qkv):
    iv = Intervention("perturb_keys", tokens=None, noise_std=0.5, seed=11)
    assert torch.equal(run(qkv, iv)[1], run(qkv, iv)[1])
    assert not torch.equal(run(qkv, iv)[1], run(qkv, iv.with_seed_offset(1))[1])


def test_bad_interventions_are_refused():
    with pytest.raises(ValueError):
        Intervention("sharpen")
    with pytest.raises(ValueError):
        Intervention("temperature", beta=float("nan"))
    with pytest.raises(ValueError):
        Intervention("temperature", beta=0.0)
    with pytest.raises(ValueError):
        Intervention("mask_keys")


@pytest.mark.parametrize("beta", [1e-3, 1.0, 30.0, 1e4])
def test_mean_row_entropy_without_a_log_per_entry_matches_the_definition(qkv, beta):
    """The recorded entropy (lse − Σ p z, one log per row) equals −Σ P log P, with masks and dead rows."""
    from models.interventions import mean_row_entropy

    q, k, _ = qkv
    logits = beta * BETA0 * (q @ k.transpose(-1, -2))  # (B, H, T, T)
    blocked = torch.zeros_like(logits, dtype=torch.bool)
    blocked[..., 3] = True  # a masked key
    blocked[0, 1, 2, :] = True  # a dead row: every key masked
    probs = torch.softmax(logits.masked_fill(blocked, float("-inf")), dim=-1).nan_to_num(0.0)
    expected = row_entropy(probs.double()).mean(dim=-1)  # (B, H)
    got = mean_row_entropy(logits, probs, blocked)
    assert got.shape == expected.shape
    assert torch.allclose(got.double(), expected, atol=1e-5), (got, expected)
    plain = torch.softmax(logits, dim=-1)
    assert torch.allclose(mean_row_entropy(logits, plain).double(), row_entropy(plain.double()).mean(dim=-1), atol=1e-5)


@pytest.mark.parametrize("ivs", [(), (Intervention("temperature", beta=2.0, heads=(1,)),),
                                 (Intervention("mask_keys", tokens=(0, 4)), Intervention("causal", heads=(0,)))])
def test_recording_into_buffers_and_skipping_scores_change_nothing(qkv, ivs):
    """The recording path (P and Ŝ written into preallocated buffers; β folded into the queries when Ŝ is
    not needed) gives the same outputs, P and Ŝ as the plain path."""
    q, k, v = qkv
    call = LayerCall(layer=0, native_beta=BETA0, interventions=ivs)
    out, probs, scores, dead = intervened_attention(q, k, v, None, call)
    probs_buf, scores_buf, entropy = torch.empty(2, *probs.shape), torch.empty(2, *probs.shape), torch.empty(B, H)
    recorder = AttentionRecorder(pattern=probs_buf[1], scores=scores_buf[1], entropy=entropy, qk=[], keep_scores=True)
    out2, probs2, scores2, dead2 = intervened_attention(q, k, v, None, call, recorder=recorder)
    assert probs2.data_ptr() == probs_buf[1].data_ptr() and scores2.data_ptr() == scores_buf[1].data_ptr()
    assert torch.equal(probs2, probs) and torch.equal(scores2, scores) and torch.equal(out2, out) and torch.equal(dead2, dead)
    assert torch.allclose(entropy.double(), row_entropy(probs.double()).mean(dim=-1), atol=1e-5)
    q_hat, k_hat = recorder.qk  # the queries and keys after perturbation: Ŝ = q̂ k̂ᵀ
    assert torch.equal(torch.matmul(q_hat, k_hat.transpose(-1, -2)), scores)
    out3, probs3, scores3, _ = intervened_attention(q, k, v, None, call, recorder=NOTHING)
    assert scores3 is None
    assert_close_f32(probs3, probs, D + T, scale=1.0)  # β folded into q: another rounding of q·k (D) and softmax (T)
    assert torch.allclose(out3, out, atol=1e-5)
