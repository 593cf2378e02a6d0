"""Head patching over a set of prompt pairs and the attribution estimates beside it (models/patching_set.py), on tiny
random decoders: the set's mean is the mean of single-pair scans, the estimates keep their stated relations, and
AtP*'s recomputed softmax beats the linear one where attention saturates."""
from __future__ import annotations

import pytest
import torch

from models.adapters.causal_lm import CausalLMAdapter
from models.patching import Pair, attribution_scan, baseline, head_scan
from models.patching_set import (
    agreement, head_estimates, mean_and_spread, pair_estimates, recorded_states, set_scan, top_k_overlap,
)
from tests.tiny_models import build_text_model

PAIRS = [("the cat sat on the mat", "the dog ran on the rug"),
         ("a red car was big", "a blue tree was small"),
         ("the capital of france is", "the capital of it is")]


def _pairs(lm: CausalLMAdapter, answer: str = "tired", wrong: str = "house") -> list[Pair]:
    vocab = lm.tokenizer.get_vocab()
    ids = lambda text: torch.tensor([lm.prompt_ids(text)])  # noqa: E731
    return [Pair(ids(c), ids(x), vocab[answer], vocab[wrong]) for c, x in PAIRS]


@pytest.fixture(scope="module")
def lm(tmp_path_factory) -> CausalLMAdapter:
    return CausalLMAdapter("tiny-llama", str(build_text_model("llama", tmp_path_factory.mktemp("llama"))), device="cpu")


@pytest.fixture(scope="module")
def saturated(tmp_path_factory) -> CausalLMAdapter:
    """A tiny llama whose last layer has W_Q and W_K scaled ×8: its scores ×64, so its attention rows are one-hot.
    After that layer come only the final norm and the unembedding, so an estimate's error on its heads is the
    error through the head itself."""
    adapter = CausalLMAdapter("tiny-saturated", str(build_text_model("llama", tmp_path_factory.mktemp("sat"), seed=5)),
                              device="cpu")
    with torch.no_grad():
        attention = adapter.model.model.layers[-1].self_attn
        attention.q_proj.weight.mul_(8.0)
        attention.k_proj.weight.mul_(8.0)
    return adapter


def test_the_set_mean_is_the_mean_of_single_pair_scans_exactly(lm):
    pairs = _pairs(lm)
    seen = []
    scans = set_scan(lm, pairs, batch_tokens=24, progress=lambda done, total: seen.append((done, total)))
    singles = []
    for pair in pairs:
        base = baseline(lm, pair)
        singles.append(head_scan(lm, pair, base, batch=max(1, 24 // pair.clean.shape[1])))
    for scan, single in zip(scans, singles):
        assert torch.equal(scan.effect, single)
    mean, spread = mean_and_spread([s.effect for s in scans])
    assert torch.equal(mean, torch.stack(singles).mean(dim=0))
    assert torch.allclose(spread, torch.stack(singles).std(dim=0), atol=0)
    assert spread.abs().sum() > 0  # the pairs differ
    n_cells = lm.info.layers * lm.info.heads
    assert seen[-1] == ((n_cells + 1) * len(pairs), (n_cells + 1) * len(pairs))
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)


def test_head_output_estimate_is_the_single_scans_attribution_and_atp_star_differs_by_the_cross_term(lm):
    pair = _pairs(lm)[0]
    base = baseline(lm, pair)
    estimates = pair_estimates(lm, pair, base)
    assert torch.equal(estimates["head_output"], attribution_scan(lm, pair, base))
    # head_output − atp_star = g · (ΔA Δv) per head, computed here from the recorded runs by hand
    clean, _ = recorded_states(lm, pair.clean)
    corrupt, _ = recorded_states(lm, pair.corrupt)
    from models.patching import _corrupt_gradients
    _, grads, _ = _corrupt_gradients(lm, pair, ())
    span = base.ld_clean - base.ld_corrupt
    for layer, (c, x, g) in enumerate(zip(clean, corrupt, grads)):
        cross = (g.double() * ((c.probs - x.probs) @ (c.values.double() - x.values.double()))).sum(dim=(-1, -2))
        gap = estimates["head_output"][layer].double() - estimates["atp_star"][layer].double()
        assert torch.allclose(gap, cross / span, atol=2e-4, rtol=1e-3)
        # the recorded outputs are A v: the probabilities rebuilt from the scores are the run's own
        assert torch.allclose(x.probs @ x.values.double(), x.outputs.double(), atol=1e-5)


def test_atp_and_atp_star_agree_where_the_attention_does_not_move():
    """A layer whose clean and corrupted attention are the same: both estimates are the value part alone."""
    torch.manual_seed(0)
    scores = torch.randn(2, 4, 4, dtype=torch.float64).tril() - torch.triu(torch.full((4, 4), float("inf")), 1)
    probs = torch.softmax(scores, dim=-1)
    from models.patching_set import LayerState
    clean = LayerState(torch.zeros(2, 4, 3), torch.randn(2, 4, 3), scores, probs)
    corrupt = LayerState(torch.zeros(2, 4, 3), torch.randn(2, 4, 3), scores, probs)
    out = head_estimates(clean, corrupt, torch.randn(2, 4, 3))
    assert torch.allclose(out["atp"], out["atp_star"], atol=1e-12)


def test_atp_star_is_closer_to_the_exact_effect_than_atp_where_the_softmax_saturates(saturated):
    pairs = _pairs(saturated)
    last = saturated.info.layers - 1
    states, _ = recorded_states(saturated, pairs[0].corrupt)
    assert float(states[last].probs.amax(dim=-1).mean()) > 0.99  # the constructed case: rows one-hot
    errors = {"atp": 0.0, "atp_star": 0.0}
    for scan in set_scan(saturated, pairs, batch_tokens=64):
        for name in errors:
            errors[name] += float((scan.estimates[name][last] - scan.effect[last]).abs().sum())
    # measured: atp 15.9, atp_star 2.2 (head_output 0.39) summed over the 3 pairs × 4 heads
    assert errors["atp_star"] < 0.5 * errors["atp"], errors


def test_agreement_numbers():
    exact = torch.tensor([[3.0, -2.0, 0.1], [0.0, 1.0, 0.2]])
    assert top_k_overlap(exact, exact * 2, 2) == 1.0
    assert top_k_overlap(exact, torch.tensor([[0.0, 0.0, 5.0], [4.0, 0.0, 0.0]]), 2) == 0.0
    same = agreement(exact, exact, 3)
    assert same["spearman"] == pytest.approx(1.0) and same["top_k_overlap"] == 1.0 and same["k"] == 3
    assert agreement(exact, -exact, 3)["spearman"] == pytest.approx(-1.0)


def test_a_set_stops_when_its_progress_raises(lm):
    """The job's Cancel: progress raises (the client left) and the scan stops there, the later pairs never run."""
    class Left(Exception):
        pass

    calls = []

    def progress(done, total):
        calls.append(done)
        raise Left

    with pytest.raises(Left):
        set_scan(lm, _pairs(lm), batch_tokens=24, progress=progress)
    assert calls == [24 // 8]  # the first batch of the first pair's heads (3 copies of the 8-token prompts)
