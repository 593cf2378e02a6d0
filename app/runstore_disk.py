"""The run store's disk tier (app/runstore.py ResultCache is made of this, app/runstore_ram.py and its owner there):
runs leaving RAM are written to local disk whole, in the dtypes they kept, as a safetensors file of their tensors
with everything else as JSON (app/runfile.py: nothing is ever unpickled), and read back memory-mapped, so a window or
a row reads only the slices it needs (benchmarks/results/run_store.md). The tier has its own budget (`disk_bytes`)
and its own directory, removed when the store is closed or the process exits.

Files are written by one background thread, never in a request's: a run leaving RAM stays readable there, its bytes
booked, until its file is complete (then it leaves at once); a request making room waits at most for a place in the
bounded queue of writes (`write_queue`, the setting run_store_write_queue), never for a write. A write waits for a
moment when no API POST is in flight (at most WRITE_DEFER_S), unless something waits for it. `flush` waits for every
queued write; `close` (the owner's) stops the writer.
"""
from __future__ import annotations

import logging
import os
import queue
import shutil
import tempfile
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from app import runfile
from app.attention import threads_on_this_thread
from app.in_flight import API_POSTS
from models.adapters.base import AttentionResult

log = logging.getLogger("attnlab")

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


class _Resources:
    """What a store owns outside Python's memory: the writer thread, its queue and the directory. No reference to the
    store itself, so that its weakref finalizer (close, or the store collected, or the process exiting) can run."""

    def __init__(self, write_queue: int = WRITE_QUEUE) -> None:
        self.jobs: queue.Queue[_Write | None] = queue.Queue(maxsize=write_queue)
        self.stopping = threading.Event()  # set: the writer skips what is still queued (the directory goes anyway)
        self.urgent = threading.Event()  # set: someone waits for a write (memory, a place in the queue, flush)
        self.thread: threading.Thread | None = None
        self.dir: Path | None = None

    def start(self, store: DiskTier) -> None:
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
    hidden = result.parts("hidden_states")
    if isinstance(hidden, (list, tuple)) and hidden:
        hidden = hidden[0]
    return str(hidden.device) if isinstance(hidden, torch.Tensor) else "cpu"


class DiskTier:
    """The disk tier's part of the store (its books are the owner's lock and state, set in ResultCache.__init__):
    room booked for files, the writes queued for the writer thread and their end, and reading runs back."""

    max_disk_bytes: int  # 0: no disk tier
    disk_min_free: int  # the filesystem keeps at least this free: no write takes it below
    _disk_parent: str | None  # None: the system's temp dir
    _disk: OrderedDict[tuple, _OnDisk]  # the disk tier (a run in RAM may have a file too)
    _moving: OrderedDict[tuple, _Write]  # runs queued or being written to disk (in RAM still)
    _leaving: list[int]  # (host, device) bytes of the RAM tier booked by runs in _moving
    _disk_used: int  # files, and files being written
    _resources: _Resources
    _lock: threading.Lock
    _idle: threading.Condition  # notified when a write ends (flush, evict_for wait on it)
    spills: int
    disk_reads: int

    @property
    def disk_bytes(self) -> int:
        return self._disk_used

    @property
    def disk_tier(self) -> bool:
        return self.max_disk_bytes > 0

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

    def _pop_disk(self, key: tuple) -> None:
        entry = self._disk.pop(key)
        self._disk_used -= entry.nbytes
        entry.path.unlink(missing_ok=True)  # a reader that has it mapped keeps its pages until it lets go
