"""A small thread-safe LRU cache bounded by entries and, optionally, by bytes: the one class behind the upload
stores' id maps and decoded items (app/imagestore.py, app/audiostore.py, models/images.ImageStore) and the speech
route's transcripts. No web imports: both app/ and models/ use it."""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class BoundedLRU(Generic[K, V]):
    """At most `max_items` entries and, with `size` given, at most `max_bytes` of size(value) in total: a put evicts
    the least recently used (read or written) until both hold, the new entry too if it alone is over max_bytes.
    Every method takes the cache's own lock."""

    def __init__(self, max_items: int, max_bytes: int | None = None, size: Callable[[V], int] | None = None):
        if max_bytes is not None and size is None:
            raise ValueError("max_bytes needs size(value)")
        self.max_items, self.max_bytes, self._size = max_items, max_bytes, size
        self._items: OrderedDict[K, V] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        """The value (now the most recently used), or None."""
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def put(self, key: K, value: V) -> V:
        """Keep `value` under `key` (replacing any), then evict down to the bounds; returns `value`."""
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None and self._size is not None:
                self._bytes -= self._size(old)
            self._items[key] = value
            if self._size is not None:
                self._bytes += self._size(value)
            while self._items and (len(self._items) > self.max_items
                                   or (self.max_bytes is not None and self._bytes > self.max_bytes)):
                _, evicted = self._items.popitem(last=False)
                if self._size is not None:
                    self._bytes -= self._size(evicted)
        return value

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._bytes = 0

    @property
    def nbytes(self) -> int:
        """The total size of what is kept (0 without `size`)."""
        with self._lock:
            return self._bytes

    def __contains__(self, key: K) -> bool:
        with self._lock:
            return key in self._items

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)
