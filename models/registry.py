"""The fixed list of models a request may name. Ids map to loaders; a request never names a path.

Extra entries come from the server's settings (a Hugging Face id or a local folder chosen by the
operator), never from a request.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from models.adapters.base import AttentionAdapter


@dataclass(frozen=True)
class ModelSpec:
    id: str
    kind: str  # "text" | "image"
    load: Callable[[str], AttentionAdapter]  # device preference → adapter
    description: str = ""


def _text_spec(model_id: str, source: Callable[[], str] | str, max_tokens: int, description: str) -> ModelSpec:
    def load(device: str) -> AttentionAdapter:
        from models.adapters.bert import BertAdapter

        return BertAdapter(model_id, source() if callable(source) else source, max_tokens=max_tokens, device=device)

    return ModelSpec(model_id, "text", load, description)


def _image_spec(model_id: str, source: Callable[[], str] | str, description: str) -> ModelSpec:
    def load(device: str) -> AttentionAdapter:
        from models.adapters.vit import VitAdapter  # written for the image page

        return VitAdapter(model_id, source() if callable(source) else source, device=device)

    return ModelSpec(model_id, "image", load, description)


def build_registry(
    *,
    max_tokens: int = 512,
    weights_dir: str | Path = "weights",
    extra_text: dict[str, str] | None = None,
    extra_image: dict[str, str] | None = None,
) -> dict[str, ModelSpec]:
    from models.adapters.bert import minilm_source

    weights_dir = Path(weights_dir)
    trained_dir = Path(__file__).parent / "trained"
    specs = [
        _text_spec("minilm", minilm_source, max_tokens, "all-MiniLM-L6-v2 sentence encoder (6 × 12 heads)"),
        _image_spec("dinov2-small", str(weights_dir / "dinov2-small"), "DINOv2 ViT-S/14 backbone (12 × 6 heads)"),
        _image_spec("vit-fashion", str(trained_dir / "vit-fashion"), "small ViT trained on Fashion-MNIST"),
    ]
    specs += [_text_spec(i, s, max_tokens, f"text model from {s}") for i, s in (extra_text or {}).items()]
    specs += [_image_spec(i, s, f"image model from {s}") for i, s in (extra_image or {}).items()]
    return {spec.id: spec for spec in specs}
