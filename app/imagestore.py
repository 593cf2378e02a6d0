"""Where uploads live (images here; audio clips through app/audiostore.py, the same store with its own key prefix):
this process's memory (the default), or Redis shared by every replica.

One generic store serves both kinds (`UploadKind` says what differs: the key prefix, the decoded LRU, how bytes read
from Redis are decoded under this replica's limits, and the item's id field).

- **MemoryUploadStore** (no `redis_url`): the decoded LRU only. Behind a load balancer an upload is then only known
  to the replica that took it.
- **RedisUploadStore** (`redis_url`, e.g. `redis://redis:6379/0`): the uploaded *bytes* are written with
  `SET key bytes EX redis_ttl_s` (at most `redis_max_item_bytes` each; the total is bounded by the Redis
  server's own `maxmemory` + an LRU/TTL eviction policy, which is the operator's), so any replica can serve
  any id. Each replica decodes what it reads on demand and keeps the decoded item in its own LRU, so a repeated
  request costs no Redis round trip. A read from Redis (`GETEX … EX ttl`) restarts the key's TTL: an upload in use
  does not expire under its users.

Redis unreachable or refusing (any `RedisError`: connection, timeout, OOM under `maxmemory` with
`noeviction`, an ACL's NOPERM, READONLY after a failover): `put` (and a `get` this replica cannot answer from
its LRU) raise `StoreUnavailable`, which the routes answer with 503 + Retry-After naming Redis; text requests
never touch the store. The client reconnects on the next call, so uploads recover as soon as Redis is back,
without a restart. A key of the wrong type (WRONGTYPE) is an absent id (404, the page uploads again).

**Ids are capabilities** (app/ids.py): an upload's id is random, never its content hash, so nobody can test
whether a known file was uploaded, or read one without having been given its id. Identical content is still
stored once: both stores key the bytes (and the decoded item) by the content's sha256 and map each random id
to it. In Redis: `{prefix}id:{id}` → sha256 hex, `{prefix}blob:{sha256}` → the bytes, both with the TTL (images:
`redis_key_prefix`, `attnlab:image:`; audio: the same with `audio:`). On read, bytes over `redis_max_item_bytes`
or whose sha256 is not their key are treated as absent (and logged).

The routes reach the store through a FastAPI dependency (`get_image_store`, `get_audio_store`), one per app and
kind, built from the app's settings on first use.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import re
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from fastapi import Request

from app.settings import Settings
from models.images import ImageInputError, ImageStore, StoredImage, configure_pillow, decode_image
from models.lru import BoundedLRU

log = logging.getLogger("attnlab")
RETRY_AFTER_S = 5  # what a 503 for an unreachable Redis tells the client


class StoreUnavailable(RuntimeError):
    """The shared store cannot be reached; the message names it (never its credentials)."""


class StoreItemTooLarge(ValueError):
    """An upload over the shared store's per-item limit (redis_max_item_bytes)."""


class UploadStore(Protocol):
    backend: str
    max_item_bytes: int | None  # None: no limit of its own (max_upload_bytes / max_audio_bytes apply)

    def put(self, upload_id: str, data: bytes, decoded: Any, *, shared: bool = True) -> Any: ...

    def get(self, upload_id: str) -> Any | None: ...

    def __contains__(self, upload_id: str) -> bool: ...


@dataclasses.dataclass(frozen=True)
class UploadKind:
    """What differs between the kinds of uploads one store design keeps."""

    name: str  # "image" | "audio": in messages and logs
    key_prefix: str  # Redis keys {key_prefix}id:{id} and {key_prefix}blob:{sha256}
    new_local: Callable[[], Any]  # this replica's decoded LRU: get(digest), put(digest, decoded) → item, `in`
    id_items: int  # how many ids map to digests here (LRU)
    decode: Callable[[bytes], Any]  # bytes another replica accepted → decoded, under this replica's limits
    decode_errors: tuple[type[Exception], ...]  # what `decode` raises for bytes it refuses (then: absent)
    with_id: Callable[[Any, str], Any] = lambda item, upload_id: item  # the item as seen under one id


DIGEST_PATTERN = re.compile(r"^[0-9a-f]{64}$")
REDIS_REFUSALS = {  # redis-py's exception classes → what the 503 says
    "NoPermissionError": "NOPERM: its ACL denies a command the store needs",
    "ReadOnlyError": "READONLY: it is a read-only replica, e.g. after a failover",
    "OutOfMemoryError": "OOM: it is full (maxmemory with the noeviction policy)",
    "AuthenticationError": "authentication failed",
    "BusyLoadingError": "LOADING: it is still loading its data",
}


