"""The run store: kept runs (AttentionResults) by cache key and by run id, with their pins (app/runtime.py runs them,
app/routes/runs.py answers windows and rows of them, app/memory.py counts their bytes)."""
from __future__ import annotations

import threading
import time
from collections import OrderedDict

from models.adapters.base import AttentionResult


class ResultCache:
    """LRU of AttentionResults, bounded by item count, host bytes and device bytes (on a GPU a run's tensors stay in
    GPU memory: a short run's P, q̂/k̂ and hidden states, a long run's atlas; max_device_bytes bounds those,
    max_bytes the host memory); each kept result is also found by its run id (`by_run_id`) until it is evicted.

    A result is pinned for `pin_s` after it was put or last read by its run id (its client's next window, row or
    difference): eviction takes unpinned results first, least recently used first, and never a pinned one to make
    room for another put. The memory accountant (app/memory.py) counts pinned bytes and may ask a client's own
    older results to go (`evict_for`)."""

    def __init__(self, max_items: int, max_bytes: int, max_device_bytes: int = 0, pin_s: float = 0.0):
        self.max_items, self.max_bytes, self.max_device_bytes = max_items, max_bytes, max_device_bytes
        self.pin_s = pin_s
        self._items: OrderedDict[tuple, AttentionResult] = OrderedDict()
        self._run_keys: dict[str, tuple] = {}  # run id → cache key
        self._sizes: dict[tuple, tuple[int, int]] = {}  # key → (host bytes, device bytes), measured once
        self._pins: dict[tuple, tuple[float, str]] = {}  # key → (pinned until, monotonic; the client it was put for)
        self._bytes = 0
        self._device_bytes = 0
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    @property
    def host_bytes(self) -> int:
        return self._bytes

    def get(self, key: tuple) -> AttentionResult | None:
        with self._lock:
            result = self._items.get(key)
            if result is None:
                self.misses += 1
                return None
            self._items.move_to_end(key)
            self.hits += 1
            return result

    def __contains__(self, key: tuple) -> bool:  # no LRU move, no hit/miss count
        with self._lock:
            return key in self._items

    def put(self, key: tuple, result: AttentionResult, client: str = "") -> None:
        device = result.device_nbytes
        host = result.nbytes - device
        if host > self.max_bytes or device > self.max_device_bytes or self.max_items <= 0:
            return
        with self._lock:
            if key in self._items:
                return
            self._items[key] = result
            self._sizes[key] = (host, device)
            self._pins[key] = (time.monotonic() + self.pin_s, client)
            self._bytes += host
            self._device_bytes += device
            if result.run_id is not None:
                self._run_keys[result.run_id] = key
            self._remeasure()
            while (len(self._items) > self.max_items or self._bytes > self.max_bytes
                   or self._device_bytes > self.max_device_bytes):
                victim = self._oldest_unpinned(exclude=key)
                if victim is None:  # only pinned results are left: they stay (the accountant counts them)
                    break
                self._evict(victim)

    def _pinned(self, key: tuple, now: float) -> bool:
        return self._pins.get(key, (0.0, ""))[0] > now

    def _oldest_unpinned(self, exclude: tuple | None = None) -> tuple | None:
        now = time.monotonic()
        return next((k for k in self._items if k != exclude and not self._pinned(k, now)), None)

    def _evict(self, key: tuple) -> None:
        evicted = self._items.pop(key)
        old_host, old_device = self._sizes.pop(key)
        self._pins.pop(key, None)
        self._bytes -= old_host
        self._device_bytes -= old_device
        self._run_keys.pop(evicted.run_id, None)

    def evict_for(self, nbytes: int, client: str) -> int:
        """Free at least `nbytes` of host memory if that can be done without taking a run another client may still
        use: unpinned results first (least recently used first), then `client`'s own pinned results, oldest first (the
        client has moved on to a new request). Returns the bytes freed."""
        freed = 0
        with self._lock:
            now = time.monotonic()
            for own_pins in (False, True):
                for key in list(self._items):
                    if freed >= nbytes:
                        return freed
                    if self._pinned(key, now) and not (own_pins and client and self._pins[key][1] == client):
                        continue
                    freed += self._sizes[key][0]
                    self._evict(key)
        return freed

    def _remeasure(self) -> None:
        """Sizes again (under the lock): a GPU run's P gets a host copy once a consumer needs all of it on the host
        (AttentionResult.attention), so a kept result's host bytes can grow after it was put."""
        for key, kept in self._items.items():
            device = kept.device_nbytes
            host = kept.nbytes - device
            old_host, old_device = self._sizes[key]
            if (host, device) != (old_host, old_device):
                self._sizes[key] = (host, device)
                self._bytes += host - old_host
                self._device_bytes += device - old_device

    def by_run_id(self, run_id: str) -> AttentionResult | None:
        """The kept result of that run (marked recently used, its pin renewed), or None once evicted or never kept."""
        with self._lock:
            key = self._run_keys.get(run_id)
            if key is None or key not in self._items:
                return None
            self._items.move_to_end(key)
            until, client = self._pins.get(key, (0.0, ""))
            self._pins[key] = (max(until, time.monotonic() + self.pin_s), client)
            return self._items[key]

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._run_keys.clear()
            self._sizes.clear()
            self._pins.clear()
            self._bytes = self._device_bytes = 0
