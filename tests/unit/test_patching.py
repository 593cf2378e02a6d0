"""Patching between two prompts on tiny random decoders (docs/science.md "Patching"), each against an independent
computation: an output projection whose input is replaced by a hook of the test's own, finite differences for
attribution patching, and the attention-only identity (every head patched = the clean run at the last position)."""
from __future__ import annotations

import pytest
import torch

from models.adapters.causal_lm import CausalLMAdapter
from models.head_ops import HeadRun, head_run
from models.interventions import Intervention
from models.patching import (
    Pair, attribution_scan, baseline, head_outputs, head_scan, last_logits, rank_correlation, residual_scan,
)
from tests.float32 import assert_close_f32
from tests.tiny_models import build_text_model

CLEAN, CORRUPT = "the cat sat on the mat", "the dog ran on the rug"


def _pair(lm: CausalLMAdapter, answer: str = "tired", wrong: str = "house") -> Pair:
    ids = lambda text: torch.tensor([lm.prompt_ids(text)])  # noqa: E731
    vocab = lm.tokenizer.get_vocab()
    return Pair(ids(CLEAN), ids(CORRUPT), vocab[answer], vocab[wrong])


@pytest.fixture(scope="module")
def lm(tmp_path_factory) -> CausalLMAdapter:
    return CausalLMAdapter("tiny-llama", str(build_text_model("llama", tmp_path_factory.mktemp("llama"))), device="cpu")


@pytest.fixture(scope="module")
def attention_only(tmp_path_factory) -> CausalLMAdapter:
    """The tiny llama with every MLP's output zeroed: the last position's residual stream is then its own embedding
    plus the heads' projected outputs, so patching every head makes it the clean run's there."""
    adapter = CausalLMAdapter("tiny-attn", str(build_text_model("llama", tmp_path_factory.mktemp("attn"), seed=3)),
                              device="cpu")
    with torch.no_grad():
        for layer in adapter.model.model.layers:
            layer.mlp.down_proj.weight.zero_()
    return adapter


def _patched_by_hand(lm: CausalLMAdapter, pair: Pair, base, heads: list[tuple[int, int]]) -> float:
    """LD of the corrupted run with the given (layer, head)s replaced at o_proj's input, by a pre-hook of our own."""
    d = lm.info.head_dim
    handles = []
    for l, layer in enumerate(lm.model.model.layers):
        mine = [h for (ll, h) in heads if ll == l]
        if not mine:
            continue

        def hook(_module, args, mine=mine, l=l):
            x = args[0].clone()  # (B, T, H·d)
            for h in mine:
                x[..., h * d:(h + 1) * d] = base.clean_outputs[l][h]  # (T, d)
            return (x,)
        handles.append(layer.self_attn.o_proj.register_forward_pre_hook(hook))
    try:
        logits = last_logits(lm, pair.corrupt)[0]
    finally:
        for handle in handles:
            handle.remove()
    return float(logits[pair.answer] - logits[pair.wrong])


def test_batched_head_scan_equals_patching_each_head_by_hand(lm):
    pair = _pair(lm)
    base = baseline(lm, pair)
    assert base.ld_clean != pytest.approx(base.ld_corrupt)
    effect = head_scan(lm, pair, base, batch=3)  # batches that cut across layers
    assert effect.shape == (lm.info.layers, lm.info.heads)
    for l in range(lm.info.layers):
        for h in range(lm.info.heads):
            expected = (_patched_by_hand(lm, pair, base, [(l, h)]) - base.ld_corrupt) / (base.ld_clean - base.ld_corrupt)
            assert float(effect[l, h]) == pytest.approx(expected, abs=1e-4)


def test_patch_heads_intervention_equals_the_same_patch_by_hand(lm):
    pair = _pair(lm)
    base = baseline(lm, pair)
    iv = Intervention("patch_heads", layers=(1,), heads=(0, 3), source="clean")
    with head_run(HeadRun(sources={"clean": base.clean_outputs})):
        logits = last_logits(lm, pair.corrupt, (iv,))[0]
    assert float(logits[pair.answer] - logits[pair.wrong]) == pytest.approx(
        _patched_by_hand(lm, pair, base, [(1, 0), (1, 3)]), abs=1e-5)