def content_digest(data: bytes) -> str:
    """The internal key of an upload's content (never handed to a client)."""
    return hashlib.sha256(data).hexdigest()


def id_map(max_items: int) -> BoundedLRU[str, str]:
    """Random id → content digest, bounded (LRU): ids outlive their decoded images only this far."""
    return BoundedLRU(max(1, max_items))


def _as_id(item: StoredImage, image_id: str) -> StoredImage:
    return item if item.image_id == image_id else dataclasses.replace(item, image_id=image_id)


class MemoryUploadStore:
    """This process's decoded LRU only (the default): decoded items by content digest, ids mapped to digests."""

    backend = "memory"
    max_item_bytes = None

    def __init__(self, kind: UploadKind):
        self.kind = kind
        self.local = kind.new_local()
        self.ids = id_map(kind.id_items)

    def put(self, upload_id: str, data: bytes, decoded: Any, *, shared: bool = True) -> Any:
        digest = content_digest(data)
        item = self.local.get(digest) or self.local.put(digest, decoded)  # the same content is kept once
        self.ids.put(upload_id, digest)
        return self.kind.with_id(item, upload_id)

    def get(self, upload_id: str) -> Any | None:
        digest = self.ids.get(upload_id)
        item = self.local.get(digest) if digest is not None else None
        return self.kind.with_id(item, upload_id) if item is not None else None

    def __contains__(self, upload_id: str) -> bool:
        digest = self.ids.get(upload_id)
        return digest is not None and digest in self.local


