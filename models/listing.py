"""What GET /api/models says about a decoder LM before it is loaded: its facts from the folder's config.json,
tokenizer_config.json and prepared.json, no weights, no tokenizer, no probe.

Loading gemma3-270m takes its 1.1 GB of float32 weights, a 262k-token tokenizer and two probe forwards (one of 528
tokens past its window); a model list should not cost that. The facts read here equal what CausalLMAdapter reports
once the model is loaded (tests/unit/test_listing.py checks field by field), except what only a load can know: the
probe's `parity` and `dtype_parity`, absent until the model has been loaded (on its first use). A model that then
fails its probe is refused with the reason and left out of the list from then on.

No web imports.
"""
from __future__ import annotations

import json
from pathlib import Path

from models.adapters.base import ModelInfo
from models.gguf import read_prepared
from models.probe import layer_facts


def native_scale(config) -> float:
    """The model's own β₀ from its config, as the families' attention modules set `scaling`: Gemma 2/3 scale by
    query_pre_attn_scalar^-½, GPT-2 without scale_attn_weights not at all, every other family by head_dim^-½."""
    if getattr(config, "scale_attn_weights", True) is False:
        return 1.0
    scalar = getattr(config, "query_pre_attn_scalar", None)
    if scalar:
        return float(scalar) ** -0.5
    return float(head_dim_of(config)) ** -0.5


def head_dim_of(config) -> int:
    n_heads = getattr(config, "num_attention_heads", None) or config.n_head
    return getattr(config, "head_dim", None) or config.hidden_size // n_heads


def has_chat_template(folder: Path) -> bool:
    """Whether the tokenizer that AutoTokenizer would load from `folder` has a chat template (its own file, or the
    template inside tokenizer_config.json), without loading the tokenizer."""
    if (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file():
        return True
    try:
        return bool(json.loads((folder / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, ValueError):
        return False


def describe_causal_lm(model_id: str, source: str, max_tokens: int, max_new_tokens: int,
                       dtype: str = "float32") -> ModelInfo | None:
    """The ModelInfo a decoder LM in the local folder `source` will have once loaded (without parity); None when
    `source` is not a local folder of a causal LM (a hub id: only a load reads it)."""
    folder = Path(source)
    if not (folder / "config.json").is_file():
        return None
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(folder)
    except (OSError, ValueError, KeyError):  # a config transformers cannot read: the load will say why
        return None
    # the class AutoModelForCausalLM will build, by name (no import of its modelling code: seconds for some families)
    names = getattr(getattr(AutoModelForCausalLM, "_model_mapping", None), "_model_mapping", None)
    architecture = names.get(config.model_type) if isinstance(names, dict) else None
    if not isinstance(architecture, str):
        return None  # only a load can say
    prepared = read_prepared(folder)
    n_heads = getattr(config, "num_attention_heads", None) or config.n_head
    context = getattr(config, "max_position_embeddings", max_tokens) or max_tokens
    return ModelInfo(
        id=model_id, kind="text", layers=int(getattr(config, "num_hidden_layers", None) or config.n_layer),
        heads=n_heads, head_dim=head_dim_of(config), native_beta=native_scale(config), output="next_token",
        source=folder.name, max_tokens=min(max_tokens, context),
        kv_heads=getattr(config, "num_key_value_heads", None) or n_heads, chat=has_chat_template(folder),
        max_new_tokens=max_new_tokens, architecture=architecture, dtype=dtype, model_type=config.model_type,
        origin=prepared.get("source"), licence=prepared.get("licence"), upstream=prepared.get("upstream"),
        **layer_facts(config),
    )
