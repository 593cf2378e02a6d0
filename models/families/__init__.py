"""The model families attnlab serves, registered in one place (issue 54): each is one file of this package holding a
`Family` (models/families/base.py); adding one is that file and its line in FAMILIES. Recognition asks them in this
order, so the more specific go first (a prepared Whisper folder before encoder–decoders)."""
from __future__ import annotations

from models.families import causal_lm, distilbert, encoder, seq2seq, speech, vision
from models.families.base import Family, Limits, UnknownFamily, source_of

__all__ = ["FAMILIES", "Family", "Limits", "UnknownFamily", "detect_family", "family_named", "family_of",
           "output_projection_names", "source_of"]

# the registration point: one line per family, in recognition order
FAMILIES: tuple[Family, ...] = (
    speech.FAMILY,
    seq2seq.FAMILY,
    causal_lm.FAMILY,
    vision.FAMILY,
    distilbert.FAMILY,
    encoder.FAMILY,
)


def family_named(name: str) -> Family:
    for family in FAMILIES:
        if family.name == name:
            return family
    raise KeyError(f"no family {name!r}; the families are {', '.join(f.name for f in FAMILIES)}")


def family_of(config, source: str) -> Family:
    """The family a checkpoint's config calls for; UnknownFamily naming every family when none claims it (never a
    fallback: an adapter not written for a model would fail silently)."""
    for family in FAMILIES:
        if family.recognises(config, source):
            return family
    architectures = config.architectures or []
    raise UnknownFamily(
        f"model_type {config.model_type!r} (architectures {architectures or 'none'}) is of no family attnlab serves: "
        + ", ".join(family.what for family in FAMILIES))


def detect_family(source: str) -> str:
    """Which family serves the checkpoint at `source` (a folder or hub id), from its config alone (no weights read)."""
    from transformers import AutoConfig

    return family_of(AutoConfig.from_pretrained(source), source).name


def output_projection_names() -> tuple[str, ...]:
    """W_O's attribute names that families declare beside the common ones (models/anatomy.py)."""
    return tuple(f.output_projection for f in FAMILIES if f.output_projection)
