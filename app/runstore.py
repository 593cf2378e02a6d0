"""The run store: kept runs (AttentionResults) by cache key and by run id, with their pins (app/runtime.py runs them,
app/routes/runs.py answers windows and rows of them, app/memory.py counts their bytes).

A run is a resource with an owner and a lifetime, not a cache entry. Two tiers, and this module is their owner:

- RAM (on a GPU: device memory for what stays there) for hot runs, bounded by `max_items`, `max_bytes` (host) and
  `max_device_bytes` (app/runstore_ram.py RamTier: making room, `evict_for` for the memory accountant, which waits
  for the writes it needs: it frees memory only once they are done);
- local disk for the rest (`disk_bytes`, a directory of its own removed when the store is closed or the process
  exits; app/runstore_disk.py DiskTier: the files, written by one background thread, never in a request's, and read
  back memory-mapped; the directories a killed process left behind are swept).

The owner (ResultCache here, made of both tiers) keeps the books under one lock: the public API the app uses (`get`,
`put`, `by_run_id`, `promise`, `holding`, `stats`, `clear`, `close`), the pins, the expired ids and the promises.

A run is pinned for `pin_s` after it was put or last read by its run id, and held while a job that plans it runs
(`holding`). Making room takes the least recently used runs first: with a disk tier, every run leaving RAM goes to
disk (pinned ones too: their bytes on disk no longer count against the memory budget), and only unpinned runs are
ever dropped, when the disk tier is full. Without one (disk_bytes 0) unpinned runs are dropped and pinned ones stay in
RAM. A dropped run's id is remembered (ids only, a bounded set) so that its 404 says "expired" rather than "unknown".
"""
from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from app.runstore_disk import (  # noqa: F401  (re-exported: the directories' sweep, used at start and exit)
    _LIVE_DIRS, DIR_PREFIX, ORPHAN_AGE_S, OWNER_FILE, WRITE_QUEUE, DiskTier, _boot_id, _OnDisk, _owner,
    _Resources, _start_time, _Write, remove_directories, sweep_directories,
)
from app.runstore_ram import RamTier
from models.adapters.base import AttentionResult

FORGET_AFTER = 65_536  # expired run ids remembered (ids only, ~5 MB at most)
# promised runs remembered (a continuation's kept runs, made on first use: token ids and interventions, no tensors)
PROMISES = 1024


@dataclass
class _Promise:
    """A run named before it is made (a continuation's kept runs, app/routes/text.py): `make()` runs the model once on
    first use of the run id and keeps the run under `key` with that id (app/runtime.py Runtime.promise_run)."""

    key: tuple
    make: Callable[[], AttentionResult]
    lock: threading.Lock = field(default_factory=threading.Lock)  # one maker at a time; the others wait for it


