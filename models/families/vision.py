"""ViT-family vision models (models/adapters/vit.py), for the image page."""
from __future__ import annotations

from models.families.base import Family

# the vision model_types models/adapters/vit.py serves (its SUPPORTED_MODEL_TYPES, named here without importing it)
MODEL_TYPES = ("vit", "deit", "dinov2", "dinov2_with_registers", "clip_vision_model", "siglip_vision_model")


def adapter():
    from models.adapters.vit import VitAdapter

    return VitAdapter


def load(model_id, source, limits, device, dtype="float32"):
    return adapter()(model_id, source, device=device, dtype=dtype)


def describe(model_id, source, limits, dtype="float32"):
    from models.listing import describe_vision

    return describe_vision(model_id, source, dtype)


FAMILY = Family(
    name="vision", kind="image", what=f"ViT-family vision models ({', '.join(MODEL_TYPES)})",
    recognises=lambda config, source: config.model_type in MODEL_TYPES, load=load, describe=describe, adapter=adapter)
