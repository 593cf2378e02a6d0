"""Head kinds (docs/science.md "Head kinds"): what each head of a decoder does, scored on seeded built-in probes.

Scores per head, each the mean over the query rows it applies to (so every one is a share of a row's attention, in
[0, 1], except the mean distance, in tokens):

- previous_token: P[i, i−1] over rows i ≥ 1;
- induction: on a row whose token occurred before, the mass on the key just after that earlier occurrence (on the
  repeated-random-tokens probe, BOS + n tokens + the same n again, that is P[i, i−n+1] over the second repeat:
  Olsson et al. 2022, "In-context learning and induction heads");
- duplicate_token: on a row whose token occurred before, the mass on the earlier positions holding the same token;
- sink: P[i, 0], the first token (Xiao et al. 2023, "attention sinks"); `sink_mass` of every run is the same number;
- retrieval: a fact hidden in a long filler of plain sentences, its key phrase asked again at the end: the model
  copies the answer back by greedy generation; a head's score is the share of generation steps whose top-attended key
  is the source of the token being copied, the same token in the fact (Wu et al. 2024,
  "Retrieval Head Mechanistically Explains Long-Context Factuality"); over their threshold 0.1 a head is listed among
  the retrieval heads, beside its label;
- mean_distance: Σ_j P[i, j]·|i − j| over rows, in tokens (docs/science.md §6, models/summaries.py).

A head's label is the kind (previous_token, induction, duplicate_token, sink) it scores highest at among those over
their thresholds (THRESHOLDS), else None. Scores come from the caller's `run(ids)`, which must answer the lab's own
P for those token ids (the server passes its cached runs), so a score is the number the lab shows for that head.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from models.summaries import mean_token_distance, sink_mass

# Over this score a head is of that kind. Scores are shares of a row's attention, so one scale serves every kind.
THRESHOLDS: dict[str, float] = {"previous_token": 0.5, "induction": 0.4, "duplicate_token": 0.4, "sink": 0.8}
# Over this retrieval score a head is listed as a retrieval head (Wu et al. 2024's threshold), beside its label: a head
# that copies at long range is usually an induction head too, and keeps that label
RETRIEVAL_THRESHOLD = 0.1
LABELLED_KINDS = tuple(THRESHOLDS)


@dataclass(frozen=True)
class ProbeSettings:
    """How the built-in probes are made; all of it is reported with the scores."""

    seed: int = 0
    period: int = 40  # n: random tokens in each repeat of the induction probe
    filler: int = 256  # random tokens the needle hides in
    needle: int = 8  # distinct random tokens of the needle, repeated at the end of the filler
    needles: int = 4  # retrieval: facts (RETRIEVAL_FACTS) hidden in `filler` tokens of sentences, copied back

    def describe(self) -> dict:
        return asdict(self)

    def fitted(self, n_candidates: int, max_tokens: int) -> "ProbeSettings":
        """The same probes shrunk to a small vocabulary or context (tiny test models); unchanged for real models."""
        period = max(1, min(self.period, n_candidates, (max_tokens - 1) // 2))
        needle = max(1, min(self.needle, period))
        filler = max(1, min(self.filler, n_candidates - needle, max_tokens - 1 - 2 * needle))
        return ProbeSettings(seed=self.seed, period=period, filler=filler, needle=needle, needles=self.needles)


def ordinary_token_ids(vocab_size: int, special_ids: Sequence[int]) -> list[int]:
    """Every token id of the model's vocabulary but the special ones (BOS, EOS, padding, chat markers)."""
    special = set(special_ids)
    return [i for i in range(vocab_size) if i not in special]


def repeated_tokens_probe(candidates: Sequence[int], first_id: int, period: int, seed: int) -> list[int]:
    """[first] + n distinct seeded random tokens + the same n again: 1 + 2n ids."""
    chosen = _draw(candidates, period, seed)
    return [first_id, *chosen, *chosen]


