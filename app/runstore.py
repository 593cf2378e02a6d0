"""The run store: kept runs (AttentionResults) by cache key and by run id, with their pins (app/runtime.py runs them,
app/routes/runs.py answers windows and rows of them, app/memory.py counts their bytes).

A run is a resource with an owner and a lifetime, not a cache entry. Two tiers:

- RAM (on a GPU: device memory for what stays there) for hot runs, bounded by `max_items`, `max_bytes` (host) and
  `max_device_bytes`;
- local disk for the rest (`disk_bytes`, a directory of its own removed when the store is closed or the process
  exits): a run leaving RAM is written there whole, in the dtypes it kept, as a safetensors file of its tensors with
  everything else as JSON (app/runfile.py: nothing is ever unpickled), and read back memory-mapped, so a window or a
  row reads only the slices it needs (benchmarks/results/run_store.md).

Files are written by one background thread, never in a request's: a run leaving RAM stays readable there, its bytes
booked, until its file is complete (then it leaves at once); a request making room waits at most for a place in the
bounded queue of writes (`write_queue`, the setting run_store_write_queue), never for a write. A write waits for a
moment when no API POST is in flight (at most WRITE_DEFER_S), unless something waits for it. The memory accountant's
`evict_for` waits for the writes it needs (it frees memory only once they are done). `flush` waits for every queued
write; `close` stops the writer.

A run is pinned for `pin_s` after it was put or last read by its run id, and held while a job that plans it runs
(`holding`). Making room takes the least recently used runs first: with a disk tier, every run leaving RAM goes to
disk (pinned ones too: their bytes on disk no longer count against the memory budget), and only unpinned runs are
ever dropped, when the disk tier is full. Without one (disk_bytes 0) unpinned runs are dropped and pinned ones stay in
RAM. A dropped run's id is remembered (ids only, a bounded set) so that its 404 says "expired" rather than "unknown".
"""
from __future__ import annotations

import contextlib
import logging
import os
import queue
import shutil
import tempfile
import threading
import time
import weakref
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from app import runfile
from app.attention import threads_on_this_thread
from app.in_flight import API_POSTS
from models.adapters.base import AttentionResult

log = logging.getLogger("attnlab")

FORGET_AFTER = 65_536  # expired run ids remembered (ids only, ~5 MB at most)
# promised runs remembered (a continuation's kept runs, made on first use: token ids and interventions, no tensors)
PROMISES = 1024
# writes queued for the disk tier beside the one being written: a request making room waits for a place when more
# runs leave RAM than the disk takes (each queued run stays booked in RAM until written, so this bounds the overshoot)
WRITE_QUEUE = 4  # the default of run_store_write_queue
# A queued write waits at most this long for no API POST to be in flight (app/in_flight.py), unless something waits
# for it. Written during a first view's response work, a run leaving RAM cost smollm2-135m's views
# ~11 ms each (21.4 against 9.9 ms of work besides the forward; benchmarks/results/first_view.md).
WRITE_DEFER_S = 1.0
URGENT_POLL_S = 0.05  # how often a deferred write looks again whether it is awaited


# ---- the disk tier's directories -----------------------------------------------------------------------------
# Each store's directory names its process in OWNER_FILE: "<boot id> <pid> <start time>". A process that dies without
# removing it (SIGKILL, the OOM killer, os._exit) leaves files behind that nothing reads, gigabytes a day on a test
# machine; the next store to make a directory in the same parent removes those whose process is gone.
DIR_PREFIX = "attnlab-runs-"
OWNER_FILE = "owner"
ORPHAN_AGE_S = 3600.0  # a directory with no owner file (an older version's) is removed once untouched this long
_LIVE_DIRS: set[Path] = set()  # this process's directories, removed by remove_directories() at a hard exit


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "-"


def _start_time(pid: int) -> str:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat), so that a reused pid is
    not taken for the owner; "-" where there is no /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "-"
    return stat.rsplit(")", 1)[1].split()[19]


def _owner() -> str:
    return f"{_boot_id()} {os.getpid()} {_start_time(os.getpid())}"


def _owner_alive(text: str) -> bool:
    try:
        boot, pid_text, start = text.split()
        pid = int(pid_text)
    except ValueError:
        return False  # unreadable: no process can claim it
    if boot != _boot_id():
        return False  # written before this machine last booted
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, another user's
    return _start_time(pid) == start


