"""Speech: uploads (POST /api/audio), the log-mel the model sees and the clip for playback, Whisper's attention with
interventions (POST /api/audio/attention), the streamed greedy transcript, and the page (/audio).

Uploads are size-checked before and while the body is read (max_audio_bytes; the images' guard, read_upload in
app/uploads.py), decoded in the thread pool by models/audio.py (containers by magic number, codec allowlist,
channel and sample-rate limits, the duration counted while decoding: a decoder bomb stops at max_audio_s), and kept
by app/audiostore.py (the upload store of app/imagestore.py: memory, plus Redis when redis_url is set). Ids are
random (app/ids.py).
"""
from __future__ import annotations

import json
import math
import shutil
import threading
from pathlib import Path
from typing import Any

import numpy as np
from fastapi import APIRouter, HTTPException, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import HTMLResponse, JSONResponse

from app.encoding import fast_json
from app.audiostore import audio_limits
from app.deps import AudioStoreDep, RuntimeDep
from app.errors import error_response, too_large_response
from app.ids import new_id
from app.imagestore import RETRY_AFTER_S, StoreItemTooLarge, StoreUnavailable
from app.interventions import whisper_interventions
from app.lifecycle import ParsedJsonRoute
from app.pipeline.audio import (
    DEFAULT_MODEL, SAMPLE_ID, AudioAttentionRequest, audio_work, prepare_audio, sample_path, stored_audio,
)
from app.runtime import Runtime
from app.streams import JobStream, respond, run_job
from app.templating import templates
from app.uploads import decode_gate, read_upload
from models.audio import AudioInputError, DecodedAudio, decode_bytes, to_wav
from models.preparing import RETRY_AFTER_S as PREPARE_RETRY_AFTER_S

router = APIRouter(tags=["audio"], route_class=ParsedJsonRoute)
ROOT = Path(__file__).resolve().parents[2]


def _describe(audio_id: str, audio: DecodedAudio) -> dict[str, Any]:
    return {"audio_id": audio_id, "duration_s": round(audio.duration_s, 4), "sample_rate": audio.sample_rate,
            "channels": audio.channels, "format": audio.format}


UPLOAD_OPENAPI = {
    "requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
        "type": "object", "required": ["file"],
        "properties": {"file": {"type": "string", "format": "binary",
                                "description": "WAV, FLAC, MP3, OGG (Opus/Vorbis) or WebM (Opus)"}},
    }}}},
    "responses": {
        "400": {"description": "unreadable, truncated, damaged or empty audio; channels or sample rate outside the "
                               "limits (of any segment, where they change part-way)"},
        "403": {"description": "sent by a page of another origin (Sec-Fetch-Site cross-site/same-site, or an Origin "
                               "that is not this server and not in cors_origins)"},
        "413": {"description": "over max_audio_bytes, or longer than max_audio_s (counted while decoding)"},
        "415": {"description": "not audio in an accepted container/codec (or one FFmpeg has no decoder for), or not "
                               "multipart/form-data"},
        "422": {"description": "no `file` field"},
        "503": {"description": "decodes busy (max_concurrent_decodes) or the shared store (Redis) unreachable"},
    },
}


@router.post("/api/audio", openapi_extra=UPLOAD_OPENAPI)
async def upload_audio(request: Request, store: AudioStoreDep) -> JSONResponse:
    """Store a clip (multipart field `file`): decoded and resampled to 16 kHz mono for the model. Answers its id,
    duration, the file's own sample rate and channels, and its container."""
    settings = request.app.state.runtime.settings
    limit = settings.max_audio_bytes
    data = await read_upload(request, limit, "max_audio_bytes", "audio", store)
    if isinstance(data, JSONResponse):
        return data
    if not data:
        return error_response(400, "the file is empty")
    gate = decode_gate(request.app)
    if not await gate.acquire():
        return JSONResponse({"detail": f"server busy: {gate.limit} decodes already running (max_concurrent_decodes)"},
                            status_code=503, headers={"Retry-After": str(max(1, math.ceil(gate.wait_s / 4)))})
    try:
        audio = await run_in_threadpool(decode_bytes, data, audio_limits(settings))
    except AudioInputError as exc:
        return error_response(exc.status, str(exc))
    finally:
        gate.release()
    audio_id = new_id()
    try:
        await run_in_threadpool(store.put, audio_id, data, audio)
    except StoreUnavailable as exc:
        return JSONResponse({"detail": str(exc)}, status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})
    except StoreItemTooLarge as exc:
        return too_large_response(store.max_item_bytes or limit, f"file: {exc}")
    return JSONResponse(_describe(audio_id, audio))


