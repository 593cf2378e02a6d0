"""models/head_kinds.py on hand-made attention (docs/science.md "Head kinds"): each score's targets, the probes'
layout, and labels by the stated thresholds."""
from __future__ import annotations

import torch

from models.head_kinds import (
    THRESHOLDS, ProbeSettings, earlier_same_token, head_taxonomy, induction_targets, label_heads, needle_probe,
    repeated_tokens_probe, scores_of,
)


def one_hot_rows(targets: list[int]) -> torch.Tensor:
    """P (T, T) whose row i puts all its mass on key targets[i]."""
    n = len(targets)
    return torch.nn.functional.one_hot(torch.tensor(targets), n).float()


def test_targets_of_a_repeated_sequence():
    ids = [0, 5, 6, 7, 5, 6, 7]  # BOS, then 5 6 7 twice
    assert earlier_same_token(ids).nonzero().tolist() == [[4, 1], [5, 2], [6, 3]]
    assert induction_targets(ids).nonzero().tolist() == [[4, 2], [5, 3], [6, 4]]  # the key after the earlier copy


def test_scores_of_pure_heads():
    ids = [0, 5, 6, 7, 5, 6, 7]
    n = len(ids)
    previous = one_hot_rows([0] + list(range(n - 1)))  # row i → i−1
    induction = one_hot_rows([0, 0, 0, 0, 2, 3, 4])  # second repeat → the key after its earlier copy
    duplicate = one_hot_rows([0, 0, 0, 0, 1, 2, 3])
    sink = one_hot_rows([0] * n)
    P = torch.stack([previous, induction, duplicate, sink])[None]  # (1, 4, T, T)
    scores = scores_of(P, ids, induction_rows=range(4, 7))
    # row 1's previous token is key 0, where the other heads park their first rows
    assert torch.allclose(scores["previous_token"][0], torch.tensor([1.0, 1 / 6, 1 / 6, 1 / 6]))
    assert torch.allclose(scores["induction"][0], torch.tensor([0.0, 1.0, 0.0, 0.0]))
    assert torch.allclose(scores["duplicate_token"][0], torch.tensor([0.0, 0.0, 1.0, 0.0]))
    assert torch.allclose(scores["sink"][0], torch.tensor([2 / 7, 4 / 7, 4 / 7, 1.0]))
    assert label_heads(scores) == [["previous_token", "induction", "duplicate_token", "sink"]]


def test_label_is_the_highest_kind_over_its_threshold():
    scores = {"previous_token": torch.tensor([[0.45, 0.6]]), "induction": torch.tensor([[0.41, 0.55]]),
              "duplicate_token": torch.tensor([[0.0, 0.0]]), "sink": torch.tensor([[0.79, 0.7]])}
    # head 0: sink 0.79 is under its 0.8, previous-token under 0.5: induction; head 1: previous-token beats induction
    assert THRESHOLDS["sink"] == 0.8
    assert label_heads(scores) == [["induction", "previous_token"]]
    assert label_heads({k: v * 0 for k, v in scores.items()}) == [[None, None]]


def test_probes_are_seeded_and_laid_out():
    candidates = list(range(10, 400))
    a, b = repeated_tokens_probe(candidates, 1, 40, 0), repeated_tokens_probe(candidates, 1, 40, 0)
    assert a == b and a[0] == 1 and a[1:41] == a[41:] and len(set(a[1:41])) == 40
    assert repeated_tokens_probe(candidates, 1, 40, 1) != a
    ids, recall_from = needle_probe(candidates, 1, 256, 8, 0)
    needle = ids[recall_from:]
    assert len(ids) == 1 + 256 + 16 and len(needle) == 8
    start = ids.index(needle[0])
    assert ids[start:start + 8] == needle and start < recall_from  # hidden once in the filler, then repeated


def test_taxonomy_runs_the_callers_model_on_both_probes():
    seen = []

    def run(ids):  # a stand-in model: every head is a previous-token head
        seen.append(list(ids))
        n = len(ids)
        return one_hot_rows([0] + list(range(n - 1)))[None, None].expand(2, 3, n, n)

    settings = ProbeSettings().fitted(n_candidates=30, max_tokens=64)
    out = head_taxonomy(run, list(range(3, 33)), 1, settings)
    assert [len(s) for s in seen] == [1 + 2 * settings.period]  # no generate given: no retrieval probe
    assert max(map(len, seen)) <= 64 and settings.period == 30
    assert out["labels"] == [["previous_token"] * 3] * 2
    assert out["probe"]["thresholds"] == THRESHOLDS and out["probe"]["seed"] == 0


def test_retrieval_counts_steps_whose_top_key_is_the_copied_tokens_source():
    """A stand-in model that copies the fact: head (0, 0) attends to each copied token's source, head (0, 1) to the
    key before it, head (1, 0) to the source only while the copy is right; the scores are the shares of steps."""
    from models.head_kinds import RETRIEVAL_FACTS, retrieval_probe, retrieval_scores

    words: dict[str, int] = {}

    def encode(text):  # a stand-in tokenizer: one id per word
        return [words.setdefault(w, 10 + len(words)) for w in text.replace(".", " .").split()]

    settings = ProbeSettings(filler=64, needles=2)

    def generate(prompt, steps):
        prompt_ids, sources, n_steps = retrieval_probe(encode, 1, 64, generate.calls, settings.seed)
        assert prompt == prompt_ids and len(prompt) > 64 and steps == n_steps
        answer = encode(RETRIEVAL_FACTS[generate.calls][1])
        assert [prompt[sources[t]] for t in answer] == answer  # each answer token's source holds it
        generate.calls += 1
        generated = answer[:1] + [0] * (steps - 1)  # copies the first token, then goes astray
        keys = torch.zeros(steps, 2, 2, dtype=torch.long)
        for s, token in enumerate(generated):
            source = sources.get(token, 0)
            keys[s, 0, 0], keys[s, 0, 1] = source, source - 1
            keys[s, 1, 0] = source if token in sources else 5
        return generated, keys

    generate.calls = 0
    scores, described = retrieval_scores(generate, encode, 1, settings)
    steps = sum(len(encode(answer)) for _, answer in RETRIEVAL_FACTS[:2])  # 3 + 2 answer words
    assert torch.allclose(scores, torch.tensor([[2 / steps, 0.0], [2 / steps, 0.0]]))
    assert described["steps"] == steps and described["copied"] == 2 / steps and described["needles"] == 2