class ResultCache(RamTier, DiskTier):
    """Kept runs in two tiers (see the module doc): RAM/device for hot runs, memory-mapped local disk for the rest.
    `get`/`put` by cache key (app/runtime.py), `by_run_id` by run id (windows, rows, minus), `evict_for` for the
    memory accountant (app/memory.py counts `host_bytes`: RAM-tier bytes only)."""

    def __init__(self, max_items: int, max_bytes: int, max_device_bytes: int = 0, pin_s: float = 0.0,
                 disk_bytes: int = 0, disk_dir: str | None = None, disk_min_free: int = 0,
                 write_queue: int = WRITE_QUEUE):
        self.max_items, self.max_bytes, self.max_device_bytes = max_items, max_bytes, max_device_bytes
        self.pin_s = pin_s
        self.max_disk_bytes = disk_bytes  # 0: no disk tier
        self.disk_min_free = disk_min_free  # the filesystem keeps at least this free: no write takes it below
        self._disk_parent = disk_dir  # None: the system's temp dir
        self._items: OrderedDict[tuple, AttentionResult] = OrderedDict()  # the RAM tier, least recently used first
        self._disk: OrderedDict[tuple, _OnDisk] = OrderedDict()  # the disk tier (a run in RAM may have a file too)
        self._run_keys: dict[str, tuple] = {}  # run id → cache key, while held in either tier
        self._sizes: dict[tuple, tuple[int, int]] = {}  # key → (host bytes, device bytes) of the RAM tier
        self._pins: dict[tuple, tuple[float, str]] = {}  # key → (pinned until, monotonic; the client it was put for)
        self._held: Counter[tuple] = Counter()  # keys a running job plans (holding): never dropped meanwhile
        self._stuck: set[tuple] = set()  # pinned runs in RAM that found no room on disk (RamTier.stuck_pins)
        # RAM-tier runs measured while nothing outside the store held them: they cannot have grown since (RamTier._remeasure)
        self._settled: set[tuple] = set()
        self._expired: OrderedDict[str, None] = OrderedDict()  # run ids this store held and dropped
        self._promised: OrderedDict[str, _Promise] = OrderedDict()  # run ids named, their runs made on first use
        self._moving: OrderedDict[tuple, _Write] = OrderedDict()  # runs queued or being written to disk (in RAM still)
        self._leaving = [0, 0]  # (host, device) bytes of the RAM tier booked by runs in _moving
        self._bytes = self._device_bytes = self._disk_used = 0  # _disk_used: files, and files being written
        self._lock = threading.Lock()  # the books; files are written outside it, by the writer thread
        self._idle = threading.Condition(self._lock)  # notified when a write ends (flush, evict_for wait on it)
        self._resources = _Resources(write_queue)
        self._finalizer = weakref.finalize(self, self._resources.release)
        self.hits = self.misses = 0
        self.spills = self.disk_reads = 0  # runs written to disk; runs read back from disk (for the benchmarks)

    def stats(self) -> dict[str, int]:
        """Runs and bytes per tier; `writing_runs`: runs in RAM still, their files being written (disk_bytes counts
        those files already)."""
        with self._lock:
            return {"ram_runs": len(self._items), "disk_runs": sum(k not in self._items for k in self._disk),
                    "writing_runs": len(self._moving), "ram_bytes": self._bytes, "device_bytes": self._device_bytes,
                    "disk_bytes": self._disk_used}

    # ---- by key (the runtime) ---------------------------------------------------------------------------------
    def get(self, key: tuple) -> AttentionResult | None:
        """The run kept under `key`, from RAM, or from disk (memory-mapped; on a GPU loaded back onto its device and
        put in RAM again, so the compute path never mixes devices); None when it is not kept."""
        with self._lock:
            result = self._items.get(key)
            if result is not None:
                self._items.move_to_end(key)
                self._settled.discard(key)  # handed out: it may grow (a host copy, value norms) while it is used
                self.hits += 1
                return result
            entry = self._disk.get(key)
            if entry is None:
                self.misses += 1
                return None
            self._disk.move_to_end(key)
            self.hits += 1
        if entry.device == "cpu":
            return self._read(key, entry)
        result = self._load(entry.path, entry.device)
        if result is None:
            return None
        self._admit(key, result, self._pins.get(key, (0.0, ""))[1])  # its file stays: leaving RAM again is free
        self.make_room(keep=key)
        return result

    def __contains__(self, key: tuple) -> bool:  # no LRU move, no hit/miss count
        with self._lock:
            return key in self._items or key in self._disk

    def put(self, key: tuple, result: AttentionResult, client: str = "", make_room: bool = True) -> None:
        """Keep `result` under `key` (pinned for pin_s, for `client`) in the RAM tier, then make room there (older runs
        move to disk, or go when unpinned; a run too large for RAM goes to disk itself: each by the writer thread, the
        run answering from RAM until its file is done). `make_room=False` leaves that to a later make_room(keep=key)
        call, so that a caller holding the model's lock does not hold it while waiting for a place in the queue of
        writes. Without a disk tier a run too large for RAM is not kept (its id then says expired)."""
        host, device = result.host_and_device_nbytes
        with self._lock:
            if key in self._items or key in self._disk:
                return
            self._pins[key] = (time.monotonic() + self.pin_s, client)
            if result.run_id is not None:
                self._run_keys[result.run_id] = key
            if not self.disk_tier and (host > self.max_bytes or device > self.max_device_bytes or self.max_items <= 0):
                self._forget(key, result.run_id)
                return
        self._admit(key, result, client, (host, device))
        if make_room:
            self.make_room(keep=key)

    def _pinned(self, key: tuple, now: float) -> bool:
        return self._held[key] > 0 or self._pins.get(key, (0.0, ""))[0] > now

    def _drop(self, key: tuple) -> None:
        """The run leaves the store: its id is remembered as expired."""
        run_id = None
        if key in self._items:
            run_id = self._items[key].run_id
            self._pop_ram(key)
        if key in self._disk:
            run_id = run_id or self._disk[key].run_id
            self._pop_disk(key)
        write = self._moving.get(key)
        if write is not None:  # its write is queued or under way: cancelled, its booking given back now
            write.cancelled = True
            self._end_move(write)
            self._disk_used -= write.booked
            write.booked = 0
            self._idle.notify_all()
        self._forget(key, run_id)

    def _forget(self, key: tuple, run_id: str | None) -> None:
        self._pins.pop(key, None)
        if run_id is not None and self._run_keys.get(run_id) == key:
            del self._run_keys[run_id]
            self._expired[run_id] = None
            while len(self._expired) > FORGET_AFTER:
                self._expired.popitem(last=False)

    def _evict(self, key: tuple) -> None:  # the name earlier callers used: drop it from the store
        self._drop(key)

    # ---- by run id (windows, rows, minus) ----------------------------------------------------------------------
    def promise(self, run_id: str, key: tuple, make: Callable[[], AttentionResult]) -> None:
        """Name a run before it is made: the first `by_run_id(run_id)` calls `make()` (one forward, which keeps the run
        under `key` with this id) and answers its run. Promises cost no tensors; the oldest past PROMISES are dropped
        (their ids then say expired), like runs."""
        with self._lock:
            self._promised[run_id] = _Promise(key, make)
            while len(self._promised) > PROMISES:
                old, _ = self._promised.popitem(last=False)
                self._expired[old] = None

    def _keep_promise(self, run_id: str, promise: _Promise) -> AttentionResult | None:
        """Make a promised run (once: a second caller waits for the first) and keep it under its id."""
        with promise.lock:
            with self._lock:
                made = run_id in self._run_keys
            if not made:
                result = promise.make()
                with self._lock:
                    # the same key already kept under another id (a run made meanwhile): this id names that run too
                    if promise.key in self._items or promise.key in self._disk:
                        self._run_keys.setdefault(run_id, promise.key)
                    if self._promised.get(run_id) is promise:
                        del self._promised[run_id]
                return result
        return self.by_run_id(run_id)

    def by_run_id(self, run_id: str) -> AttentionResult | None:
        """The kept run (marked recently used, its pin renewed): from RAM, or memory-mapped from disk; a promised run
        (`promise`) made now; None when this store does not hold it (see `why_missing`)."""
        with self._lock:
            key = self._run_keys.get(run_id)
            if key is None:
                promise = self._promised.get(run_id)
                if promise is None:
                    return None
            else:
                promise = None
                until, client = self._pins.get(key, (0.0, ""))
                self._pins[key] = (max(until, time.monotonic() + self.pin_s), client)
                result = self._items.get(key)
                if result is not None:
                    self._items.move_to_end(key)
                    self._settled.discard(key)
                    return result
                entry = self._disk.get(key)
                if entry is None:
                    return None
                self._disk.move_to_end(key)
        if promise is not None:
            return self._keep_promise(run_id, promise)
        return self._read(key, entry)

    def why_missing(self, run_id: str) -> str:
        """'expired' when this store held the run and dropped it, else 'unknown' (never held here)."""
        with self._lock:
            return "expired" if run_id in self._expired else "unknown"

    @contextlib.contextmanager
    def holding(self, keys: Iterable[tuple]) -> Iterator[None]:
        """While a job runs: the runs it plans (kept already, or put while it runs) are never dropped; they may move
        to disk. A compare whose base was kept is never made to compute the base again."""
        keys = list(dict.fromkeys(keys))
        with self._lock:
            self._held.update(keys)
        try:
            yield
        finally:
            with self._lock:
                self._held.subtract(keys)
                for key in keys:
                    if self._held[key] <= 0:
                        del self._held[key]

    def clear(self) -> None:
        with self._lock:
            self._promised.clear()
            for key in list(self._items) + [k for k in self._disk if k not in self._items]:
                self._drop(key)

    def close(self) -> None:
        """Every run dropped (queued writes cancelled), the writer thread stopped and the disk tier's directory
        removed (also done when the store is collected, or at exit)."""
        self.clear()
        self._finalizer()


RunStore = ResultCache  # the name it goes by in the docs