@router.get("/api/audio/sample")
def audio_sample(runtime: RuntimeDep, store: AudioStoreDep) -> dict[str, Any]:
    """The bundled sample clip (spoken by espeak-ng at setup): its fixed id and text. Not made yet: 503 with
    Retry-After while a speech model's preparation (which makes it) is under way, else 404 saying why: espeak-ng is not
    installed here, or it is and the preparation has not run."""
    missing = _sample_missing(runtime)
    if missing is not None:
        status, why = missing
        raise HTTPException(status, detail=why,
                            headers={"Retry-After": str(PREPARE_RETRY_AFTER_S)} if status == 503 else None)
    from models.whisper_front import SPEECH_SAMPLE_TEXT

    return {**_describe(SAMPLE_ID, stored_audio(runtime, store, SAMPLE_ID)), "text": SPEECH_SAMPLE_TEXT}


def _sample_missing(runtime: Runtime) -> tuple[int, str] | None:
    """Why the sample clip is not there, as attnlab_prepare decides it (make_speech_sample: espeak-ng on the PATH):
    (503, …) while a speech model's preparation, which speaks the sample first, is under way; (404, …) when espeak-ng
    is not installed, or it is and the preparation has not run; None when the clip is there."""
    if sample_path(runtime).is_file():
        return None
    preparing = [model_id for model_id, spec in runtime.specs.items() if spec.kind == "audio"
                 and (runtime.preparation(model_id) or {}).get("state") == "preparing"]
    if preparing:
        return 503, (f"the sample clip is not made yet: {preparing[0]} is being prepared on this server, and its "
                     "preparation speaks the sample first; try again in a moment")
    if shutil.which("espeak-ng") is None:
        return 404, ("no sample clip on this server: espeak-ng is not installed here (apt-get install espeak-ng, or "
                     "`make speech`), and the sample is spoken by it")
    return 404, ("no sample clip made yet: espeak-ng is installed, and the sample is made when the speech model is "
                 "prepared (`make speech weights`, or `attnlab prepare`)")


_extractor_lock = threading.Lock()
_extractor = None


def _spectrogram(samples: np.ndarray) -> np.ndarray:
    """Whisper's log-mel (80 × F frames of 10 ms up to the clip's end), without loading the model."""
    global _extractor
    with _extractor_lock:
        if _extractor is None:
            from models.whisper_front import whisper_feature_extractor

            _extractor = whisper_feature_extractor()
    frames = min(3000, math.ceil(samples.size / 160))
    return _extractor(samples, sampling_rate=16000, return_tensors="np").input_features[0, :, :frames].astype(np.float32)


@router.get("/api/audio/{audio_id}/spectrogram")
def audio_spectrogram(audio_id: str, runtime: RuntimeDep, store: AudioStoreDep) -> Response:
    """The log-mel spectrogram the model sees: `mel` [80][F] (Whisper's scaling: log10, floored 8 below the clip's
    maximum, (x + 4) / 4), F frames of `frame_s` = 0.01 s up to the clip's end."""
    audio = stored_audio(runtime, store, audio_id, ("path", "audio_id"))
    mel = _spectrogram(audio.samples)
    return fast_json({"audio_id": audio_id, "mel": mel, "frame_s": 0.01, "n_mels": int(mel.shape[0]),
                      "frames": int(mel.shape[1]), "duration_s": round(audio.duration_s, 4)})