def needle_probe(candidates: Sequence[int], first_id: int, filler: int, needle: int, seed: int) -> tuple[list[int], int]:
    """[first] + filler with a needle of distinct tokens at a seeded place + the needle again.
    Returns the ids and the first row of the needle's repeat (where the recall rows start)."""
    drawn = _draw(candidates, filler + needle, seed + 1)  # distinct from each other: the needle occurs once before
    filler_ids, needle_ids = drawn[:filler], drawn[filler:]
    generator = torch.Generator().manual_seed(seed + 2)
    # the needle's place: not at the very start nor right before the repeat (so the recall reaches back)
    at = int(torch.randint(filler // 8, max(filler // 8 + 1, filler - filler // 8), (1,), generator=generator))
    body = filler_ids[:at] + needle_ids + filler_ids[at:]
    return [first_id, *body, *needle_ids], 1 + len(body)


# The retrieval probe's facts (a key phrase and the answer the model copies back) and the filler they hide in: plain
# sentences, so that a small model reads a fact and recalls it (a needle of random tokens is not copied back by
# smollm2-135m or gemma3-270m at all: measured 0 of 21 steps)
RETRIEVAL_FACTS = (
    ("The password for the archive is", " amber falcon lantern"),
    ("The name of the ship was", " Meridian Quill"),
    ("The code on the red box is", " 7391"),
    ("The guide who met us at the station was called", " Orla Brennick"),
)
RETRIEVAL_FILLER = (
    "The weather was mild for most of the week, with a light wind from the west.",
    "Markets opened slowly and traders waited for the morning reports.",
    "In the old town the bakery sold bread before sunrise.",
    "A narrow road follows the river past the mills and the church.",
    "The library keeps its maps in long drawers on the second floor.",
    "Trains to the coast leave every hour in the summer.",
    "Children planted beans in the school garden in spring.",
    "The museum closed early on Sundays during the winter months.",
)


def retrieval_probe(encode: Callable[[str], list[int]], first_id: int, filler: int, number: int, seed: int
                    ) -> tuple[list[int], dict[int, int], int]:
    """A fact hidden in about `filler` tokens of plain sentences (seeded order and depth), then its key phrase again,
    so that the model copies the answer back by generation (Wu et al. 2024's needle, in miniature). `encode(text)` →
    the model's token ids without special tokens. Returns the prompt ids, {answer token id: its source position in
    the fact (the first, if it occurs twice)}, and the steps to generate (the answer's tokens)."""
    key, answer = RETRIEVAL_FACTS[number % len(RETRIEVAL_FACTS)]
    generator = torch.Generator().manual_seed(seed * 1000 + number)
    sentences: list[int] = []
    while len(sentences) < filler:
        for i in torch.randperm(len(RETRIEVAL_FILLER), generator=generator).tolist():
            sentences += encode(" " + RETRIEVAL_FILLER[i])
    sentences = sentences[:filler]
    depth = int(torch.randint(len(sentences) // 8, max(len(sentences) // 8 + 1, len(sentences) * 7 // 8), (1,),
                              generator=generator))
    answer_ids = encode(answer)
    before = [first_id, *sentences[:depth], *encode(" " + key)]
    prompt = [*before, *answer_ids, *encode("."), *sentences[depth:], *encode(" " + key)]
    sources: dict[int, int] = {}
    for offset, token in enumerate(answer_ids):
        sources.setdefault(token, len(before) + offset)
    return prompt, sources, len(answer_ids)


def copy_hits(generated: Sequence[int], top_keys: torch.Tensor, sources: dict[int, int]) -> torch.Tensor:
    """Per head, how many generation steps copied a needle token from its source: the token generated at step s is a
    needle token and the head's top-attended key at step s (its query is the one that produced it) is that token's
    position in the needle. top_keys: (S, L, H) key indices → (L, H) counts."""
    hits = torch.zeros(top_keys.shape[1:], dtype=torch.float64)
    for step, token in enumerate(generated[: top_keys.shape[0]]):
        source = sources.get(int(token))
        if source is not None:
            hits += (top_keys[step] == source).double()
    return hits


def retrieval_scores(generate: Callable[[list[int], int], tuple[list[int], torch.Tensor]],
                     encode: Callable[[str], list[int]], first_id: int, settings: ProbeSettings,
                     progress: Callable[[], None] = lambda: None) -> tuple[torch.Tensor, dict]:
    """The retrieval score (after Wu et al. 2024) over settings.needles facts: copy hits / generation steps asked
    (a step not generated, after an early end of sequence, counts as no copy). `generate(prompt, steps)` → (generated
    ids, top-attended key per step, layer and head (S, L, H)). Returns ((L, H), what the probe was)."""
    hits, steps, copied, tokens = None, 0, 0, []
    for number in range(settings.needles):
        prompt, sources, n_steps = retrieval_probe(encode, first_id, settings.filler, number, settings.seed)
        generated, top_keys = generate(prompt, n_steps)
        found = copy_hits(generated, top_keys, sources)
        hits = found if hits is None else hits + found
        steps += n_steps
        expected = encode(RETRIEVAL_FACTS[number % len(RETRIEVAL_FACTS)][1])
        copied += sum(int(g == e) for g, e in zip(generated, expected))
        tokens.append(len(prompt))
        progress()
    described = {"threshold": RETRIEVAL_THRESHOLD, "needles": settings.needles, "filler": settings.filler, "prompt_tokens": tokens, "steps": steps,
                 "copied": copied / max(1, steps)}  # the share of steps whose token was the needle's next one
    return (hits / max(1, steps)).float(), described


def _draw(candidates: Sequence[int], count: int, seed: int) -> list[int]:
    if count > len(candidates):
        raise ValueError(f"the vocabulary has {len(candidates)} ordinary tokens, the probe needs {count}")
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(candidates), generator=generator)[:count]
    return [int(candidates[i]) for i in order]


def earlier_same_token(token_ids: Sequence[int]) -> torch.Tensor:
    """(T, T) bool: key j < i holds the same token as query i (the duplicate-token targets)."""
    ids = torch.tensor(list(token_ids))
    same = ids[:, None] == ids[None, :]  # (T, T)
    return same & torch.ones_like(same).tril(-1)


def induction_targets(token_ids: Sequence[int]) -> torch.Tensor:
    """(T, T) bool: key j follows an earlier occurrence of query i's token (ids[j−1] = ids[i], j−1 < i, j ≤ i)."""
    duplicate = earlier_same_token(token_ids)  # (T, T): [i, j−1]
    targets = torch.zeros_like(duplicate)
    targets[:, 1:] = duplicate[:, :-1]  # shift each earlier occurrence one key right: j−1 → j
    return targets


def previous_token_score(attention: torch.Tensor) -> torch.Tensor:
    """Mean of P[i, i−1] over rows i ≥ 1. (L, H, T, T) → (L, H)"""
    return attention.diagonal(offset=-1, dim1=-2, dim2=-1).double().mean(dim=-1).float()


def target_mass(attention: torch.Tensor, targets: torch.Tensor, rows: Sequence[int] | None = None) -> torch.Tensor | None:
    """Mean over `rows` (default: every row with a target) of the mass each row puts on its target keys; None when
    no row applies. (L, H, T, T), (T, T) bool → (L, H)"""
    if rows is None:
        rows = targets.any(dim=-1).nonzero()[:, 0].tolist()
    if not rows:
        return None
    index = torch.tensor(list(rows))
    picked = attention[:, :, index].double() * targets[index].to(attention.device)  # (L, H, r, T)
    return picked.sum(dim=-1).mean(dim=-1).float()


def scores_of(attention: torch.Tensor, token_ids: Sequence[int], induction_rows: Sequence[int] | None = None
              ) -> dict[str, torch.Tensor | None]:
    """Every score of one input's P (L, H, T, T) and its token ids; `induction_rows` limits the induction mean to
    those rows (the probe's second repeat). Each is (L, H), or None where no row applies."""
    return {
        "previous_token": previous_token_score(attention) if attention.shape[-1] > 1 else None,
        "induction": target_mass(attention, induction_targets(token_ids), induction_rows),
        "duplicate_token": target_mass(attention, earlier_same_token(token_ids)),
        "sink": sink_mass(attention),
        "mean_distance": mean_token_distance(attention),
    }


def label_heads(scores: dict[str, torch.Tensor | None], thresholds: dict[str, float] = THRESHOLDS) -> list[list[str | None]]:
    """[L][H]: the kind each head scores highest at among the kinds over their thresholds, else None."""
    kinds = [k for k in thresholds if scores.get(k) is not None]
    shape = next(scores[k] for k in kinds).shape
    labels: list[list[str | None]] = [[None] * shape[1] for _ in range(shape[0])]
    for layer in range(shape[0]):
        for head in range(shape[1]):
            over = [(float(scores[k][layer, head]), k) for k in kinds if float(scores[k][layer, head]) > thresholds[k]]
            labels[layer][head] = max(over)[1] if over else None
    return labels


def locality(layer_types: Sequence[str] | None, n_heads: int) -> list[list[str]] | None:
    """[L][H] "local" (a sliding-window or chunked layer) or "global", from the model's own layer types; None for a
    model without windowed layers."""
    if not layer_types or all(t == "full" for t in layer_types):
        return None
    return [["global" if t == "full" else "local"] * n_heads for t in layer_types]


def head_taxonomy(run: Callable[[list[int]], torch.Tensor], candidates: Sequence[int], first_id: int,
                  settings: ProbeSettings = ProbeSettings(), text_ids: Sequence[int] | None = None,
                  progress: Callable[[int, int], None] | None = None,
                  generate: Callable[[list[int], int], tuple[list[int], torch.Tensor]] | None = None,
                  encode: Callable[[str], list[int]] | None = None) -> dict:
    """Scores, labels and how they were made. `run(ids)` → the lab's P (L, H, T, T) for those token ids; `generate`
    (see retrieval_scores) the lab's greedy continuation with each step's top-attended keys.

    Without `text_ids`: the built-in probes (induction, previous-token, duplicate-token, sink and mean distance on the
    repeated random tokens; retrieval on the needles copied back by `generate`, when given). With `text_ids`: every
    score on that input alone (induction and duplicate-token over the rows whose token occurred before; None where no
    row does)."""
    def step(done: int, total: int) -> None:
        if progress is not None:
            progress(done, total)

    if text_ids is not None:
        step(0, 1)
        scores = scores_of(run(list(text_ids)), text_ids)
        step(1, 1)
        probe = {"kind": "text", "tokens": len(text_ids)}
    else:
        total = 1 + (settings.needles if generate is not None and encode is not None else 0)
        step(0, total)
        repeated = repeated_tokens_probe(candidates, first_id, settings.period, settings.seed)
        n = settings.period
        scores = scores_of(run(repeated), repeated, induction_rows=range(n + 1, 2 * n + 1))
        step(1, total)
        probe = {
            "kind": "builtin", **settings.describe(), "first_token_id": first_id,
            "repeated_tokens": {"tokens": len(repeated), "ids": repeated, "induction_rows": [n + 1, 2 * n]},
        }
        if generate is not None and encode is not None:
            done = [1]

            def needle_done() -> None:
                done[0] += 1
                step(done[0], total)

            scores["retrieval"], probe["needle"] = retrieval_scores(generate, encode, first_id, settings, needle_done)
    probe["thresholds"] = dict(THRESHOLDS)
    scores = {name: None if value is None else value.cpu() for name, value in scores.items()}  # one read each
    found = {"scores": scores, "labels": label_heads(scores), "probe": probe}
    if scores.get("retrieval") is not None:
        found["retrieval_heads"] = retrieval_heads(scores["retrieval"])
    return found


def retrieval_heads(scores: torch.Tensor, threshold: float = RETRIEVAL_THRESHOLD) -> list[dict]:
    """The heads whose retrieval score is over the threshold, highest first: [{"layer", "head", "score"}]."""
    over = [(float(v), layer, head) for layer, row in enumerate(scores.tolist()) for head, v in enumerate(row)
            if v > threshold]
    return [{"layer": layer, "head": head, "score": round(v, 6)} for v, layer, head in sorted(over, reverse=True)]
