"""The run store's RAM tier (app/runstore.py ResultCache is made of this, app/runstore_disk.py and its owner there):
hot runs in host memory (on a GPU device memory for what stays there), bounded by `max_items`, `max_bytes` and
`max_device_bytes`. Making room takes the least recently used runs first: unpinned ones leave (to disk, or dropped
when there is no room there), then with a disk tier pinned ones (to disk). `evict_for` frees RAM for the memory
accountant (app/memory.py counts `host_bytes`)."""
from __future__ import annotations

import sys
import threading
import time
from collections import Counter, OrderedDict

from app.runstore_disk import _Write
from models.adapters.base import AttentionResult


# References to a kept run when only the RAM tier holds it, as _remeasure counts them: the tier's dict, the loop's
# variable and getrefcount's own argument (CPython). More holders only make a run be measured again: the safe side.
_STORE_ONLY_REFS = 3


class RamTier:
    """The RAM tier's part of the store (its books are the owner's lock and state, set in ResultCache.__init__)."""

    max_items: int
    max_bytes: int
    max_device_bytes: int
    pin_s: float
    _items: OrderedDict[tuple, AttentionResult]  # the RAM tier, least recently used first
    _sizes: dict[tuple, tuple[int, int]]  # key → (host bytes, device bytes) of the RAM tier
    _pins: dict[tuple, tuple[float, str]]  # key → (pinned until, monotonic; the client it was put for)
    _held: Counter[tuple]  # keys a running job plans (holding): never dropped meanwhile
    _run_keys: dict[str, tuple]
    _bytes: int
    _device_bytes: int
    _stuck: set[tuple]  # pinned runs that found no room on disk when they were to leave RAM (stuck_pins)
    _settled: set[tuple]  # measured while only the store held them (_remeasure)
    _lock: threading.Lock

    @property
    def host_bytes(self) -> int:
        """Host bytes of the RAM tier: what the memory accountant counts (disk-tier runs are not counted)."""
        return self._bytes

    @property
    def device_bytes(self) -> int:
        return self._device_bytes

    def _admit(self, key: tuple, result: AttentionResult, client: str, sizes: tuple[int, int] | None = None) -> None:
        """Into the RAM tier (over its bounds until make_room); `sizes`: its (host, device) bytes when just measured."""
        host, device = sizes if sizes is not None else result.host_and_device_nbytes
        with self._lock:
            if key in self._items:
                return
            self._items[key] = result
            self._sizes[key] = (host, device)
            self._pins.setdefault(key, (time.monotonic() + self.pin_s, client))
            self._bytes += host
            self._device_bytes += device
            if result.run_id is not None:
                self._run_keys[result.run_id] = key
            self._remeasure()

    def _over(self) -> bool:
        """The RAM tier over its bounds, runs on their way to disk not counted (they leave when written)."""
        return (len(self._items) - len(self._moving) > self.max_items or self._bytes - self._leaving[0] > self.max_bytes
                or self._device_bytes - self._leaving[1] > self.max_device_bytes)

    def make_room(self, keep: tuple | None = None) -> None:
        """Bring the RAM tier within its bounds: the least recently used unpinned runs leave first (to disk, or
        dropped when there is no room there), then with a disk tier pinned ones (to disk). `keep` (the run just put)
        stays in RAM unless it alone is over the bounds."""
        with self._lock:
            host, device = self._sizes.get(keep, (0, 0))
            fits = host <= self.max_bytes and device <= self.max_device_bytes and self.max_items > 0
        stuck = {keep} if keep is not None and fits else set()  # runs that could not leave are not tried again
        while True:
            with self._lock:
                if not self._over():
                    return
                victim = self._victim(exclude=stuck)
            if victim is None:  # only pinned runs are left and no room on disk: they stay (the accountant counts them)
                return
            if self._leave_ram(victim[0], may_drop=not victim[1]) is None:
                stuck.add(victim[0])

    def _victim(self, exclude: set[tuple]) -> tuple[tuple, bool] | None:
        """(key, pinned) of the run to leave RAM next: the least recently used unpinned one; with a disk tier, then
        the least recently used pinned one (it goes to disk, not away). Under the lock."""
        now = time.monotonic()
        candidates = [k for k in self._items if k not in exclude and k not in self._moving]
        unpinned = next((k for k in candidates if not self._pinned(k, now)), None)
        if unpinned is not None:
            return unpinned, False
        if self.disk_tier and candidates:
            return candidates[0], True
        return None

    def _leave_ram(self, key: tuple, may_drop: bool) -> int | _Write | None:
        """Take `key` out of the RAM tier: at once when it has a file; with a disk tier by a write queued for the
        writer thread (it stays readable in RAM until its file is done); else dropped when `may_drop`. Returns the
        host bytes freed, the write under way (its `done` is set when the file is), or None when it stays."""
        with self._lock:
            result = self._items.get(key)
            if result is None:
                return None
            if key in self._disk:  # its file is there already (a GPU run read back): leaving is free
                freed = self._sizes[key][0]
                self._pop_ram(key)
                return freed
            write = self._moving.get(key)
        if write is None and self.disk_tier:
            write = self._queue_write(key, result)
        if write is None:
            with self._lock:
                if not may_drop or key not in self._items or key in self._moving or self._pinned(key, time.monotonic()):
                    if self.disk_tier and key in self._items and key not in self._moving:
                        self._stuck.add(key)  # no room on disk for it: the memory budget counts it until its pin ends
                    return None
                freed = self._sizes[key][0]
                self._drop(key)
                return freed
        return write

    def _pop_ram(self, key: tuple) -> None:
        self._stuck.discard(key)
        self._settled.discard(key)
        self._items.pop(key)
        old_host, old_device = self._sizes.pop(key)
        self._bytes -= old_host
        self._device_bytes -= old_device

    # ---- the memory accountant ------------------------------------------------------------------------------------
    def stuck_pins(self) -> list[tuple[float, int]]:
        """Pinned runs kept in RAM because the disk tier had no room for them (full of pinned runs, or the filesystem
        short of run_store_min_free_bytes), as (seconds until its pin ends, host bytes) each: RAM that nothing frees
        before then, which the memory budget counts against new work (app/memory.py). A run a job holds counts pin_s
        from now. Empty without a disk tier (there the client's own pinned runs are dropped to make room)."""
        with self._lock:
            now = time.monotonic()
            self._stuck = {k for k in self._stuck
                           if k in self._items and k not in self._moving and self._pinned(k, now)}
            return [(self.pin_s if self._held[k] else self._pins.get(k, (now, ""))[0] - now, self._sizes[k][0])
                    for k in self._stuck]

    def evict_for(self, nbytes: int, client: str) -> int:
        """Free at least `nbytes` of RAM-tier host memory if that can be done without taking a run another client may
        still use: unpinned runs first (least recently used first: to disk, or dropped when there is no room there);
        with a disk tier then pinned runs, to disk (any client's: nothing is lost); without one, `client`'s own
        pinned runs, dropped (the client has moved on), never a held one. Runs going to disk free their memory when
        their files are done: this waits for those writes (queued together). Returns the bytes freed."""
        freed, coming = 0, []
        for pass_ in ("unpinned", "pinned"):
            with self._lock:
                now = time.monotonic()
                keys = [k for k in self._items if self._pinned(k, now) == (pass_ == "pinned")]
            for key in keys:
                if freed + sum(w.leaving[0] for w in coming) >= nbytes:
                    break
                if pass_ == "unpinned" or self.disk_tier:
                    left = self._leave_ram(key, may_drop=pass_ == "unpinned")
                    if isinstance(left, _Write):
                        coming.append(left)
                    else:
                        freed += left or 0
                else:
                    with self._lock:
                        own = client and self._pins.get(key, (0.0, ""))[1] == client and not self._held[key]
                        if own and key in self._items:
                            freed += self._sizes[key][0]
                            self._drop(key)
        if coming:
            self._resources.urgent.set()  # a request waits for these: written now, not once requests end
        for write in coming:
            write.done.wait()
            freed += write.freed or 0
        return freed

    def _remeasure(self) -> None:
        """Sizes again (under the lock): a GPU run's P gets a host copy once a consumer needs all of it on the host
        (AttentionResult.attention), value norms are formed when first asked for, so a kept result's bytes can grow
        after it was put. Only while something outside the store holds it: a run measured when the store alone held
        it is settled until it is handed out again (get, by_run_id). Measuring all 64 kept runs at every put was
        ~1 ms of each fresh view (benchmarks/results/first_view_floor_issue55.md)."""
        for key in [k for k in self._items if k not in self._settled]:
            kept = self._items[key]
            if sys.getrefcount(kept) <= _STORE_ONLY_REFS:  # before measuring: a holder could grow it meanwhile
                self._settled.add(key)
            host, device = kept.host_and_device_nbytes
            old_host, old_device = self._sizes[key]
            if (host, device) != (old_host, old_device):
                self._sizes[key] = (host, device)
                self._bytes += host - old_host
                self._device_bytes += device - old_device
