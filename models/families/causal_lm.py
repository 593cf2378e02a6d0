"""Decoder LMs (models/adapters/causal_lm.py): any architecture ending in ForCausalLM or LMHeadModel."""
from __future__ import annotations

from models.families.base import Family


def adapter():
    from models.adapters.causal_lm import CausalLMAdapter

    return CausalLMAdapter


def load(model_id, source, limits, device, dtype="float32"):
    return adapter()(model_id, source, max_tokens=limits.max_tokens, device=device,
                     max_new_tokens=limits.max_new_tokens, dtype=dtype)


def describe(model_id, source, limits, dtype="float32"):
    from models.listing import describe_causal_lm

    return describe_causal_lm(model_id, source, limits.max_tokens, limits.max_new_tokens, dtype)


def recognises(config, source) -> bool:
    return any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in config.architectures or [])


FAMILY = Family(
    name="causal_lm", kind="text", what="decoder LMs (an architecture ending in ForCausalLM or LMHeadModel)",
    recognises=recognises, load=load, describe=describe, adapter=adapter)
