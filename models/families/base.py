"""What a model family is (issue 54): how a checkpoint of it is recognised, loaded and described, its adapter, the
intervention ops it offers, and the job and view the server answers it with (by name: models/ imports nothing of the
web app, which maps the names to its functions in app/pipeline/job.py JOB_BUILDERS and app/pipeline/views.py VIEWS).
One file per family in this package, one registration line in models/families/__init__.py."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from models.interventions import OPS


@dataclass(frozen=True)
class Limits:
    """The server's limits a loader and a description need (from its settings)."""

    max_tokens: int = 512
    max_new_tokens: int = 64
    max_transcript_tokens: int = 224  # speech
    max_audio_s: float = 30.0


@dataclass(frozen=True)
class Family:
    name: str  # ModelSpec.family, e.g. "encoder"
    kind: str  # the page it serves: "text" | "image" | "audio"
    what: str  # in words, with what recognises it: the refusal of an unknown model_type lists every family's
    # (config, source) → whether a checkpoint is of this family, from its config alone (no weights read)
    recognises: Callable[[Any, str], bool]
    # (model_id, source, limits, device, dtype) → the loaded adapter (the load-time probe refuses a mismatch)
    load: Callable[..., Any]
    # (model_id, source, limits, dtype) → the ModelInfo the model will have, read from its files without loading it
    # (GET /api/models), or None when only a load can say
    describe: Callable[..., Any]
    adapter: Callable[[], type]  # its adapter class (imported when asked: loading transformers' modules costs seconds)
    ops: tuple[str, ...] = OPS  # the intervention ops it offers (app/interventions.py refuses the others)
    # the server's request check: a key of app/pipeline/job.py JOB_BUILDERS ("plain" | "seq2seq" | "whisper": a
    # PlainJob, Seq2SeqJob or SpeechJob)
    job: str = "plain"
    view: str = "plain"  # the server's response: a key of app/pipeline/views.py VIEWS
    # W_O's attribute on its attention module when it has none of the names models/anatomy.py knows
    output_projection: str | None = None


class UnknownFamily(ValueError):
    """A checkpoint whose config names no family attnlab serves."""


def source_of(source: Callable[[], str] | str) -> str:
    """A spec's source: a folder or hub id, or what gives one when asked (a default model's installed package)."""
    return source() if callable(source) else source


def generating_load(adapter: Callable[[], type]) -> Callable:
    """The `load` of a family whose adapter also generates: its input and continuation limits from `limits`."""
    def load(model_id, source, limits, device, dtype="float32"):
        return adapter()(model_id, source, max_tokens=limits.max_tokens, device=device,
                         max_new_tokens=limits.max_new_tokens, dtype=dtype)

    return load