def sweep_directories(parent: Path) -> list[Path]:
    """Remove the disk-tier directories in `parent` whose process is gone (their runs can never be read again).
    A directory of another user, or of a live process, is left alone. Returns those removed."""
    removed = []
    for path in parent.glob(DIR_PREFIX + "*"):
        try:
            if not path.is_dir() or path.stat().st_uid != os.getuid() or path in _LIVE_DIRS:
                continue
            owner = path / OWNER_FILE
            if owner.exists():
                if _owner_alive(owner.read_text()):
                    continue
            elif time.time() - path.stat().st_mtime < ORPHAN_AGE_S:
                continue  # being made by a process that has not written its owner file yet, or an older version's
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        log.info("run store: removed %s, left behind by a process that is gone", path)
        removed.append(path)
    return removed


def remove_directories() -> None:
    """Remove this process's disk-tier directories now: for a hard exit (os._exit skips the stores' finalizers)."""
    for path in list(_LIVE_DIRS):
        shutil.rmtree(path, ignore_errors=True)
        _LIVE_DIRS.discard(path)


@dataclass
class _OnDisk:
    """A run's file in the disk tier."""

    path: Path
    nbytes: int  # the file's size
    device: str  # where the run ran ("cpu", "cuda:0"): the compute path loads it back there
    run_id: str | None
    loaded: AttentionResult | None = None  # the memory-mapped result, once read (its pages read on demand)


@dataclass
class _Write:
    """A run on its way to the disk tier: it stays readable in RAM, its bytes booked there, until the file is done."""

    key: tuple
    run_file: runfile.RunFile | None  # the header and tensor references; let go once written
    path: Path
    device: str
    run_id: str | None
    leaving: tuple[int, int]  # (host, device) bytes of the RAM tier that leave with it
    booked: int  # disk-tier bytes booked for the file (0 once cancelled)
    cancelled: bool = False  # the run was dropped meanwhile: no file is kept
    freed: int | None = None  # host bytes the RAM tier gave back once the file was done; None: it stayed
    done: threading.Event = field(default_factory=threading.Event)


@dataclass
class _Promise:
    """A run named before it is made (a continuation's kept runs, app/routes/text.py): `make()` runs the model once on
    first use of the run id and keeps the run under `key` with that id (app/runtime.py Runtime.promise_run)."""

    key: tuple
    make: Callable[[], AttentionResult]
    lock: threading.Lock = field(default_factory=threading.Lock)  # one maker at a time; the others wait for it


class _Resources:
    """What a store owns outside Python's memory: the writer thread, its queue and the directory. No reference to the
    store itself, so that its weakref finalizer (close, or the store collected, or the process exiting) can run."""

    def __init__(self, write_queue: int = WRITE_QUEUE) -> None:
        self.jobs: queue.Queue[_Write | None] = queue.Queue(maxsize=write_queue)
        self.stopping = threading.Event()  # set: the writer skips what is still queued (the directory goes anyway)
        self.urgent = threading.Event()  # set: someone waits for a write (memory, a place in the queue, flush)
        self.thread: threading.Thread | None = None
        self.dir: Path | None = None

    def start(self, store: ResultCache) -> None:
        """The writer thread, on the first write."""
        if self.thread is None:
            self.thread = threading.Thread(target=_write_runs, name="attnlab-run-writer", daemon=True,
                                           args=(self, weakref.ref(store)))
            self.thread.start()

    def release(self) -> None:
        """Stop the writer (the write under way ends; queued ones are skipped) and remove the directory."""
        thread, self.thread = self.thread, None
        if thread is not None:
            self.stopping.set()
            self.urgent.set()
            self.jobs.put(None)
            if thread is not threading.current_thread():
                thread.join(timeout=120)
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            _LIVE_DIRS.discard(self.dir)


def _write_runs(resources: _Resources, store_ref: weakref.ref) -> None:
    """The writer thread: one queued run at a time into its file (a weak reference: the store may go meanwhile).

    Its torch work (a non-contiguous q̂/k̂ made contiguous for the file) runs on this thread alone. On more threads it
    would start an OpenMP team of its own, and once a process has more OpenMP threads than cores, GNU OpenMP spins far
    less before sleeping: the forward's threads then slept and woke at every parallel region (~440 voluntary and ~300
    involuntary context switches a 128-token minilm view instead of ~13, its model part 41 ms instead of 26-28 ms, on
    2 cores once the result cache was full and spilling; benchmarks/results/first_view.md)."""
    with threads_on_this_thread(1):
        _write_queued_runs(resources, store_ref)


def _write_queued_runs(resources: _Resources, store_ref: weakref.ref) -> None:
    jobs, stopping = resources.jobs, resources.stopping
    while True:
        write = jobs.get()
        if write is None:
            return
        _wait_for_quiet(resources)
        store = store_ref()
        if store is None or stopping.is_set():
            write.done.set()  # nobody waits for it long: the store is closing
            continue
        store._write(write)
        del store
        if jobs.empty():
            resources.urgent.clear()


