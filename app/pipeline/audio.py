"""A speech attention request's work (POST /api/audio/attention, and the speech page's standalone HTML export in
app/pipeline/export_media.py): the stored clip (an upload, or the bundled sample), the model's task and language
checked, the input encoded (kept in the runtime's cache) and the job its family names built (app/pipeline/job.py:
Whisper's). The routes call `audio_work` (and `prepare_audio`, `stored_audio`); none calls another."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from fastapi import HTTPException
from pydantic import Field

from app.attention import check_request_limits
from app.audiostore import AudioStore, audio_limits
from app.context import RequestContext
from app.deps import adapter_for
from app.errors import field_error
from app.ids import is_valid_id
from app.imagestore import RETRY_AFTER_S, StoreUnavailable
from app.pipeline.job import PageInput, build_job
from app.pipeline.views import answer
from app.runtime import Runtime
from app.schemas import WEIGHTING_DESCRIPTION, IndexList, Interventions, Weighting, _Strict
from models.adapters.whisper import WhisperAdapter
from models.audio import AudioInputError, DecodedAudio, decode_bytes

ROOT = Path(__file__).resolve().parents[2]
# The bundled sample (made at setup by espeak-ng, attnlab_prepare.py) has this fixed id on every replica.
SAMPLE_ID = "5a3b1e00000000000000000000000001"
DEFAULT_MODEL = "whisper-tiny-en"


def sample_path(runtime: Runtime) -> Path:
    return ROOT / runtime.settings.weights_dir / "samples" / "speech-sample.wav"


def stored_audio(runtime: Runtime, store: AudioStore, audio_id: str, field: tuple = ("audio_id",)) -> DecodedAudio:
    if not is_valid_id(audio_id):
        raise field_error(field, "audio_id must be 32 lowercase hex characters (from POST /api/audio)")
    try:
        audio = store.get(audio_id)
        if audio is None and audio_id == SAMPLE_ID:
            path = sample_path(runtime)
            if path.is_file():
                data = path.read_bytes()
                audio = decode_bytes(data, audio_limits(runtime.settings))
                store.put(audio_id, data, audio, shared=False)  # every replica has the file
    except StoreUnavailable as exc:
        raise HTTPException(503, detail=str(exc), headers={"Retry-After": str(RETRY_AFTER_S)}) from None
    except AudioInputError as exc:  # another replica's upload (from Redis) that does not decode under this one
        loc = list(field) if field[0] == "path" else ["body", *field]
        raise HTTPException(exc.status, detail=[{"loc": loc, "type": "value_error", "msg": f"the clip {audio_id} "
                            f"held by the server does not decode on this replica: {exc}"}]) from None
    if audio is None:
        raise HTTPException(404, detail=f"audio_id {audio_id!r} is not held by the server (expired or never uploaded): "
                                        "upload the clip again")
    return audio


class AudioAttentionRequest(_Strict):
    model: str = DEFAULT_MODEL
    audio_id: str = Field(description="from POST /api/audio (or GET /api/audio/sample)")
    task: Literal["transcribe", "translate"] = "transcribe"
    language: str | None = Field(None, max_length=8, description="a multilingual model's language code ('de'; GET "
                                 "/api/models lists them); null = detected from the clip. English-only models: null or 'en'")
    target: str | None = Field(None, description="text to teacher-force (at most max_text_chars; its tokens past "
                               "max_transcript_tokens are dropped); null = the greedy transcript")
    layers: IndexList | None = Field(None, description="decoder/cross layers to return (null = all)")
    heads: IndexList | None = None
    encoder_layers: IndexList | None = Field(None, description="encoder layers of the overview (null = all)")
    kinds: list[Literal["encoder", "decoder", "cross"]] = Field(default_factory=lambda: ["cross", "decoder"])
    interventions: Interventions = Field(default_factory=list)
    compare: bool = False
    encoding: Literal["json", "f16", "f32"] = "json"
    weighting: Weighting = Field("attention", description=WEIGHTING_DESCRIPTION + "; cross keys (encoder positions, "
                                 "20 ms each) weighted by what each frame's value adds, the encoder overview pooled "
                                 "from the value-weighted encoder maps; `words`, `alignment` and `effect` stay P's")


def prepare_audio(req: AudioAttentionRequest, runtime: Runtime, store: AudioStore):
    """The request's checks before any run (limits, the clip, the model, task and language) → (adapter, clip, encoded
    input, kept in the runtime's cache). The attention and the transcript routes both start here."""
    check_request_limits(runtime.settings, req)  # the settings' limits, as on every route: before any work
    audio = stored_audio(runtime, store, req.audio_id)  # before the model: an unknown clip costs no model load
    adapter: WhisperAdapter = adapter_for(runtime, req.model, "audio")
    if req.task == "translate" and not adapter.multilingual:
        raise field_error(("task",), f"{adapter.info.id} is English-only: it transcribes, it does not translate (task "
                          "must be 'transcribe'; whisper-base translates, prepared by `attnlab prepare --model whisper-base`)")
    if not adapter.multilingual and req.language not in (None, "en"):
        raise field_error(("language",), f"{adapter.info.id} is English-only: language must be null or 'en'")
    if adapter.multilingual and req.language is not None and req.language not in adapter.tokens.languages:
        raise field_error(("language",), f"language {req.language!r} is not one of {adapter.info.id}'s "
                          f"{len(adapter.tokens.languages)} languages ({', '.join(sorted(adapter.tokens.languages))}), or null "
                          "to detect it")
    language = "en" if not adapter.multilingual else req.language
    encoded = runtime.encode(adapter, ("audio", req.audio_id, req.target, language, req.task),
                             lambda: adapter.encode(audio.samples, ("audio", req.audio_id), req.target, language, req.task))
    return adapter, audio, encoded


def audio_work(runtime: Runtime, store: AudioStore, req: AudioAttentionRequest) -> Callable[[RequestContext], dict[str, Any]]:
    """Every check of `req` done before it returns (4xx naming the field, 404 an unknown clip); calling the result
    with the request's context (a plain request's, or its job's) runs the work and gives the response dict."""
    adapter, audio, encoded = prepare_audio(req, runtime, store)
    # the request checked once, before any work (app/pipeline): layers, heads, encoder layers, interventions, size
    job = build_job(runtime, adapter, encoded, req, PageInput(audio=audio))
    return lambda ctx: answer(job, ctx)
