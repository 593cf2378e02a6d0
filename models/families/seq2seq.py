"""Encoder–decoders (models/adapters/seq2seq.py): attention per kind (encoder, decoder, cross)."""
from __future__ import annotations

from models.families.base import Family, generating_load
from models.interventions import OPS


def adapter():
    from models.adapters.seq2seq import Seq2SeqAdapter

    return Seq2SeqAdapter


load = generating_load(adapter)


def describe(model_id, source, limits, dtype="float32"):
    from models.listing import describe_seq2seq

    return describe_seq2seq(model_id, source, limits.max_tokens, limits.max_new_tokens, dtype)


FAMILY = Family(
    name="seq2seq", kind="text", what="encoder–decoders (is_encoder_decoder)",
    recognises=lambda config, source: bool(getattr(config, "is_encoder_decoder", False)),
    load=load, describe=describe, adapter=adapter,
    ops=tuple(op for op in OPS if op != "positions"),  # their positions are not hooked (models/positions.py)
    job="seq2seq", view="seq2seq")
