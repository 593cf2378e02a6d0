"""Where uploaded images live: this process's memory (the default), or Redis shared by every replica.

- **MemoryImageStore** (no `redis_url`): the decoded-image LRU of models/images.py, as before. Behind a
  load balancer an upload is then only known to the replica that took it.
- **RedisImageStore** (`redis_url`, e.g. `redis://redis:6379/0`): the uploaded *bytes* are written with
  `SET key bytes EX redis_ttl_s` (at most `redis_max_item_bytes` each; the total is bounded by the Redis
  server's own `maxmemory` + an LRU/TTL eviction policy, which is the operator's), so any replica can serve
  any image id. Each replica decodes what it reads on demand and keeps the decoded image in its own LRU (the
  same bounded `ImageStore`), so a repeated request costs no Redis round trip. A read from Redis
  (`GETEX … EX ttl`) restarts the key's TTL: an image in use does not expire under its users.

Redis unreachable: `put` (and a `get` this replica cannot answer from its LRU) raise `StoreUnavailable`,
which the routes answer with 503 + Retry-After naming Redis; text requests never touch the store. The
client reconnects on the next call, so uploads recover as soon as Redis is back, without a restart.

The routes reach the store through a FastAPI dependency (`get_image_store`), one per app, built from the
app's settings on first use.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Protocol

from fastapi import Request

from app.settings import Settings
from models.images import DecodedImage, ImageInputError, ImageStore, StoredImage, configure_pillow, decode_image

log = logging.getLogger("attnlab")
RETRY_AFTER_S = 5  # what a 503 for an unreachable Redis tells the client


class StoreUnavailable(RuntimeError):
    """The shared store cannot be reached; the message names it (never its credentials)."""


class StoreItemTooLarge(ValueError):
    """An upload over the shared store's per-item limit (redis_max_item_bytes)."""


class UploadStore(Protocol):
    backend: str
    max_item_bytes: int | None  # None: no limit of its own (max_upload_bytes applies)

    def put(self, image_id: str, data: bytes, decoded: DecodedImage, *, shared: bool = True) -> StoredImage: ...

    def get(self, image_id: str) -> StoredImage | None: ...

    def __contains__(self, image_id: str) -> bool: ...


class MemoryImageStore:
    """This process's decoded LRU only (today's behaviour; the default)."""

    backend = "memory"
    max_item_bytes = None

    def __init__(self, settings: Settings):
        self.local = ImageStore(max_items=settings.image_cache_items, max_bytes=settings.image_cache_bytes)

    def put(self, image_id: str, data: bytes, decoded: DecodedImage, *, shared: bool = True) -> StoredImage:
        return self.local.put(image_id, decoded)

    def get(self, image_id: str) -> StoredImage | None:
        return self.local.get(image_id)

    def __contains__(self, image_id: str) -> bool:
        return image_id in self.local


def redact_url(url: str) -> str:
    """redis://user:secret@host:6379/0 → redis://host:6379/0 (messages and logs never carry the password)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    return f"{scheme}://{rest.rpartition('@')[2]}"


class RedisImageStore:
    """Uploaded bytes in Redis (shared, with a TTL), decoded images in this replica's LRU."""

    backend = "redis"

    def __init__(self, settings: Settings, client=None):
        import redis
        from redis.backoff import ConstantBackoff
        from redis.retry import Retry

        self.settings = settings
        self.url = redact_url(settings.redis_url or "")
        self.ttl_s = settings.redis_ttl_s
        self.max_item_bytes = settings.redis_max_item_bytes
        self.prefix = settings.redis_key_prefix
        self.local = ImageStore(max_items=settings.image_cache_items, max_bytes=settings.image_cache_bytes)
        self._errors = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)
        # One retry: a pooled connection left broken by a Redis restart is replaced at once, so the first
        # upload after Redis returns succeeds; a Redis that is down fails within ~2 × redis_timeout_s.
        self.client = client or redis.Redis.from_url(
            settings.redis_url, socket_timeout=settings.redis_timeout_s,
            socket_connect_timeout=settings.redis_timeout_s, retry=Retry(ConstantBackoff(0.05), 1),
            health_check_interval=30,
        )
        self._down_since: float | None = None
        self._state_lock = threading.Lock()

    def _key(self, image_id: str) -> str:
        return self.prefix + image_id

    def _failed(self, exc: Exception) -> StoreUnavailable:
        with self._state_lock:
            if self._down_since is None:
                self._down_since = time.monotonic()
                log.warning("image store: Redis at %s unreachable (%s); uploads answer 503 until it is back", self.url, exc)
        return StoreUnavailable(
            f"the shared image store (Redis at {self.url}) is unreachable, so uploads cannot be stored right now; "
            f"try again in a few seconds (text models keep working)")

    def _succeeded(self) -> None:
        if self._down_since is not None:
            with self._state_lock:
                if self._down_since is not None:
                    log.warning("image store: Redis at %s is back after %.1f s", self.url, time.monotonic() - self._down_since)
                    self._down_since = None

    def put(self, image_id: str, data: bytes, decoded: DecodedImage, *, shared: bool = True) -> StoredImage:
        """Write the bytes to Redis (unless `shared` is False: the page's sample photos, which every replica
        can read from its own static/ folder), then keep the decoded image here."""
        if shared:
            if len(data) > self.max_item_bytes:
                raise StoreItemTooLarge(
                    f"the upload is {len(data):,} bytes; the shared image store keeps at most "
                    f"{self.max_item_bytes:,} bytes per image (redis_max_item_bytes)")
            try:
                self.client.set(self._key(image_id), data, ex=self.ttl_s)
            except self._errors as exc:
                raise self._failed(exc) from None
            self._succeeded()
        return self.local.put(image_id, decoded)

    def get(self, image_id: str) -> StoredImage | None:
        item = self.local.get(image_id)
        if item is not None:
            return item
        try:
            data = self.client.getex(self._key(image_id), ex=self.ttl_s)  # read + restart the TTL, one round trip
        except self._errors as exc:
            raise self._failed(exc) from None
        self._succeeded()
        if data is None:
            return None  # expired, evicted by Redis, or never uploaded: the page uploads it again
        settings = self.settings
        try:  # another replica accepted these bytes; decode them under this replica's limits
            decoded = decode_image(data, settings.max_image_pixels, settings.max_image_aspect_ratio)
        except ImageInputError as exc:
            log.warning("image store: %s from Redis no longer decodes here (%s); treated as absent", image_id, exc)
            return None
        return self.local.put(image_id, decoded)

    def __contains__(self, image_id: str) -> bool:
        return image_id in self.local  # this replica's decoded copies only (no round trip)


def build_image_store(settings: Settings) -> UploadStore:
    configure_pillow(settings.max_image_pixels)
    if settings.redis_url:
        return RedisImageStore(settings)
    return MemoryImageStore(settings)


_store_lock = threading.Lock()


async def get_image_store(request: Request) -> UploadStore:
    """FastAPI dependency: the app's store, built on first use (creating a Redis client opens no connection).
    async: a plain `def` dependency would cost a thread hop per request for a lookup."""
    state = request.app.state
    store = getattr(state, "image_store", None)
    if store is None:
        with _store_lock:
            store = getattr(state, "image_store", None)
            if store is None:
                store = state.image_store = build_image_store(state.runtime.settings)
    return store
