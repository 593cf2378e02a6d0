"""What the decoder-LM analysis routes (patching, patching over a set, why?, head kinds) check alike: the model is
a decoder language model, a prompt's ids within analysis_max_tokens, an answer that is one token; and their answers'
nested lists with NaN as null. One module all of them import (routes do not import each other's helpers)."""
from __future__ import annotations

import torch

from app.deps import adapter_for
from app.errors import field_error
from app.runtime import Runtime
from models.adapters.base import AttentionAdapter
from models.adapters.causal_lm import CausalLMAdapter
from models.patching import single_token


def language_model(runtime: Runtime, model: str) -> CausalLMAdapter:
    adapter = adapter_for(runtime, model, "text")
    if not isinstance(adapter, CausalLMAdapter):
        raise field_error(("model",), f"model {model} is not a decoder language model (output {adapter.info.output!r})")
    return adapter


def prompt_ids(runtime: Runtime, adapter: AttentionAdapter, name: str, text: str) -> torch.Tensor:
    """A prompt's ids (1, T), within the token limit (its characters were checked by check_request_limits): 422
    naming the field otherwise."""
    if not text.strip():
        raise field_error((name,), f"{name} is empty or only white space")
    ids = adapter.prompt_ids(text)
    limit = runtime.settings.analysis_max_tokens
    if len(ids) > limit:
        raise field_error((name,), f"{name} has {len(ids)} tokens; the limit is {limit} (analysis_max_tokens)")
    return torch.tensor([ids])


def one_token(adapter: CausalLMAdapter, name: str, text: str) -> int:
    token = single_token(adapter.tokenizer, text)
    if token is None:
        count = len(adapter.tokenizer(text, add_special_tokens=False)["input_ids"])
        raise field_error((name,), f"{name} {text!r} is {count} tokens; it must be exactly one (e.g. with its "
                          "leading space: ' Paris')")
    return token


def finite_lists(tensor: torch.Tensor) -> list:
    """Nested lists with NaN as null (JSON has no NaN)."""
    return [[None if v != v else v for v in row] for row in tensor.tolist()]