def test_patching_nothing_is_the_corrupted_run_and_every_head_the_clean_one(attention_only):
    lm = attention_only
    pair = _pair(lm)
    base = baseline(lm, pair)
    nothing = torch.zeros(1, lm.info.layers, lm.info.heads, dtype=torch.bool)
    logits = last_logits(lm, pair.corrupt, head=HeadRun(batch_heads=nothing, batch_source=base.clean_outputs))[0]
    assert torch.allclose(logits, last_logits(lm, pair.corrupt)[0], atol=0)
    assert float(base.effect(torch.tensor([logits[pair.answer] - logits[pair.wrong]]))) == pytest.approx(0.0, abs=1e-6)
    every = ~nothing
    patched = last_logits(lm, pair.corrupt, head=HeadRun(batch_heads=every, batch_source=base.clean_outputs))[0]
    assert torch.allclose(patched, last_logits(lm, pair.clean)[0], atol=1e-5)
    assert float(base.effect(torch.tensor([patched[pair.answer] - patched[pair.wrong]]))) == pytest.approx(1.0, abs=1e-4)
    # the same through the intervention op, with the source kept under an id
    with head_run(HeadRun(sources={"run": base.clean_outputs})):
        via_op = last_logits(lm, pair.corrupt, (Intervention("patch_heads", source="run"),))[0]
    assert torch.equal(via_op, patched)  # the same patched forward, reached through the op


def test_residual_scan_bounds_and_a_direct_patch(lm):
    pair = _pair(lm)
    base = baseline(lm, pair)
    effect = residual_scan(lm, pair, base, batch=5)
    n_tokens = pair.clean.shape[1]
    assert effect.shape == (lm.info.layers, n_tokens)
    # the last layer's output at the last position is everything the logits see: effect exactly 1
    assert float(effect[-1, -1]) == pytest.approx(1.0, abs=1e-4)
    # positions where both prompts hold the same token and nothing before differs: effect 0 at layer 0
    assert float(effect[0, 0]) == pytest.approx(0.0, abs=1e-5)


def test_attribution_equals_a_finite_difference_of_the_patch(lm):
    """effect_attr(l, h)·(LD_clean − LD_corrupt) = d/dε LD(H_corrupt + ε (H_clean − H_corrupt)) at ε = 0."""
    pair = _pair(lm)
    base = baseline(lm, pair)
    estimate = attribution_scan(lm, pair, base)  # (L, H)
    corrupt_outputs, _ = head_outputs(lm, pair.corrupt)
    eps = 1e-3
    for l, h in [(0, 1), (1, 2)]:
        blended = [c.clone() for c in corrupt_outputs]
        blended[l][h] = corrupt_outputs[l][h] + eps * (base.clean_outputs[l][h] - corrupt_outputs[l][h])
        chosen = torch.zeros(1, lm.info.layers, lm.info.heads, dtype=torch.bool)
        chosen[0, l, h] = True
        logits = last_logits(lm, pair.corrupt, head=HeadRun(batch_heads=chosen, batch_source=blended))[0]
        slope = (float(logits[pair.answer] - logits[pair.wrong]) - base.ld_corrupt) / eps
        assert float(estimate[l, h]) * (base.ld_clean - base.ld_corrupt) == pytest.approx(slope, rel=1e-2, abs=1e-3)


def test_mean_ablation_replaces_the_head_output_by_its_mean_over_positions(lm):
    pair = _pair(lm)
    outputs, _ = head_outputs(lm, pair.clean, (Intervention("ablate_heads", layers=(0,), heads=(2,), mode="mean"),))
    plain, _ = head_outputs(lm, pair.clean)
    mean = plain[0][2].mean(dim=0, keepdim=True).expand_as(plain[0][2])
    assert_close_f32(outputs[0][2], mean, plain[0][2].shape[0], scale=float(plain[0][2].abs().max()))  # over positions
    assert torch.equal(outputs[0][1], plain[0][1])
    zeroed, _ = head_outputs(lm, pair.clean, (Intervention("ablate_heads", layers=(0,), heads=(2,)),))
    assert torch.equal(zeroed[0][2], torch.zeros_like(zeroed[0][2]))


