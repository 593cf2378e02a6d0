"""Where uploaded audio clips live: the upload store of app/imagestore.py (memory, plus Redis when `redis_url` is set:
the bytes under `{prefix}audio:blob:{sha256}`, each id under `{prefix}audio:id:{id}`, with the images' TTL and
per-item limit), with what differs for audio:

- the decoded LRU holds clips (16 kHz mono float32), bounded by `audio_cache_items`;
- bytes read from Redis (another replica's upload) are decoded here under this replica's own limits (models/audio.py);
  bytes that do not decode here (stricter limits than the uploading replica's, another PyAV, or bytes no replica of
  this version would have accepted) are not "absent" as a bad image is: the AudioInputError goes on to the route,
  which answers its 400/413/415 naming `audio_id` (an upload of the same clip would be refused the same way, so
  the 404's "upload it again" would mislead);
- the key prefix is `redis_key_prefix` with `audio:` for its last part (`attnlab:image:` → `attnlab:audio:`).
"""
from __future__ import annotations

import threading

from fastapi import Request

from app.imagestore import UploadKind, UploadStore, build_upload_store
from app.settings import Settings
from models.audio import AudioLimits, decode_bytes
from models.lru import BoundedLRU

AudioStore = UploadStore  # the routes' annotation: get(id) → DecodedAudio | None, put(id, bytes, DecodedAudio)


def audio_limits(settings: Settings) -> AudioLimits:
    return AudioLimits(max_seconds=settings.max_audio_s, max_channels=settings.max_audio_channels,
                       min_sample_rate=settings.min_audio_sample_rate, max_sample_rate=settings.max_audio_sample_rate)


def audio_kind(settings: Settings) -> UploadKind:
    return UploadKind(
        name="audio", key_prefix=settings.redis_key_prefix.removesuffix("image:") + "audio:",
        new_local=lambda: BoundedLRU(max(1, settings.audio_cache_items)),  # decoded clips by content digest
        id_items=16 * settings.audio_cache_items,
        decode=lambda data: decode_bytes(data, audio_limits(settings)), decode_errors=(),  # AudioInputError: to the route
    )


def build_audio_store(settings: Settings) -> UploadStore:
    return build_upload_store(settings, audio_kind(settings))


_store_lock = threading.Lock()


async def get_audio_store(request: Request) -> UploadStore:
    """FastAPI dependency: the app's audio store, built on first use."""
    state = request.app.state
    store = getattr(state, "audio_store", None)
    if store is None:
        with _store_lock:
            store = getattr(state, "audio_store", None)
            if store is None:
                store = state.audio_store = build_audio_store(state.runtime.settings)
    return store