def _wait_for_quiet(resources: _Resources) -> None:
    """Before a write: wait, at most WRITE_DEFER_S, for no API POST to be in flight (from its admission to the end of its
    response), so that the file's CPU time and memory traffic do not land on a view's response; at once when a write is
    awaited (`urgent`: the memory accountant, a put waiting for a place in the queue, flush, close)."""
    deadline = time.monotonic() + WRITE_DEFER_S
    while not resources.urgent.is_set():
        left = deadline - time.monotonic()
        if left <= 0 or API_POSTS.wait_for_none(min(left, URGENT_POLL_S)):
            return


def _device_of(result) -> str:
    """Where the run's hidden states are, read without forming them (a run may keep them per layer, stacked when
    first read: models/adapters/base.py)."""
    hidden = vars(result).get("hidden_states")
    if isinstance(hidden, (list, tuple)) and hidden:
        hidden = hidden[0]
    return str(hidden.device) if isinstance(hidden, torch.Tensor) else "cpu"


class ResultCache:
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

    # ---- sizes ----------------------------------------------------------------------------------------------
    @property
    def host_bytes(self) -> int:
        """Host bytes of the RAM tier: what the memory accountant counts (disk-tier runs are not counted)."""
        return self._bytes

    @property
    def device_bytes(self) -> int:
        return self._device_bytes

    @property
    def disk_bytes(self) -> int:
        return self._disk_used

    @property
    def disk_tier(self) -> bool:
        return self.max_disk_bytes > 0

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

    def _pinned(self, key: tuple, now: float) -> bool:
        return self._held[key] > 0 or self._pins.get(key, (0.0, ""))[0] > now

    # ---- leaving RAM: to disk, or away -----------------------------------------------------------------------
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
                    return None
                freed = self._sizes[key][0]
                self._drop(key)
                return freed
        return write

    def _queue_write(self, key: tuple, result: AttentionResult) -> _Write | None:
        """Book room on disk for `result`'s file and queue its write; None when it cannot fit beside the pinned runs
        there (or holds something a run's file cannot: logged). Waits only for a place in the queue."""
        try:
            run_file = runfile.encode(result)  # shapes and dtypes only: no copy
        except (TypeError, ValueError):
            log.exception("run store: a run's file cannot hold this run")
            return None
        directory = self._directory()
        with self._lock:
            if key in self._moving or key not in self._items:
                return self._moving.get(key)
            if not self._disk_room(run_file.nbytes):
                return None
            write = _Write(key, run_file, directory / f"{os.urandom(12).hex()}.safetensors", _device_of(result),
                           result.run_id, self._sizes[key], run_file.nbytes)
            self._moving[key] = write
            self._leaving[0] += write.leaving[0]
            self._leaving[1] += write.leaving[1]
            self._disk_used += write.booked
            self._resources.start(self)
        if self._resources.jobs.full():
            self._resources.urgent.set()  # the writer may be waiting for this very request to end
        self._resources.jobs.put(write)  # the only wait a request may see: for a place in the bounded queue
        return write

    def _write(self, write: _Write) -> None:
        """In the writer thread: the file, then the books (the run leaves RAM; a dropped run's file goes; a failed
        write gives its booking back and the run stays, or goes when unpinned, as without a disk tier)."""
        ok = False
        if not write.cancelled:
            try:
                runfile.write(write.run_file, write.path)
                ok = True
            except Exception:  # noqa: BLE001  (logged; the run stays or goes as without a disk tier)
                log.exception("run store: writing a run to %s failed", write.path.parent)
        write.run_file = None
        with self._lock:
            if self._moving.get(write.key) is write:
                self._end_move(write)
                if ok:
                    self._disk[write.key] = _OnDisk(write.path, write.booked, write.device, write.run_id)
                    self.spills += 1
                    if write.key in self._items:
                        write.freed = self._sizes[write.key][0]
                        self._pop_ram(write.key)
                else:
                    self._disk_used -= write.booked
                    if write.key in self._items and not self._pinned(write.key, time.monotonic()):
                        self._drop(write.key)
            if not ok or write.cancelled:
                write.path.unlink(missing_ok=True)
            write.done.set()
            self._idle.notify_all()

    def _end_move(self, write: _Write) -> None:
        """`write` no longer in _moving (done, or cancelled by a drop). Under the lock."""
        del self._moving[write.key]
        self._leaving[0] -= write.leaving[0]
        self._leaving[1] -= write.leaving[1]

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every write queued so far is done (tests and benchmarks reading the disk tier's books, close).
        False when `timeout` passed first."""
        self._resources.urgent.set()
        with self._idle:
            return self._idle.wait_for(lambda: not self._moving, timeout)

    def _disk_room(self, nbytes: int) -> bool:
        """Make room for `nbytes` in the disk tier by dropping unpinned runs there (least recently used first; a run
        still in RAM only loses its file), then unpinned runs whose writes are queued (dropped: they were leaving RAM
        and there is no room for them). False, dropping nothing, when the pinned ones leave too little. Under the
        lock."""
        capacity = self._disk_capacity()
        if nbytes > capacity:
            return False
        now = time.monotonic()
        free = capacity - self._disk_used
        if free >= nbytes:
            return True
        loose = [k for k in self._disk if k in self._items or not self._pinned(k, now)]
        loose += [k for k in self._moving if not self._pinned(k, now)]
        sizes = {**{k: w.booked for k, w in self._moving.items()}, **{k: e.nbytes for k, e in self._disk.items()}}
        if free + sum(sizes[k] for k in loose) < nbytes:
            return False
        for k in loose:
            if capacity - self._disk_used >= nbytes:
                break
            if k in self._items and k in self._disk:
                self._pop_disk(k)
            else:
                self._drop(k)
        return True

    def _disk_capacity(self) -> int:
        """The disk tier's budget, less what the filesystem lacks: its free space beyond `disk_min_free` (files
        still being written not yet counted there). A full disk fails every write, the lab's and everyone else's;
        runs that find no room stay in RAM or go, as with the tier full. Under the lock."""
        where = self._resources.dir or self._disk_parent or tempfile.gettempdir()
        try:
            free = shutil.disk_usage(where).free
        except OSError:  # the parent not made yet: judged when the directory is
            return self.max_disk_bytes
        unwritten = sum(w.booked for w in self._moving.values())
        return min(self.max_disk_bytes, self._disk_used + max(0, free - unwritten - self.disk_min_free))

    def _directory(self) -> Path:
        """This store's own directory (made on the first write, removed with the store or at exit; directories
        that processes killed before they could remove them left behind are removed first: `sweep_directories`)."""
        with self._lock:
            if self._resources.dir is None:
                parent = Path(self._disk_parent or tempfile.gettempdir())
                parent.mkdir(parents=True, exist_ok=True)
                sweep_directories(parent)
                self._resources.dir = Path(tempfile.mkdtemp(prefix=DIR_PREFIX, dir=parent))  # mode 0700
                (self._resources.dir / OWNER_FILE).write_text(_owner())
                _LIVE_DIRS.add(self._resources.dir)
            return self._resources.dir

    @property
    def _dir(self) -> Path | None:
        return self._resources.dir

    # ---- reading from disk ------------------------------------------------------------------------------------
    @staticmethod
    def _load(path: Path, device: str = "cpu") -> AttentionResult | None:
        """The run in `path`, its tensors memory-mapped (on a GPU copied back to `device`); None when the file went."""
        try:
            return runfile.read(path, device)  # tensors and JSON only (app/runfile.py): nothing is unpickled
        except FileNotFoundError:
            return None

    def _read(self, key: tuple, entry: _OnDisk) -> AttentionResult | None:
        if entry.loaded is not None:
            return entry.loaded
        loaded = self._load(entry.path)
        with self._lock:
            self.disk_reads += 1
            if loaded is not None and self._disk.get(key) is entry:
                if entry.loaded is None:
                    entry.loaded = loaded
                return entry.loaded
        return loaded

    # ---- the books (under the lock) -----------------------------------------------------------------------------
    def _pop_ram(self, key: tuple) -> None:
        self._items.pop(key)
        old_host, old_device = self._sizes.pop(key)
        self._bytes -= old_host
        self._device_bytes -= old_device

    def _pop_disk(self, key: tuple) -> None:
        entry = self._disk.pop(key)
        self._disk_used -= entry.nbytes
        entry.path.unlink(missing_ok=True)  # a reader that has it mapped keeps its pages until it lets go

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

    # ---- the memory accountant ------------------------------------------------------------------------------------
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
        (AttentionResult.attention), so a kept result's host bytes can grow after it was put."""
        for key, kept in self._items.items():
            host, device = kept.host_and_device_nbytes
            old_host, old_device = self._sizes[key]
            if (host, device) != (old_host, old_device):
                self._sizes[key] = (host, device)
                self._bytes += host - old_host
                self._device_bytes += device - old_device

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
