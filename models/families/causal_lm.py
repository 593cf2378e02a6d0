"""Decoder LMs (models/adapters/causal_lm.py): any architecture ending in ForCausalLM or LMHeadModel."""
from __future__ import annotations

from models.families.base import Family, generating_load


def adapter():
    from models.adapters.causal_lm import CausalLMAdapter

    return CausalLMAdapter


load = generating_load(adapter)


def describe(model_id, source, limits, dtype="float32"):
    from models.listing import describe_causal_lm

    return describe_causal_lm(model_id, source, limits.max_tokens, limits.max_new_tokens, dtype)


def recognises(config, source) -> bool:
    return any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in config.architectures or [])


FAMILY = Family(
    name="causal_lm", kind="text", what="decoder LMs (an architecture ending in ForCausalLM or LMHeadModel)",
    recognises=recognises, load=load, describe=describe, adapter=adapter)
