"""Whisper (models/adapters/whisper.py), for the speech page: a folder `attnlab prepare` made (its CTranslate2
config names the alignment heads). A Whisper checkpoint without one is an encoder–decoder, as before issue 54."""
from __future__ import annotations

from pathlib import Path

from models.families.base import Family
from models.interventions import OPS


def adapter():
    from models.adapters.whisper import WhisperAdapter

    return WhisperAdapter


def load(model_id, source, limits, device, dtype="float32"):
    return adapter()(model_id, source, device=device, dtype=dtype, max_new_tokens=limits.max_transcript_tokens,
                     max_audio_s=limits.max_audio_s)


def describe(model_id, source, limits, dtype="float32"):
    from models.listing import describe_whisper

    return describe_whisper(model_id, source, limits.max_transcript_tokens, limits.max_audio_s, dtype)


def recognises(config, source) -> bool:
    return config.model_type == "whisper" and (Path(source) / "ctranslate2_config.json").is_file()


FAMILY = Family(
    name="speech", kind="audio", what="Whisper speech recognisers (a folder `attnlab prepare` made)",
    recognises=recognises, load=load, describe=describe, adapter=adapter,
    ops=tuple(op for op in OPS if op not in ("patch_heads", "positions")), job="whisper", view="whisper")