@router.get("/api/audio/{audio_id}/wav")
def audio_wav(audio_id: str, runtime: RuntimeDep, store: AudioStoreDep) -> Response:
    """The clip as the model hears it (16 kHz mono, 16-bit WAV), for playback."""
    audio = stored_audio(runtime, store, audio_id, ("path", "audio_id"))
    return Response(to_wav(audio.samples), media_type="audio/wav", headers={"Cache-Control": "private, max-age=3600"})


# ---- attention -------------------------------------------------------------------------------------------------
@router.post("/api/audio/attention")
def audio_attention(req: AudioAttentionRequest, runtime: RuntimeDep, store: AudioStoreDep, request: Request) -> Response:
    """Whisper's attention on a clip: the decoder tokens (prompt included) and the transcript; cross-attention
    [L][H][N][1500] (keys: encoder positions of 20 ms), decoder self-attention [L][H][N][N] (causal), the encoder's
    self-attention as a pooled overview; each target token's probability (teacher-forced); words with times from
    the alignment heads; the heads ranked by alignment (both from the run without interventions). With `compare`: the text before/after (greedy with the
    interventions active), per-token probability change and KL, attention TV per kind."""
    # with Accept: text/event-stream a job (app/streams.py): accepted with its ETA, layer progress, then this response
    return respond(request, audio_work(runtime, store, req), "POST /api/audio/attention")


@router.post("/api/audio/transcribe", responses={
    200: {"content": {"text/event-stream": {}}, "description": "a job: accepted, a token event per new token, done"}})
def audio_transcribe(req: AudioAttentionRequest, runtime: RuntimeDep, store: AudioStoreDep, request: Request) -> Response:
    """The greedy transcript with the interventions active, streamed as a job (app/streams.py, the one event-stream
    pump; docs/api.md "Jobs"): accepted, then `{"token", "prob", "text"}` per new token, then `{"done": true, "text"}`.
    Each step is admitted on its own; a client that leaves stops the decoding at its next token."""
    adapter, audio, encoded = prepare_audio(req, runtime, store)
    interventions = whisper_interventions(req, adapter, len(encoded.tokens))
    features = encoded.inputs["input_features"]

    def work(stream: JobStream) -> dict[str, Any]:  # in the job's worker thread; decoding holds the model lock
        produced: list[int] = []

        def hand_over(token: int, prob: float) -> None:
            if token != adapter.eot:
                produced.append(token)
            stream.emit({"token": adapter.token_text(token), "prob": prob, "text": adapter.decode(produced)})

        with runtime.admitted():
            adapter.transcribe(features, interventions, on_token=hand_over, prompt=encoded.extra["prompt"])
        return {"text": adapter.decode(produced)}

    return run_job(request, work, "POST /api/audio/transcribe", layer_progress=False)


def _prepared_models(runtime: Runtime) -> list[dict[str, Any]]:
    """The speech models whose weights are on this server (whisper-base only where the operator prepared it) and
    whether each is multilingual, read from its prepared.json without loading it."""
    models = []
    for model_id, spec in runtime.specs.items():
        marker = ROOT / runtime.settings.weights_dir / model_id / "prepared.json"
        if spec.kind == "audio" and marker.is_file():
            models.append({"id": model_id, "multilingual": bool(json.loads(marker.read_text()).get("multilingual"))})
    return models


@router.get("/audio", response_class=HTMLResponse)
def audio_page(request: Request, runtime: RuntimeDep):
    """Speech: Whisper's cross-attention over time, with interventions."""
    settings = runtime.settings
    config = {"model": DEFAULT_MODEL, "max_audio_s": settings.max_audio_s, "max_audio_bytes": settings.max_audio_bytes,
              "sample": sample_path(runtime).is_file(), "sample_id": SAMPLE_ID, "models": _prepared_models(runtime),
              "not_ready": runtime.not_ready("audio")}  # being prepared (`make run`): shown, not chosen
    missing = _sample_missing(runtime)  # the sample button: why there is none, or that it waits for a preparation
    config["sample_note"], config["sample_waits"] = (missing[1], missing[0] == 503) if missing else (None, False)
    return templates.TemplateResponse(request, "audio.html", {"config": config, "page": "audio"})
