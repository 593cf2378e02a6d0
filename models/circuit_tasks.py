"""Prompt pairs for circuits, built here with a seed (nothing downloaded), and the user's own pairs checked
(docs/science.md "Circuits through attention").

- ioi: Wang et al. 2022's indirect-object templates, "When Mary and John went to the store, John gave a drink to"
  → " Mary" (wrong " John"); the corrupt prompt swaps the subject ("…, Mary gave a drink to"). Names, places and
  objects are kept only when they are one token for this model's tokenizer, and only templates of one token count
  are used, so every pair has the same length.
- greater_than (Hanna et al. 2023): "The war lasted from the year 1732 to the year 17"; corrupt: the start year 1701.
  A tokenizer with two-digit tokens answers with YY+1 (wrong YY−1); one that splits digits (SmolLM2, Qwen2) answers
  the next digit: the tens digit of YY plus one (wrong: minus one), a year above YY (below it).
- induction: a random token sequence (seeded) repeated once: the answer is the token after the query's earlier copy;
  the corrupt prompt changes that token in the first copy (wrong: the changed token).
- capital: "The capital of France is" → " Paris" against "The capital of Italy is" → " Rome" (the README's pair
  first), then other countries whose capital is one token.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch

from models.patching import Pair, single_token

TASKS = ("ioi", "greater_than", "induction", "capital")

IOI_TEMPLATES = (
    "When {A} and {B} went to the {place}, {S} gave a {object} to",
    "After {A} and {B} went to the {place}, {S} gave a {object} to",
    "While {A} and {B} were working at the {place}, {S} gave a {object} to",
    "Then, {A} and {B} went to the {place}. {S} gave a {object} to",
    "When {A} and {B} got a {object} at the {place}, {S} decided to give it to",
)
NAMES = ("Mary", "John", "Tom", "James", "Dan", "Sid", "Martin", "Amy", "Lisa", "Michael", "Kate", "Anna", "Paul",
         "Mark", "Sarah", "Emma", "David", "Laura", "Alex", "Ben", "Jack", "Jane", "Rose", "Max", "Sam", "Lucy")
PLACES = ("store", "garden", "restaurant", "school", "hospital", "office", "station", "park", "house", "market")
OBJECTS = ("drink", "ring", "kiss", "bone", "book", "snack", "letter", "gift", "card", "ball")
NOUNS = ("war", "expedition", "siege", "journey", "reign", "strike", "drought", "festival", "voyage", "trial")
CAPITALS = (("France", "Paris"), ("Italy", "Rome"), ("Germany", "Berlin"), ("Spain", "Madrid"), ("Japan", "Tokyo"),
            ("Russia", "Moscow"), ("England", "London"), ("Egypt", "Cairo"), ("Greece", "Athens"),
            ("China", "Beijing"), ("Poland", "Warsaw"), ("Austria", "Vienna"), ("Ireland", "Dublin"),
            ("Portugal", "Lisbon"), ("Norway", "Oslo"), ("Canada", "Ottawa"), ("Sweden", "Stockholm"))
INDUCTION_LENGTH = 10


class PairError(ValueError):
    """A pair the circuit cannot take; `loc` names the request field, e.g. ("pairs", 0, "corrupt")."""

    def __init__(self, loc: tuple, message: str):
        super().__init__(message)
        self.loc = loc


@dataclass
class TaskPair:
    clean: str
    corrupt: str
    answer: str
    wrong: str
    pair: Pair

    def describe(self) -> dict[str, Any]:
        return {"clean": self.clean, "corrupt": self.corrupt, "answer": self.answer, "wrong": self.wrong,
                "tokens": int(self.pair.clean.shape[1])}


def _ids(adapter, text: str) -> list[int]:
    return list(adapter.prompt_ids(text))


def _one_token_words(tokenizer, words, space: str = " ") -> list[str]:
    return [w for w in words if single_token(tokenizer, space + w) is not None]


def _text_pair(adapter, clean: str, corrupt: str, answer: str, wrong: str) -> TaskPair | None:
    a, b = _ids(adapter, clean), _ids(adapter, corrupt)
    answer_id, wrong_id = single_token(adapter.tokenizer, answer), single_token(adapter.tokenizer, wrong)
    if len(a) != len(b) or answer_id is None or wrong_id is None or answer_id == wrong_id:
        return None
    return TaskPair(clean, corrupt, answer, wrong, Pair(torch.tensor([a]), torch.tensor([b]), answer_id, wrong_id))


def ioi_pairs(adapter, n: int, rng: random.Random) -> list[TaskPair]:
    tokenizer = adapter.tokenizer
    names, places = _one_token_words(tokenizer, NAMES), _one_token_words(tokenizer, PLACES)
    objects = _one_token_words(tokenizer, OBJECTS)
    if len(names) < 2 or not places or not objects:
        raise PairError(("task", "name"), "ioi: this model's tokenizer has too few one-token names, places or objects")
    fill = dict(A=names[0], B=names[1], S=names[1], place=places[0], object=objects[0])
    lengths = [len(_ids(adapter, t.format(**fill))) for t in IOI_TEMPLATES]
    templates = [t for t, length in zip(IOI_TEMPLATES, lengths) if length == lengths[0]]
    out = []
    for _ in range(50 * n):
        a, b = rng.sample(names, 2)
        slots = dict(A=a, B=b, place=rng.choice(places), object=rng.choice(objects))
        template = rng.choice(templates)
        made = _text_pair(adapter, template.format(S=b, **slots), template.format(S=a, **slots), " " + a, " " + b)
        if made is not None and made.pair.clean.shape[1] == lengths[0]:
            out.append(made)
        if len(out) == n:
            return out
    raise PairError(("task", "name"), f"ioi: only {len(out)} pairs of one token count could be built")


def greater_than_pairs(adapter, n: int, rng: random.Random) -> list[TaskPair]:
    tokenizer = adapter.tokenizer
    nouns = _one_token_words(tokenizer, NOUNS) or ["war"]
    two_digits = single_token(tokenizer, "32") is not None and single_token(tokenizer, "17") is not None
    out = []
    for _ in range(50 * n):
        noun, year = rng.choice(nouns), rng.randint(22, 87)
        template = "The {noun} lasted from the year 17{yy:02d} to the year 17"
        clean, corrupt = template.format(noun=noun, yy=year), template.format(noun=noun, yy=1)
        if two_digits:
            answer, wrong = f"{year + 1:02d}", f"{year - 1:02d}"
        else:
            answer, wrong = str(year // 10 + 1), str(year // 10 - 1)
        made = _text_pair(adapter, clean, corrupt, answer, wrong)
        if made is not None:
            out.append(made)
        if len(out) == n:
            return out
    raise PairError(("task", "name"), "greater_than: this model's tokenizer does not give one-token years or digits")


def induction_pairs(adapter, n: int, rng: random.Random) -> list[TaskPair]:
    tokenizer = adapter.tokenizer
    vocab = len(tokenizer)
    special = set(tokenizer.all_special_ids)
    low, high = min(1000, vocab // 4), max(vocab * 4 // 5, min(1000, vocab // 4) + 2 * INDUCTION_LENGTH)
    pool = [i for i in range(low, min(high, vocab)) if i not in special]
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    out = []
    for _ in range(n):
        tokens = rng.sample(pool, INDUCTION_LENGTH + 1)
        seq, other = tokens[:INDUCTION_LENGTH], tokens[INDUCTION_LENGTH]
        clean = bos + seq + seq[:-1]
        corrupt = bos + seq[:-1] + [other] + seq[:-1]
        pair = Pair(torch.tensor([clean]), torch.tensor([corrupt]), seq[-1], other)
        out.append(TaskPair(tokenizer.decode(clean), tokenizer.decode(corrupt), tokenizer.decode([seq[-1]]),
                            tokenizer.decode([other]), pair))
    return out


def capital_pairs(adapter, n: int, rng: random.Random) -> list[TaskPair]:
    known = [(c, k) for c, k in CAPITALS if single_token(adapter.tokenizer, " " + k) is not None]
    combos = [(a, b) for a in known for b in known if a != b]
    first = [(a, b) for a, b in combos if a[0] == "France" and b[0] == "Italy"]
    rest = [c for c in combos if c not in first]
    rng.shuffle(rest)
    out = []
    for (country, capital), (other, other_capital) in first + rest:
        made = _text_pair(adapter, f"The capital of {country} is", f"The capital of {other} is", " " + capital,
                          " " + other_capital)
        if made is not None:
            out.append(made)
        if len(out) == n:
            return out
    raise PairError(("task", "name"), f"capital: only {len(out)} pairs with one-token capitals for this tokenizer")


def task_pairs(adapter, name: str, n: int, seed: int) -> list[TaskPair]:
    """`n` seeded pairs of a built-in task (TASKS)."""
    builders = {"ioi": ioi_pairs, "greater_than": greater_than_pairs, "induction": induction_pairs,
                "capital": capital_pairs}
    if name not in builders:
        raise PairError(("task", "name"), f"unknown task {name!r}; one of {', '.join(TASKS)}")
    return builders[name](adapter, n, random.Random(seed))


def user_pairs(adapter, items: list[dict[str, str]], max_tokens: int) -> list[TaskPair]:
    """The user's pairs checked: prompts not empty and within `max_tokens`, clean and corrupt the same token count,
    answer and wrong one token each and different. PairError naming ("pairs", i, field) otherwise."""
    out = []
    for i, item in enumerate(items):
        ids = {}
        for side in ("clean", "corrupt"):
            if not item[side].strip():
                raise PairError(("pairs", i, side), f"pair {i}: {side} is empty or only white space")
            ids[side] = _ids(adapter, item[side])
            if len(ids[side]) > max_tokens:
                raise PairError(("pairs", i, side), f"pair {i}: {side} has {len(ids[side])} tokens; the limit is "
                                f"{max_tokens} (analysis_max_tokens)")
        if len(ids["clean"]) != len(ids["corrupt"]):
            raise PairError(("pairs", i, "corrupt"), f"pair {i}: clean has {len(ids['clean'])} tokens and corrupt "
                            f"{len(ids['corrupt'])}: the two prompts must have the same token count")
        answers = {}
        for side in ("answer", "wrong"):
            answers[side] = single_token(adapter.tokenizer, item[side])
            if answers[side] is None:
                count = len(adapter.tokenizer(item[side], add_special_tokens=False)["input_ids"])
                raise PairError(("pairs", i, side), f"pair {i}: {side} {item[side]!r} is {count} tokens; it must be "
                                "exactly one (e.g. with its leading space: ' Paris')")
        if answers["answer"] == answers["wrong"]:
            raise PairError(("pairs", i, "wrong"), f"pair {i}: wrong is the same token as answer")
        pair = Pair(torch.tensor([ids["clean"]]), torch.tensor([ids["corrupt"]]), answers["answer"], answers["wrong"])
        out.append(TaskPair(item["clean"], item["corrupt"], item["answer"], item["wrong"], pair))
    return out
