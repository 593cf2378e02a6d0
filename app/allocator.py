"""The served process's policy for glibc's malloc (docs/deploy.md "Memory allocator"): the arena bound it starts
with (shared by the `attnlab serve` entry point, app/cli.py, and the server itself, app/serve.py), the warm heap that
keeps the next run's page faults off the request, and the periodic malloc_trim that gives the rest back."""
from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import queue
import resource
import signal
import sys
import threading
import time
from collections.abc import Mapping

log = logging.getLogger("attnlab")

# The allocator bound (docs/deploy.md "Memory allocator"). glibc's malloc gives threads that allocate at once arenas
# of their own (up to 8 per core) and keeps what is freed inside them, for reuse by that arena only: under a mixed
# load of 20 clients RSS grew from 1.65 to 5.57 GB, 4.58 GB of it still held once the result cache was emptied; with
# 2 arenas the same load peaked at 3.9 GB (benchmarks/results/allocator.md). glibc reads MALLOC_ARENA_MAX once,
# before the process's first allocation, so the server re-executes itself with it set.
ARENA_ENV = "MALLOC_ARENA_MAX"
ARENA_SETTING = "ATTNLAB_MALLOC_ARENA_MAX"  # app/settings.py malloc_arena_max; 0: glibc's own default
NO_BOUND_FLAG = "--no-allocator-bound"
DEFAULT_ARENAS = 2
OWN_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")  # preloaded by the operator: their own arenas, left alone


def arena_setting(environ: Mapping[str, str]) -> int:
    raw = environ.get(ARENA_SETTING, str(DEFAULT_ARENAS)).strip()
    value = int(raw) if raw.isdigit() else -1
    if value < 0:
        raise SystemExit(f"{ARENA_SETTING}={raw!r}: a whole number of malloc arenas (0: glibc's own default)")
    return value


def allocator_environ(environ: Mapping[str, str]) -> dict[str, str] | None:
    """The environment the server must start with for the allocator bound, or None when it already has what it
    needs: MALLOC_ARENA_MAX set by the user (kept as it is), an allocator of its own preloaded, or the bound off."""
    if ARENA_ENV in environ or any(name in environ.get("LD_PRELOAD", "") for name in OWN_ALLOCATORS):
        return None
    arenas = arena_setting(environ)
    return None if arenas == 0 else {**environ, ARENA_ENV: str(arenas)}


def allocator_report(environ: Mapping[str, str]) -> str:
    """What bounds this process's allocator, for the start-up log."""
    preload = environ.get("LD_PRELOAD", "")
    if any(name in preload for name in OWN_ALLOCATORS):
        return f"LD_PRELOAD={preload}"
    if ARENA_ENV in environ:
        return f"{ARENA_ENV}={environ[ARENA_ENV]}"
    return f"glibc's default malloc arenas (8 per core; {ARENA_SETTING}=0 or {NO_BOUND_FLAG})"


def bound_allocator(module: str, args: list[str]) -> list[str]:
    """`args` without --no-allocator-bound; when the bound is on and not yet in this process's environment, replace
    the process (same pid) by `python -m module args` with MALLOC_ARENA_MAX set, and never return."""
    if NO_BOUND_FLAG in args:
        args = [a for a in args if a != NO_BOUND_FLAG]
        os.environ[ARENA_SETTING] = "0"  # the settings (and a re-executed child) see the choice too
        os.environ["ATTNLAB_MALLOC_TRIM_INTERVAL_S"] = "0"  # and no periodic malloc_trim (app/serve.py)
        os.environ["ATTNLAB_WARM_HEAP_BYTES"] = "0"  # nor a warm heap (its thresholds are mallopt's)
    environ = allocator_environ(os.environ)
    if environ is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        # A SIGTERM while the new image starts (`docker stop` of a starting server) would kill it with status 143:
        # blocked across exec (the mask and a pending signal survive it), it is taken by app/serve.py's exit-at-once
        # handler as soon as that is installed (main() unblocks it).
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        os.execve(sys.executable, [sys.executable, "-m", module, *args], environ)
    return args