def redact_url(url: str) -> str:
    """redis://user:secret@host:6379/0 → redis://host:6379/0 (messages and logs never carry the password)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    return f"{scheme}://{rest.rpartition('@')[2]}"


class RedisUploadStore:
    """Uploaded bytes in Redis (shared, with a TTL), decoded items in this replica's LRU."""

    backend = "redis"

    def __init__(self, settings: Settings, kind: UploadKind, client=None):
        import redis
        from redis.backoff import ConstantBackoff
        from redis.retry import Retry

        self._redis = redis
        self.settings = settings
        self.url = redact_url(settings.redis_url or "")
        self.ttl_s = settings.redis_ttl_s
        self.max_item_bytes = settings.redis_max_item_bytes
        self.kind = kind
        self.prefix = kind.key_prefix
        self.local = kind.new_local()
        self.ids = id_map(kind.id_items)
        self._errors = redis.exceptions.RedisError  # every refusal of Redis's, not only a lost connection
        self._response_error = redis.exceptions.ResponseError
        # One retry: a pooled connection left broken by a Redis restart is replaced at once, so the first
        # upload after Redis returns succeeds; a Redis that is down fails within ~2 × redis_timeout_s.
        self.client = client or redis.Redis.from_url(
            settings.redis_url, socket_timeout=settings.redis_timeout_s,
            socket_connect_timeout=settings.redis_timeout_s, retry=Retry(ConstantBackoff(0.05), 1),
            health_check_interval=30,
        )
        self._down_since: float | None = None
        self._state_lock = threading.Lock()

    def _id_key(self, upload_id: str) -> str:
        return f"{self.prefix}id:{upload_id}"

    def _blob_key(self, digest: str) -> str:
        return f"{self.prefix}blob:{digest}"

    def _failed(self, exc: Exception) -> StoreUnavailable:
        unreachable = isinstance(exc, (self._redis.exceptions.ConnectionError, self._redis.exceptions.TimeoutError))
        # Redis's error code says what went wrong without naming keys or credentials (redis-py maps some codes
        # to classes and drops the code from the message)
        code = "" if unreachable else REDIS_REFUSALS.get(type(exc).__name__) or (
            str(exc).split(" ", 1)[0] if str(exc)[:1].isupper() else type(exc).__name__)
        with self._state_lock:
            if self._down_since is None:
                self._down_since = time.monotonic()
                log.warning("%s store: Redis at %s failed (%s: %s); uploads answer 503 until it works again",
                            self.kind.name, self.url, type(exc).__name__, exc)
        what = "is unreachable" if unreachable else f"refused the request ({code})"
        return StoreUnavailable(
            f"the shared {self.kind.name} store (Redis at {self.url}) {what}, so uploads cannot be stored or read right "
            "now; try again in a few seconds (text models keep working)")

    def _wrong_type(self, exc: Exception) -> bool:
        return isinstance(exc, self._response_error) and str(exc).startswith("WRONGTYPE")

    def _succeeded(self) -> None:
        if self._down_since is not None:
            with self._state_lock:
                if self._down_since is not None:
                    log.warning("%s store: Redis at %s is back after %.1f s", self.kind.name, self.url,
                                time.monotonic() - self._down_since)
                    self._down_since = None

    def put(self, upload_id: str, data: bytes, decoded: Any, *, shared: bool = True) -> Any:
        """Write the bytes to Redis (unless `shared` is False: the pages' samples, which every replica can read
        from its own files), then keep the decoded item here."""
        digest = content_digest(data)
        if shared:
            if len(data) > self.max_item_bytes:
                raise StoreItemTooLarge(
                    f"the upload is {len(data):,} bytes; the shared {self.kind.name} store keeps at most "
                    f"{self.max_item_bytes:,} bytes per item (redis_max_item_bytes)")
            try:  # one round trip: the bytes under their digest (shared by identical uploads), the id → digest
                pipe = self.client.pipeline(transaction=False)
                pipe.set(self._blob_key(digest), data, ex=self.ttl_s)
                pipe.set(self._id_key(upload_id), digest, ex=self.ttl_s)
                pipe.execute()
            except self._errors as exc:
                raise self._failed(exc) from None
            self._succeeded()
        item = self.local.get(digest) or self.local.put(digest, decoded)
        self.ids.put(upload_id, digest)
        return self.kind.with_id(item, upload_id)

    def _getex(self, key: str) -> bytes | None:
        """GETEX (read + restart the TTL); a key of another type is absent; other Redis errors → 503."""
        try:
            value = self.client.getex(key, ex=self.ttl_s)
        except self._errors as exc:
            if self._wrong_type(exc):
                log.warning("%s store: %s in Redis is not a string (WRONGTYPE); treated as absent", self.kind.name, key)
                self._succeeded()
                return None
            raise self._failed(exc) from None
        self._succeeded()
        return value

    def get(self, upload_id: str) -> Any | None:
        digest = self.ids.get(upload_id)
        item = self.local.get(digest) if digest is not None else None
        if item is not None:
            return self.kind.with_id(item, upload_id)
        raw = self._getex(self._id_key(upload_id))
        if raw is None:
            return None  # expired, evicted by Redis, or never uploaded: the page uploads it again
        digest = raw.decode("ascii", "replace") if isinstance(raw, bytes) else str(raw)
        name = self.kind.name
        if not DIGEST_PATTERN.match(digest):
            log.warning("%s store: id %s… maps to no content digest in Redis; treated as absent", name, upload_id[:8])
            return None
        item = self.local.get(digest)  # the same content uploaded under another id, decoded here already
        if item is None:
            data = self._getex(self._blob_key(digest))
            if data is None:
                return None
            if len(data) > self.max_item_bytes:  # not something an upload here could have written
                log.warning("%s store: %s… in Redis holds %d bytes, over redis_max_item_bytes; treated as absent",
                            name, digest[:8], len(data))
                return None
            if content_digest(data) != digest:  # altered or mixed up in Redis
                log.warning("%s store: the bytes under %s… in Redis do not hash to it; treated as absent", name, digest[:8])
                return None
            try:  # another replica accepted these bytes; decode them under this replica's limits
                decoded = self.kind.decode(data)
            except self.kind.decode_errors as exc:
                log.warning("%s store: %s… from Redis no longer decodes here (%s); treated as absent", name, digest[:8], exc)
                return None
            item = self.local.put(digest, decoded)
        self.ids.put(upload_id, digest)
        return self.kind.with_id(item, upload_id)

    def __contains__(self, upload_id: str) -> bool:
        digest = self.ids.get(upload_id)  # this replica's decoded copies only (no round trip)
        return digest is not None and digest in self.local


def build_upload_store(settings: Settings, kind: UploadKind) -> UploadStore:
    return RedisUploadStore(settings, kind) if settings.redis_url else MemoryUploadStore(kind)


def image_kind(settings: Settings) -> UploadKind:
    return UploadKind(
        name="image", key_prefix=settings.redis_key_prefix,
        new_local=lambda: ImageStore(max_items=settings.image_cache_items, max_bytes=settings.image_cache_bytes),
        id_items=16 * settings.image_cache_items,
        decode=lambda data: decode_image(data, settings.max_image_pixels, settings.max_image_aspect_ratio),
        decode_errors=(ImageInputError,), with_id=_as_id,
    )


def build_image_store(settings: Settings) -> UploadStore:
    configure_pillow(settings.max_image_pixels)
    return build_upload_store(settings, image_kind(settings))


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
