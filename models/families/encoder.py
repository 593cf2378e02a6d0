"""BERT-family encoders (models/adapters/bert.py): sentence encoders, masked LMs and plain backbones whose transformers
modules run attention through the AttentionInterface (the load-time probe checks it)."""
from __future__ import annotations

from models.families.base import Family

MODEL_TYPES = ("albert", "bert", "camembert", "electra", "roberta", "xlm-roberta")


def adapter():
    from models.adapters.bert import BertAdapter

    return BertAdapter


def load(model_id, source, limits, device, dtype="float32"):
    return adapter()(model_id, source, max_tokens=limits.max_tokens, device=device, dtype=dtype)


def describe(model_id, source, limits, dtype="float32"):
    from models.listing import describe_encoder

    return describe_encoder(model_id, source, limits.max_tokens, dtype)


FAMILY = Family(
    name="encoder", kind="text", what=f"BERT-family encoders ({', '.join(MODEL_TYPES)})",
    recognises=lambda config, source: config.model_type in MODEL_TYPES, load=load, describe=describe, adapter=adapter)