# ---- the warm heap (docs/deploy.md "Memory allocator") -------------------------------------------------------------
# A fresh view keeps its run (P, q̂/k̂, hidden states: ~8.5 MB at 128 tokens of minilm) in new memory while the result
# cache grows, and the kernel maps each new page at its first write, inside the forward: ~2,750 minor faults a view,
# 4-6 ms of a 22 ms forward on the CI machine, far more on a VM whose host backs memory lazily
# (benchmarks/results/first_view.md). Mapping that memory after the previous response, instead, takes the faults
# off the request's path: with it the served model part fell from 1.18x to 1.00x a raw forward.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (glibc's malloc.h)
MADV_POPULATE_WRITE = 23  # Linux 5.14+: map the range's pages as a write would, without the write
MMAP_THRESHOLD = 32 * 2**20  # the ceiling of glibc's own dynamic threshold: smaller chunks come from the heap
WARM_CHUNK = 4 * 2**20  # taken in chunks under MMAP_THRESHOLD, so that they go back to the heap, not to the kernel


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL | None:
    """glibc (2.33+: mallinfo2), loaded once with the signatures used here; None elsewhere (musl, macOS)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    if not all(hasattr(libc, f) for f in ("mallopt", "malloc_trim", "mallinfo2")):
        return None
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    libc.mallinfo2.restype = _Mallinfo2
    return libc


def _glibc(environ: Mapping[str, str] = os.environ) -> ctypes.CDLL | None:
    """glibc, or None elsewhere and under a preloaded allocator of its own (it purges by itself)."""
    if sys.platform != "linux" or any(name in environ.get("LD_PRELOAD", "") for name in OWN_ALLOCATORS):
        return None
    return _libc()


def free_heap_bytes() -> int:
    """Bytes free inside glibc's malloc arenas (mallinfo2's fordblks): freed, not yet given back; 0 without glibc."""
    libc = _glibc()
    return 0 if libc is None else int(libc.mallinfo2().fordblks)


class WarmHeap:
    """Keeps about `nbytes` of free heap memory mapped in the arena of the threads that run requests' work.

    After each plain response, `reserve` takes `nbytes` in chunks on the thread that ran the work (malloc serves a
    thread from its own arena), without writing them: some microseconds. A thread of its own, at the lowest priority,
    maps their pages (madvise MADV_POPULATE_WRITE, without the GIL) and frees them back into that arena. The next
    run's allocations on that thread then find mapped pages. The worker itself is free at once: work kept on a worker
    after its response sent the next request to another worker, with an OpenMP team of its own, and more OpenMP
    threads than cores make GNU OpenMP's threads sleep at every parallel region (a forward 23 -> 37 ms back to back).
    The thresholds are fixed at glibc's own dynamic ceilings so the freed chunks stay in the heap; MallocTrimmer
    leaves twice `nbytes` of free memory alone."""

    def __init__(self, nbytes: int, libc: ctypes.CDLL) -> None:
        self.nbytes, self._libc = nbytes, libc
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
        libc.mallopt(M_TRIM_THRESHOLD, max(2 * MMAP_THRESHOLD, 2 * nbytes))
        self.top_ups = 0
        self.mapped_pages = 0  # pages the top-ups mapped: first touches that requests would have paid
        self._populate = True  # until the kernel refuses MADV_POPULATE_WRITE (before Linux 5.14)
        self._pending: queue.SimpleQueue[list[int]] = queue.SimpleQueue()
        self._busy = threading.Event()  # a reservation is being mapped or waits: the next response adds none
        threading.Thread(target=self._map_reservations, name="attnlab-warm-heap", daemon=True).start()

    @classmethod
    def start(cls, nbytes: int) -> "WarmHeap | None":
        libc = _glibc()
        return None if nbytes <= 0 or libc is None else cls(nbytes, libc)

    def reserve(self) -> None:
        """On the thread whose arena is to be kept warm: its chunks, handed to the mapping thread."""
        if self._busy.is_set():
            return
        chunks = []
        for _ in range(-(-self.nbytes // WARM_CHUNK)):
            address = self._libc.malloc(WARM_CHUNK)
            if not address:
                break
            chunks.append(address)
        self._busy.set()
        self._pending.put(chunks)

    def _map_reservations(self) -> None:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # this thread only: idle cores' time
        while True:  # never ends: a reservation nobody frees would be 32 MiB lost for every response
            chunks = self._pending.get()
            faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
            try:
                for address in chunks:
                    self._map(address, WARM_CHUNK)
            except Exception:  # noqa: BLE001  the chunks are freed all the same; the next reservation tries again
                log.exception("warm heap: mapping a reservation failed")
            finally:
                for address in chunks:
                    self._libc.free(address)  # back to the arena it came from, whichever thread frees it
                self.top_ups += 1
                self.mapped_pages += resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - faults
                self._busy.clear()

    def _map(self, address: int, nbytes: int) -> None:
        """Every page of [address, address + nbytes) mapped, a MiB at a time (the process's memory map is held
        shorter); by a write to each page where the kernel lacks MADV_POPULATE_WRITE."""
        page = os.sysconf("SC_PAGE_SIZE")
        start, end = -(-address // page) * page, (address + nbytes) // page * page
        if self._populate:
            for offset in range(start, end, 2**20):
                if self._libc.madvise(offset, min(2**20, end - offset), MADV_POPULATE_WRITE) != 0:
                    self._populate = False
                    break
            else:
                return
        import numpy as np  # not at import: app.cli imports this module before the server re-executes itself

        np.frombuffer((ctypes.c_char * nbytes).from_address(address), np.uint8)[::page] = 0


_PROCESS_WARM_HEAP: list[WarmHeap] = []  # set once by the served process (app/serve.py main)


def start_warm_heap(nbytes: int) -> WarmHeap | None:
    heap = WarmHeap.start(nbytes)
    _PROCESS_WARM_HEAP[:] = [heap] if heap is not None else []
    return heap


def process_warm_heap() -> WarmHeap | None:
    """The served process's warm heap, None in any other (the tests' in-process apps) or when it is off."""
    return _PROCESS_WARM_HEAP[0] if _PROCESS_WARM_HEAP else None


class MallocTrimmer(threading.Thread):
    """Every `interval_s`, glibc's malloc_trim(0): the free pages inside every malloc arena go back to the kernel.
    free() gives memory back by itself only from the top of a heap; a freed run's buffers below live objects stayed
    resident. In-process, 8 threads of text attention for 60 s (benchmarks/allocator_trim.py, MALLOC_ARENA_MAX=2):
    RSS after the load 3.4 GB, after the result cache was emptied 2.8 GB, after one malloc_trim(0) 1.1 GB (glibc's
    default arenas: 4.0, 3.0, 1.2 GB). Skipped under a preloaded allocator of its own (it purges by itself). With a
    warm heap (app/allocator.py WarmHeap) a trim waits until more than `keep_free_bytes` is free: trimming the warm
    memory alone would hand the next view its page faults back."""

    def __init__(self, interval_s: float, keep_free_bytes: int = 0) -> None:
        super().__init__(name="attnlab-malloc-trim", daemon=True)
        self.interval_s, self.keep_free_bytes = interval_s, keep_free_bytes
        self.calls = 0
        self.skipped = 0
        self.returned_bytes = 0
        self.max_seconds = 0.0
        self._trim = _libc().malloc_trim

    def run(self) -> None:
        page = os.sysconf("SC_PAGE_SIZE")
        while True:
            time.sleep(self.interval_s)
            if self.keep_free_bytes and free_heap_bytes() <= self.keep_free_bytes:
                self.skipped += 1
                continue
            before = _resident_pages()
            started = time.perf_counter()
            self._trim(0)
            took = time.perf_counter() - started
            returned = max(0, before - _resident_pages()) * page
            self.calls += 1
            self.returned_bytes += returned
            self.max_seconds = max(self.max_seconds, took)
            if returned >= 64 * 2**20:
                log.info("malloc_trim: %s MB of freed memory returned to the kernel in %.0f ms",
                         f"{returned / 2**20:,.0f}", took * 1000)


def _resident_pages() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1])


def start_malloc_trim(interval_s: float, keep_free_bytes: int = 0) -> MallocTrimmer | None:
    if interval_s <= 0 or _glibc() is None:
        return None
    trimmer = MallocTrimmer(interval_s, keep_free_bytes)
    trimmer.start()
    return trimmer
