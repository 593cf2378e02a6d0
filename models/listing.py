"""What GET /api/models says about a decoder LM before it is loaded: its facts from the folder's config.json,
tokenizer_config.json and prepared.json, no weights, no tokenizer, no probe. The other families (encoders, ViTs,
encoder–decoders, Whisper) are described the same way at the end of this file: a listing loads no model.

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


# ---- the other families: what GET /api/models says before a load (issue 38 §7: a listing never loads a model) ----
def _class_name(auto_class, config) -> str | None:
    """The class `auto_class` would build for `config`, by name, without importing its modelling code."""
    names = getattr(getattr(auto_class, "_model_mapping", None), "_model_mapping", None)
    name = names.get(config.model_type) if isinstance(names, dict) else None
    return name if isinstance(name, str) else None


def _config(source: str):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(source)
    except (OSError, ValueError, KeyError):  # a config transformers cannot read: the load will say why
        return None


def describe_encoder(model_id: str, source: str, max_tokens: int, dtype: str = "float32") -> ModelInfo | None:
    """A BERT-family encoder as models/adapters/bert.py will report it (without parity): its output kind from the
    architecture and folder (masked LM, sentence-transformers folder, plain backbone), the rest from config.json."""
    config = _config(source)
    if config is None or not hasattr(config, "num_attention_heads"):
        return None
    from transformers import AutoModel, AutoModelForMaskedLM

    if any(a.endswith("ForMaskedLM") for a in config.architectures or []):
        output, auto_class = "mlm", AutoModelForMaskedLM
    else:
        output, auto_class = ("similarity" if (Path(source) / "modules.json").is_file() else "embedding"), AutoModel
    architecture = _class_name(auto_class, config)
    if architecture is None:
        return None
    head_dim = config.hidden_size // config.num_attention_heads
    return ModelInfo(id=model_id, kind="text", layers=config.num_hidden_layers, heads=config.num_attention_heads,
                     head_dim=head_dim, native_beta=head_dim**-0.5, output=output, source=str(source),
                     max_tokens=min(max_tokens, config.max_position_embeddings), architecture=architecture, dtype=dtype)


def describe_vision(model_id: str, source: str, dtype: str = "float32") -> ModelInfo | None:
    """A ViT-family model as models/adapters/vit.py will report it (without parity)."""
    from transformers import AutoModel, AutoModelForImageClassification

    from models.adapters.vit import SUPPORTED_MODEL_TYPES, _native_size, _preprocessor_config

    config = _config(source)
    if config is None or config.model_type not in SUPPORTED_MODEL_TYPES:
        return None
    classifier = any("ForImageClassification" in a for a in config.architectures or [])
    architecture = _class_name(AutoModelForImageClassification if classifier else AutoModel, config)
    if architecture is None:
        return None
    patch = config.patch_size
    head_dim = config.hidden_size // config.num_attention_heads
    return ModelInfo(id=model_id, kind="image", layers=config.num_hidden_layers, heads=config.num_attention_heads,
                     head_dim=head_dim, native_beta=head_dim**-0.5, output="classes" if classifier else "embedding",
                     source=str(source), image_size=_native_size(config, _preprocessor_config(source)),
                     patch_size=int(patch[0] if isinstance(patch, (list, tuple)) else patch), architecture=architecture,
                     dtype=dtype)


# encoder–decoder families whose attention does not scale the scores (T5: scaling 1.0)
UNSCALED_SEQ2SEQ = ("t5", "mt5", "umt5", "longt5")


def describe_seq2seq(model_id: str, source: str, max_tokens: int, max_new_tokens: int,
                     dtype: str = "float32") -> ModelInfo | None:
    """An encoder–decoder as models/adapters/seq2seq.py will report it (without parity)."""
    from transformers import AutoModelForSeq2SeqLM

    config = _config(source)
    if config is None or not getattr(config, "is_encoder_decoder", False):
        return None
    architecture = _class_name(AutoModelForSeq2SeqLM, config)

    def first(*names):
        return next((getattr(config, n) for n in names if getattr(config, n, None) is not None), None)

    n_heads, d_model = first("encoder_attention_heads", "num_heads", "num_attention_heads"), first("d_model", "hidden_size")
    encoder_layers = first("encoder_layers", "num_layers")
    decoder_layers = first("decoder_layers", "num_decoder_layers", "num_layers")
    if None in (architecture, n_heads, d_model, encoder_layers, decoder_layers):
        return None
    head_dim = getattr(config, "d_kv", None) or d_model // n_heads
    return ModelInfo(
        id=model_id, kind="text", layers=encoder_layers, heads=n_heads, head_dim=head_dim,
        native_beta=1.0 if config.model_type in UNSCALED_SEQ2SEQ else head_dim**-0.5, output="seq2seq",
        source=Path(source).name, max_tokens=min(max_tokens, getattr(config, "max_position_embeddings", None) or max_tokens),
        max_new_tokens=max_new_tokens, architecture=architecture, decoder_layers=decoder_layers, dtype=dtype,
        decoder_heads=first("decoder_attention_heads", "num_heads", "num_attention_heads"),
    )


def describe_whisper(model_id: str, source: str, max_new_tokens: int, max_audio_s: float, dtype: str = "float32"):
    """A prepared Whisper folder as models/adapters/whisper.py will report it (without parity): config.json, the
    CTranslate2 config's alignment heads and language ids, the tokenizer's special tokens. ValueError when the folder
    is not prepared (as the load would raise)."""
    from models.adapters.whisper import POSITION_S, AudioModelInfo
    from models.whisper_front import whisper_tokens

    folder = Path(source)
    if not (folder / "model.safetensors").is_file():
        command = "attnlab prepare" if model_id == "whisper-tiny-en" else f"make {model_id}` or `attnlab prepare --model {model_id}"
        raise ValueError(f"{model_id} is not prepared on this server (run `{command}`)")
    config = _config(source)
    if config is None or config.model_type != "whisper":
        return None
    ct2 = json.loads((folder / "ctranslate2_config.json").read_text())
    tokens = whisper_tokens(folder / "tokenizer.json", config.vocab_size, ct2.get("lang_ids"))
    from transformers import WhisperForConditionalGeneration

    return AudioModelInfo(
        id=model_id, kind="audio", layers=config.decoder_layers, heads=config.decoder_attention_heads,
        head_dim=config.d_model // config.decoder_attention_heads,
        native_beta=(config.d_model // config.encoder_attention_heads) ** -0.5,  # the first (encoder) module's scaling
        output="transcript", source=folder.name, max_new_tokens=max_new_tokens,
        architecture=WhisperForConditionalGeneration.__name__, decoder_layers=config.decoder_layers,
        decoder_heads=config.decoder_attention_heads, dtype=dtype, encoder_layers=config.encoder_layers,
        frame_s=POSITION_S, max_audio_s=max_audio_s, max_tokens=config.max_target_positions,
        alignment_heads=[list(pair) for pair in ct2.get("alignment_heads", [])], multilingual=tokens.multilingual,
        tasks=["transcribe", "translate"] if tokens.multilingual else ["transcribe"],
        languages=sorted(tokens.languages) if tokens.multilingual else None,
    )
