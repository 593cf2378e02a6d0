"""The memory accountant: the whole process within `memory_budget_bytes` (docs/configuration.md "Memory").

    memory_reserved_bytes (models, torch)  +  kept runs (the result cache)  +  Σ in-flight peaks  ≤  memory_budget_bytes

Before its model runs, a request reserves its estimated in-flight peak (app/costs.py `request_peak_bytes`: the runs
it will keep, and the transient working memory of one forward). The reservation is granted only when it fits beside
what is kept and what other requests hold; to make room the result cache gives up runs nobody is using (unpinned,
least recently used first), then the requesting client's own older runs. When it still does not fit, the request
waits in the queue (a job keeps its place and its ETA), and is refused with 413 only when it could never fit.

A run is pinned for `result_pin_s` after it was answered or last read (a window, a row), so a client's next step
finds it (a compare keeps both runs); a pin's bytes count against the budget like any kept run. Pinned runs the
disk tier had no room for stay in RAM until their pins end: new work that does not fit beside them is refused at once
(503 + Retry-After naming why, `check_pinned_room`), not accepted and then left to wait or overrun. So do the events
jobs keep for a re-attach (`keepers`: app/streams.py, capped by job_event_buffer_bytes and job_events_max_bytes).
"""
from __future__ import annotations

import ctypes
import itertools
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import HTTPException

from app.context import RequestContext
from app.errors import Overloaded
from app.lifecycle import RequestCancelled

POLL_S = 0.1
# A request whose peak is at most this is booked without waiting for room (a short first view, a window): waiting
# behind a long compare's memory made a 20-token view take 27 s; memory_budget_bytes + 0.5 GiB is the stated bound.
SMALL_BYTES = 64 * 2**20
MIN_KEPT_BYTES = 64 * 2**20  # the result cache keeps at least this much in RAM, whatever the models take
TRIM_EVERY_S = 2.0


@dataclass
class RequestMemory:
    """What one request has reserved (the largest of its reservations; released when the request ends)."""

    nbytes: int = 0
    client: str = ""
    budget: "MemoryBudget | None" = None  # the budget it holds bytes of (released through it)
    ends_by: float = float("inf")  # monotonic: when it expects to release (its work's estimated end, with slack)



def process_rss() -> int:
    """This process's resident memory (VmRSS), 0 where /proc is not there."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _malloc_trim() -> None:
    """Give glibc's free pages back to the kernel (no-op elsewhere): before waiting for room that RSS does not show."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def stuck_pins(cache) -> list[tuple[float, int]]:
    """The run store's pinned runs kept in RAM for lack of room on disk, (seconds until each pin ends, bytes)
    (app/runstore_ram.py RamTier.stuck_pins); none for a store without a disk tier."""
    stuck = getattr(cache, "stuck_pins", None)
    return stuck() if stuck is not None else []


def pinned_overrun(cache, nbytes: int, room: int) -> tuple[int, int, float] | None:
    """(runs, bytes, seconds until enough of their pins end) when `nbytes` does not fit in `room` beside the pinned
    runs the disk tier could not take, after the store tried to move them again (the disk tier may have room by
    now; unpinned runs leave too); None when it fits, or when no such run is kept (the rest of the budget frees up
    as work ends: MemoryBudget.reserve waits for it)."""
    pins = stuck_pins(cache)
    if not pins or sum(b for _, b in pins) + nbytes <= room:
        return None
    cache.evict_for(sum(b for _, b in pins) + nbytes - room, "")
    pins = stuck_pins(cache)
    held = sum(b for _, b in pins)
    over = held + nbytes - room
    if not pins or over <= 0:
        return None
    freed, wait_s = 0, 0.0
    for seconds, b in sorted(pins):
        freed, wait_s = freed + b, seconds
        if freed >= over:
            break
    return len(pins), held, wait_s


