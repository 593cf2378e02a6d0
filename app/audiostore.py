"""Where uploaded audio clips live: this process's memory, and Redis too when `redis_url` is set (as images do,
app/imagestore.py, whose connection settings, URL redaction and 503 exception this reuses).

- Memory: an LRU of decoded clips (16 kHz mono float32), bounded by `audio_cache_items`.
- Redis: the uploaded *bytes* under `{redis_key_prefix}audio:{id}` with the same TTL and per-item limit as images;
  another replica decodes them on demand under its own limits (models/audio.py) and keeps the result in its LRU.
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict

from fastapi import Request

from app.imagestore import StoreItemTooLarge, StoreUnavailable, redact_url
from app.settings import Settings
from models.audio import AudioInputError, AudioLimits, DecodedAudio, decode_bytes

log = logging.getLogger("attnlab")


def audio_limits(settings: Settings) -> AudioLimits:
    return AudioLimits(max_seconds=settings.max_audio_s, max_channels=settings.max_audio_channels,
                       min_sample_rate=settings.min_audio_sample_rate, max_sample_rate=settings.max_audio_sample_rate)


class AudioStore:
    def __init__(self, settings: Settings, client=None):
        self.settings = settings
        self.max_items = settings.audio_cache_items
        self._local: OrderedDict[str, DecodedAudio] = OrderedDict()
        self._lock = threading.Lock()
        self.client = None
        self.max_item_bytes: int | None = None
        if settings.redis_url:
            import redis
            from redis.backoff import ConstantBackoff
            from redis.retry import Retry

            self.url = redact_url(settings.redis_url)
            self.max_item_bytes = settings.redis_max_item_bytes
            self._errors = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)
            self.client = client or redis.Redis.from_url(
                settings.redis_url, socket_timeout=settings.redis_timeout_s,
                socket_connect_timeout=settings.redis_timeout_s, retry=Retry(ConstantBackoff(0.05), 1),
            )
        self.prefix = settings.redis_key_prefix.removesuffix("image:") + "audio:"

    @property
    def backend(self) -> str:
        return "redis" if self.client is not None else "memory"

    def _unavailable(self, exc: Exception) -> StoreUnavailable:
        log.warning("audio store: Redis at %s unreachable (%s)", self.url, exc)
        return StoreUnavailable(f"the shared upload store (Redis at {self.url}) is unreachable, so audio cannot be "
                                "stored or read right now; try again in a few seconds")

    def _keep(self, audio_id: str, audio: DecodedAudio) -> None:
        with self._lock:
            self._local[audio_id] = audio
            self._local.move_to_end(audio_id)
            while len(self._local) > self.max_items:
                self._local.popitem(last=False)

    def put(self, audio_id: str, data: bytes, audio: DecodedAudio, *, shared: bool = True) -> None:
        if shared and self.client is not None:
            if self.max_item_bytes is not None and len(data) > self.max_item_bytes:
                raise StoreItemTooLarge(f"the upload is {len(data):,} bytes; the shared store keeps at most "
                                        f"{self.max_item_bytes:,} bytes per item (redis_max_item_bytes)")
            try:
                self.client.set(self.prefix + audio_id, data, ex=self.settings.redis_ttl_s)
            except self._errors as exc:
                raise self._unavailable(exc) from None
        self._keep(audio_id, audio)

    def get(self, audio_id: str) -> DecodedAudio | None:
        with self._lock:
            audio = self._local.get(audio_id)
            if audio is not None:
                self._local.move_to_end(audio_id)
                return audio
        if self.client is None:
            return None
        try:
            data = self.client.getex(self.prefix + audio_id, ex=self.settings.redis_ttl_s)
        except self._errors as exc:
            raise self._unavailable(exc) from None
        if data is None:
            return None
        try:
            audio = decode_bytes(data, audio_limits(self.settings))
        except AudioInputError as exc:
            log.warning("audio store: %s from Redis does not decode here (%s); treated as absent", audio_id, exc)
            return None
        self._keep(audio_id, audio)
        return audio


_store_lock = threading.Lock()


async def get_audio_store(request: Request) -> AudioStore:
    """FastAPI dependency: the app's audio store, built on first use."""
    state = request.app.state
    store = getattr(state, "audio_store", None)
    if store is None:
        with _store_lock:
            store = getattr(state, "audio_store", None)
            if store is None:
                store = state.audio_store = AudioStore(state.runtime.settings)
    return store
