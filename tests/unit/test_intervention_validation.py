"""One intervention validator for every family (app/interventions.py): plain models, encoder–decoders and Whisper
refuse the same out-of-range layers, heads, keys and query rows the same way (a 422 naming
interventions[i].layers/heads/tokens), each counting keys and query rows per kind from its table."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import TypeAdapter

from app.interventions import WHISPER_POSITIONS, engine_interventions, seq2seq_interventions, whisper_interventions
from app.schemas import Interventions

LAYERS, HEADS = 3, 4
N_TOKENS, N_SOURCE, N_TARGET = 5, 6, 7


class FakeAdapter:
    """Only what the validator reads: `info`, and the kind-scoped translation into engine interventions."""

    def __init__(self, **info):
        self.info = SimpleNamespace(id="m", **info)

    def engine_interventions(self, scoped):
        return tuple(scoped)


def plain(items):
    return engine_interventions(_request(items), FakeAdapter(layers=LAYERS, heads=HEADS), N_TOKENS)


def seq2seq(items):
    adapter = FakeAdapter(layers=LAYERS, heads=HEADS, decoder_layers=LAYERS, decoder_heads=HEADS)
    return seq2seq_interventions(_request(items), adapter, N_SOURCE, N_TARGET)


def whisper(items):
    adapter = FakeAdapter(encoder_layers=LAYERS, decoder_layers=LAYERS, heads=HEADS)
    return whisper_interventions(_request(items), adapter, N_TARGET)


def _request(items):
    return SimpleNamespace(interventions=TypeAdapter(Interventions).validate_python(items))


def refusal(check, items) -> tuple[list, str]:
    with pytest.raises(RequestValidationError) as caught:
        check(items)
    error = caught.value.errors()[0]
    return list(error["loc"]), error["msg"]


# (family, kind to send, its key count, its query-row count): cross attention's keys are the encoder side (source
# tokens, Whisper's encoder positions), its query rows the decoder side (target tokens) in both encoder–decoders
CASES = [
    (plain, None, N_TOKENS, N_TOKENS),
    (seq2seq, "encoder", N_SOURCE, N_SOURCE),
    (seq2seq, "decoder", N_TARGET, N_TARGET),
    (seq2seq, "cross", N_SOURCE, N_TARGET),
    (whisper, "encoder", WHISPER_POSITIONS, WHISPER_POSITIONS),
    (whisper, "decoder", N_TARGET, N_TARGET),
    (whisper, "cross", WHISPER_POSITIONS, N_TARGET),
]
IDS = [f"{check.__name__}-{kind}" for check, kind, _, _ in CASES]


def _item(kind, **fields):
    return {**fields, **({"kind": kind} if kind else {})}


@pytest.mark.parametrize("check,kind,keys,queries", CASES, ids=IDS)
def test_keys_are_refused_from_the_key_count_on(check, kind, keys, queries):
    assert check([_item(kind, op="mask_keys", tokens=[0, keys - 1])])  # the last key is there
    loc, message = refusal(check, [_item(kind, op="mask_keys", tokens=[keys])])
    assert loc == ["body", "interventions", 0, "tokens"]
    assert f"[{keys}] out of range" in message and f"has {keys} " in message and f"(0..{keys - 1})" in message


@pytest.mark.parametrize("check,kind,keys,queries", CASES, ids=IDS)
def test_query_rows_are_refused_from_the_query_count_on(check, kind, keys, queries):
    assert check([_item(kind, op="perturb_queries", noise_std=1.0, tokens=[queries - 1])])
    loc, message = refusal(check, [_item(kind, op="perturb_queries", noise_std=1.0, tokens=[queries])])
    assert loc == ["body", "interventions", 0, "tokens"]
    assert f"[{queries}] out of range" in message and f"has {queries} " in message


@pytest.mark.parametrize("check,kind,keys,queries", CASES, ids=IDS)
@pytest.mark.parametrize("field,count", [("layers", LAYERS), ("heads", HEADS)])
def test_layers_and_heads_are_refused_from_the_count_on(check, kind, keys, queries, field, count):
    assert check([_item(kind, op="temperature", beta=1.0, **{field: [count - 1]})])
    loc, message = refusal(check, [_item(kind, op="temperature", beta=1.0, **{field: [count]})])
    assert loc == ["body", "interventions", 0, field]
    assert f"[{count}] out of range" in message and f"has {count} " in message


def test_the_refusal_names_the_intervention_that_does_not_fit():
    items = [{"op": "temperature", "beta": 1.0}, {"op": "mask_keys", "kind": "decoder", "tokens": [N_TARGET]}]
    assert refusal(seq2seq, items)[0] == ["body", "interventions", 1, "tokens"]
    assert refusal(whisper, items)[0] == ["body", "interventions", 1, "tokens"]
    assert refusal(plain, [items[0], {"op": "mask_keys", "tokens": [N_TOKENS]}])[0] == ["body", "interventions", 1, "tokens"]


def test_what_each_family_does_not_accept():
    # a plain model has one kind of attention
    assert refusal(plain, [{"op": "temperature", "beta": 1.0, "kind": "cross"}]) == (
        ["body", "interventions", 0, "kind"], "model m has one kind of attention; kind must be null")
    # an encoder–decoder checks kind-less tokens against the smallest kind, and says so
    loc, message = refusal(seq2seq, [{"op": "mask_keys", "tokens": [N_SOURCE]}])
    assert loc[-1] == "tokens" and "token (the smallest over kinds encoder/decoder/cross)" in message
    assert seq2seq([{"op": "mask_keys", "tokens": [N_SOURCE - 1]}])
    # Whisper's token numbers mean encoder positions or decoder tokens: tokens need a kind; no patch_heads
    assert refusal(whisper, [{"op": "mask_keys", "tokens": [0]}])[0][-1] == "kind"
    assert refusal(whisper, [{"op": "patch_heads", "source": "abcd." + "a" * 32}]) == (
        ["body", "interventions", 0, "op"], "patch_heads is not offered for speech models")
    # a plain model's patch source must be a kept run
    assert refusal(plain, [{"op": "patch_heads", "source": "abcd." + "a" * 32}])[0][-1] == "source"