class MemoryBudget:
    def __init__(self, budget_bytes: int, reserved_bytes: int, cache, measure_rss: bool = True,
                 wait_s: float = 120.0) -> None:
        self.budget, self.reserved = budget_bytes, reserved_bytes
        self.limit = max(0, budget_bytes - reserved_bytes)  # for kept runs and in-flight work
        self.models: dict[str, int] = {}  # models loaded on first use → their weights' bytes (in `reserved`)
        self._capped: set[str] = set()  # models whose weights the result cache's cap was lowered by
        self._loads: dict[str, RequestMemory] = {}  # models loading now → what reserve_model booked for the load
        self.cache = cache  # app.runtime.ResultCache: kept bytes, pins, eviction
        # The books (kept + reserved peaks) miss what the allocator holds after a run is freed and any estimate that
        # fell short: where the process's RSS says more is in use than the books, that is what counts.
        self.measure_rss = measure_rss
        self._in_flight: list[RequestMemory] = []
        self._cond = threading.Condition()
        self.waited = 0  # requests that had to wait for room (for /api/jobs and the benchmarks)
        self.wait_s = wait_s  # the longest wait for room (memory_wait_s)
        self._tickets = itertools.count(1)
        self._queue: list[int] = []  # the waiting reservations' tickets, in arrival order
        # memory kept outside runs and requests, counted like them: name → its bytes now (a job's kept events for a
        # re-attach: app/streams.py JobLogs.held_bytes, set by the first job)
        self.keepers: dict[str, Callable[[], int]] = {}

    def count_kept(self, name: str, nbytes: Callable[[], int]) -> None:
        """Count what `nbytes()` says against the budget from now on, beside the kept runs (idempotent by name)."""
        self.keepers.setdefault(name, nbytes)

    def _kept_elsewhere(self) -> int:
        return sum(nbytes() for nbytes in list(self.keepers.values()))

    def _unbooked(self, others: int) -> int:
        """Bytes in use that the books do not show: RSS over reserved + kept + the in-flight peaks (those reserve their
        peak before reaching it, so RSS below the books counts nothing)."""
        if not self.measure_rss:
            return 0
        return max(0, process_rss() - (self.reserved + self.cache.host_bytes + others))

    def add_model(self, model_id: str, nbytes: int) -> None:
        """A model loaded beyond the default ones (memory_reserved_bytes counts those): its weights are set aside
        too, so a first-use model (gemma3-270m: 1.1 GB in float32) shrinks the room for runs rather than overrunning
        the budget. Replaces what `reserve_model` booked for it before its load (its measured weights now); the
        kept runs are brought within the smaller room at once (short views, which book without waiting, would not
        make room), and the result cache's own cap shrinks by as much."""
        with self._cond:
            self._end_load(model_id)
            self.reserved += nbytes - self.models.get(model_id, 0)
            self.limit = max(0, self.budget - self.reserved)
            self.models[model_id] = nbytes
            others = sum(r.nbytes for r in self._in_flight) + self._kept_elsewhere()
            over = self.reserved + self.cache.host_bytes + others - self.budget
        if getattr(self.cache, "max_bytes", None) is not None and model_id not in self._capped:
            self._capped.add(model_id)
            self.cache.max_bytes = max(MIN_KEPT_BYTES, self.cache.max_bytes - nbytes)
        if over > 0:
            self.cache.evict_for(over, "")

    def reserve_model(self, model_id: str, nbytes: int, deadline: float | None) -> None:
        """Before a model loads on first use: book `nbytes` (its weight files' size) beside the models loaded, making
        room by moving kept runs out of RAM and waiting for in-flight work (until `deadline`: 503 + Retry-After), so
        the load never overruns the budget. A model that could never fit (more than memory_budget_bytes leaves beside
        the models loaded, with nothing kept or running) is refused with a 503 naming memory_budget_bytes."""
        with self._cond:
            room = self.budget - self.reserved
            if nbytes > room:
                raise HTTPException(503, detail=(
                    f"model {model_id!r} needs about {nbytes / 2**20:,.0f} MiB for its weights, more than the "
                    f"{max(0, room) / 2**20:,.0f} MiB that memory_budget_bytes ({self.budget / 2**20:,.0f} MiB) leaves "
                    f"beside the models loaded (memory_reserved_bytes and {len(self.models)} loaded on first use); "
                    "raise memory_budget_bytes to serve it"))
            while True:
                others = sum(r.nbytes for r in self._in_flight) + self._kept_elsewhere()
                need = self.reserved + nbytes + others + self.cache.host_bytes + self._unbooked(others) - self.budget
                if need > 0:
                    self.cache.evict_for(need, "")
                    _malloc_trim()
                    need = self.reserved + nbytes + others + self.cache.host_bytes + self._unbooked(others) - self.budget
                if need <= 0:
                    break
                if deadline is not None and time.monotonic() > deadline:
                    raise Overloaded(f"server busy: loading model {model_id!r} needs about {nbytes / 2**20:,.0f} MiB "
                                     "and the memory budget stayed full of work in flight", retry_after=10)
                self._cond.wait(POLL_S)
            # booked as work in flight, not as a model: requests wait behind it (short ones go on, within the stated
            # margin), and none is told it could never fit while a load is under way
            self._loads[model_id] = RequestMemory(nbytes=nbytes, client=f"load:{model_id}", budget=self)
            self._in_flight.append(self._loads[model_id])

    def unreserve_model(self, model_id: str) -> None:
        """A load that failed gives back what reserve_model booked for it."""
        with self._cond:
            self._end_load(model_id)

    def _end_load(self, model_id: str) -> None:  # under self._cond
        holder = self._loads.pop(model_id, None)
        if holder is not None and holder in self._in_flight:
            self._in_flight.remove(holder)
        self._cond.notify_all()

    @property
    def in_flight_bytes(self) -> int:
        with self._cond:
            return sum(r.nbytes for r in self._in_flight)

    def used_bytes(self) -> int:
        return self.in_flight_bytes + self.cache.host_bytes + self._kept_elsewhere()

    def reserve(self, ctx: RequestContext, nbytes: int, field: str, what: str, expected_s: float | None = None) -> None:
        """Raise the request `ctx`'s reservation (`ctx.memory`, before its `ctx.deadline`) to `nbytes`, waiting for room in turn (first come, first served:
        only the longest waiting reservation is granted, so later work cannot overtake it); 413 naming `field` when
        it could never fit; 503 with the reason at once when not enough could free up before its deadline (nor within
        wait_s), else when the wait passes either. `expected_s`: how long the request will hold it (its queue wait and
        model time), which later waiters count on. Outside a request (no RequestMemory in the context: scripts, tests
        of the engine) nothing is held."""
        holder, deadline = ctx.memory, ctx.deadline
        if holder is None or nbytes <= holder.nbytes:
            return
        self.check_fits(nbytes, field, what)
        now = time.monotonic()
        # unknown: counted as soon (a refusal at once must be sure; the wait's limit covers the rest)
        holder.ends_by = now + 2 * expected_s + 5 if expected_s is not None else now
        if nbytes <= SMALL_BYTES:  # short interactive work does not wait for room: the stated margin covers it
            with self._cond:
                self._book(holder, nbytes)
            return
        give_up = min(deadline if deadline is not None else now + self.wait_s, now + self.wait_s)
        cancel = ctx.cancel
        ticket = next(self._tickets)
        waited = trimmed = False
        with self._cond:
            self._queue.append(ticket)
            try:
                while True:
                    if self._queue[0] == ticket:  # its turn: the reservations before it were granted or gave up
                        need = self._need(holder, nbytes)
                        if need > 0:
                            self.cache.evict_for(need, holder.client)
                            if not trimmed:  # freed runs and earlier work's garbage back to the kernel, once per wait
                                _malloc_trim()
                                trimmed = True
                            need = self._need(holder, nbytes)
                        if need <= 0:
                            self._book(holder, nbytes)
                            self.waited += int(waited)
                            return
                        if not waited:  # told at once when it cannot fit in time, not at its deadline
                            self._refuse_if_never(holder, need, give_up, what, nbytes)
                    waited = True
                    if cancel is not None and cancel.is_set():
                        raise RequestCancelled(cancel.reason)
                    if time.monotonic() > give_up:
                        raise Overloaded(self._busy(what, nbytes, "until this request's time limit (its deadline, "
                                                    f"or memory_wait_s={self.wait_s:g} s)"), retry_after=10)
                    self._cond.wait(POLL_S)  # woken by a release; pins expire on their own, so poll too
                    if int(time.monotonic() / TRIM_EVERY_S) != int((time.monotonic() - POLL_S) / TRIM_EVERY_S):
                        trimmed = False  # while waiting, trim again now and then: other work frees memory too
            finally:
                self._queue.remove(ticket)
                self._cond.notify_all()

    def _need(self, holder: RequestMemory, nbytes: int) -> int:
        """Bytes over the limit if `holder` held `nbytes` (under the lock)."""
        others = sum(r.nbytes for r in self._in_flight if r is not holder) + self._kept_elsewhere()
        return others + nbytes + self.cache.host_bytes + self._unbooked(others) - self.limit

    def _book(self, holder: RequestMemory, nbytes: int) -> None:
        holder.nbytes, holder.budget = nbytes, self
        if holder not in self._in_flight:
            self._in_flight.append(holder)

    def _busy(self, what: str, nbytes: int, until: str) -> str:
        others = [r for r in self._in_flight if r.nbytes]
        return (f"server busy: {what} needs about {nbytes / 2**20:,.0f} MiB and the memory budget stayed full "
                f"({sum(r.nbytes for r in others) / 2**20:,.0f} MiB held by {len(others)} requests in flight, "
                f"{self.cache.host_bytes / 2**20:,.0f} MiB by runs clients keep for result_pin_s, "
                f"{self._kept_elsewhere() / 2**20:,.0f} MiB by jobs' kept events) {until}")

    def _refuse_if_never(self, holder: RequestMemory, need: int, give_up: float, what: str, nbytes: int) -> None:
        """503 at once when what could free up before `give_up` is less than `need`: the requests in flight by when
        they expect to end (`ends_by`), kept runs by when their pins end (result_pin_s at the latest)."""
        freeing = sum(r.nbytes for r in self._in_flight if r is not holder and r.ends_by <= give_up)
        pin_s = getattr(self.cache, "pin_s", 0.0)
        if time.monotonic() + pin_s <= give_up:
            freeing += self.cache.host_bytes
        if freeing < need:
            raise Overloaded(self._busy(what, nbytes, "and not enough of it frees up before this request's time "
                                        f"limit (its deadline, or memory_wait_s={self.wait_s:g} s)"),
                             retry_after=max(1, round(min(pin_s, self.wait_s)) or 10))

    def check_fits(self, nbytes: int, field: str, what: str) -> None:
        """413 naming `field` when `nbytes` could never fit beside the models, even with nothing else kept; 503 with
        Retry-After when it cannot fit beside the pinned runs the disk tier had no room for (`check_pinned_room`)."""
        if nbytes > self.limit:
            raise HTTPException(413, detail=(
                f"{field}: {what} needs about {nbytes / 2**20:,.0f} MiB of memory while it runs, over the "
                f"{self.limit / 2**20:,.0f} MiB that memory_budget_bytes leaves beside the models "
                f"(memory_reserved_bytes); ask for a shorter input, fewer samples or no compare"))
        self.check_pinned_room(nbytes, what)

    def pinned_stuck_bytes(self) -> int:
        """RAM kept by pinned runs that could not spill (the disk tier full of pinned runs): nothing frees it before
        their pins end, so it is counted against new work up front (`check_pinned_room`)."""
        return sum(nbytes for _, nbytes in stuck_pins(self.cache))

    def check_pinned_room(self, nbytes: int, what: str) -> None:
        """503 + Retry-After at once, before the work is accepted, when `nbytes` does not fit in the budget beside
        the RAM of pinned runs the disk tier had no room for and what jobs keep for a re-attach: neither the work in
        flight ending nor any eviction frees it, only their pins' end (issue 53 item 7: with the disk tier full,
        2,941 MiB were kept against a 2,048 MiB budget and work was still admitted). Retry-After: when enough of
        their pins have ended."""
        found = pinned_overrun(self.cache, nbytes, self.limit - self._kept_elsewhere())
        if found is not None:
            count, held, wait_s = found
            raise Overloaded(
                f"server busy: {what} needs about {nbytes / 2**20:,.1f} MiB, and {count} pinned runs hold "
                f"{held / 2**20:,.1f} MiB of RAM that the run store's disk tier could not take (run_store_disk_bytes "
                f"is full of pinned runs); beside them it does not fit the {self.limit / 2**20:,.1f} MiB that "
                f"memory_budget_bytes leaves beside the models; retry when their pins end (result_pin_s)",
                retry_after=max(1, math.ceil(wait_s)))

    def release(self, holder: RequestMemory) -> None:
        with self._cond:
            holder.nbytes = 0
            if holder in self._in_flight:
                self._in_flight.remove(holder)
            self._cond.notify_all()