def test_rank_correlation_against_known_values():
    a = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert rank_correlation(a, a * 10 + 3) == pytest.approx(1.0)
    assert rank_correlation(a, -a) == pytest.approx(-1.0)
    assert rank_correlation(a, torch.tensor([1.0, 3.0, 2.0, 4.0])) == pytest.approx(0.8)  # 1 − 6·2/(4·15)


def test_attribution_patching_alone_equals_the_estimate_beside_the_exact_scan(lm):
    from models.patching import attribution_patching

    pair = _pair(lm)
    base = baseline(lm, pair)
    alone_base, alone = attribution_patching(lm, pair)
    assert alone_base.ld_clean == pytest.approx(base.ld_clean, abs=1e-5)
    assert alone_base.ld_corrupt == pytest.approx(base.ld_corrupt, abs=1e-5)
    assert torch.allclose(alone, attribution_scan(lm, pair, base), atol=1e-5)


def _residual_patch_run(lm: CausalLMAdapter, base, interventions: tuple[Intervention, ...], ids: torch.Tensor):
    """Last logits of `ids` with patch_residual interventions whose source "run" is the clean run's residual."""
    from models.anatomy import layer_blocks

    run = HeadRun(residual_sources={"run": base.clean_residual}, blocks=layer_blocks(lm.model, lm.layer_of))
    with head_run(run):
        return last_logits(lm, ids, interventions)[0]


def test_patch_residual_every_position_of_the_last_layer_is_the_clean_run(lm):
    pair = _pair(lm)
    base = baseline(lm, pair)
    last = lm.info.layers - 1
    patched = _residual_patch_run(lm, base, (Intervention("patch_residual", layers=(last,), source="run"),), pair.corrupt)
    clean = last_logits(lm, pair.clean)[0]
    assert torch.allclose(patched, clean, atol=1e-5)
    assert not torch.allclose(last_logits(lm, pair.corrupt)[0], clean, atol=1e-3)  # the two runs do differ
    # the kept residual is the clean run's own hidden states (after each layer), from an independent forward
    with torch.no_grad():
        hidden = lm.model(input_ids=pair.clean, output_hidden_states=True).hidden_states
    assert torch.equal(base.clean_residual[0], hidden[1][0])  # the same forward's states, kept
    # outside the context nothing is hooked: the same intervention list without its source in reach raises
    with pytest.raises(Exception):
        with head_run(HeadRun()):
            from models.head_ops import patch_residual
            patch_residual(torch.zeros(1, 2, 4), 0, [Intervention("patch_residual", source="gone")], {})


def test_patch_residual_of_one_cell_equals_the_residual_scan(lm):
    pair = _pair(lm)
    base = baseline(lm, pair)
    effect = residual_scan(lm, pair, base, batch=7)
    for layer, position in [(0, 1), (0, 3), (1, 2), (1, pair.clean.shape[1] - 1)]:
        iv = Intervention("patch_residual", layers=(layer,), tokens=(position,), source="run")
        logits = _residual_patch_run(lm, base, (iv,), pair.corrupt)
        ld = torch.tensor([float(logits[pair.answer] - logits[pair.wrong])])
        assert float(base.effect(ld)) == pytest.approx(float(effect[layer, position]), abs=1e-4)
    # patching nothing (a position the source lacks) leaves the corrupted run as it was
    iv = Intervention("patch_residual", layers=(0,), tokens=(99,), source="run")
    assert torch.allclose(_residual_patch_run(lm, base, (iv,), pair.corrupt), last_logits(lm, pair.corrupt)[0], atol=0)


def test_attribution_patching_keeps_the_clean_residual_too(lm):
    from models.patching import attribution_patching

    pair = _pair(lm)
    alone_base, _ = attribution_patching(lm, pair)
    assert torch.allclose(alone_base.clean_residual, baseline(lm, pair).clean_residual, atol=1e-5)
