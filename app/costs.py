"""Costs known before the work starts: a request's model time (refused with 413 when it could not finish within
its time limit) and the memory budget's split into cache sizes. Pure arithmetic and measurement, no web imports:
the checks that refuse a request or accept a job with these numbers are app/admission.py.

**Model time.** One forward over T query tokens and T_k keys on a model with P parameters, L layers and H heads
of size d costs about

    P·T  +  2·L·H·T·T_k·d  +  4·n·L·H·T_k·(T + d)        multiply-adds

(every weight once per token; QKᵀ and PV per head; n interventions each touching every score and every key
vector once — a perturbation draws d noise values per key, at every decoding step too — counted four times:
elementwise work and random numbers are memory-bound). A long text first view with `weighting: "value_norm"` also
builds its value-weighted overview (models/attribution.value_weighted_overview): every score of every head rebuilt
from q̂/k̂ and passed through softmax, weighting, renormalising and pooling, counted as VALUE_OVERVIEW_WEIGHT·L·H·T·T_k·d
(`value_overview_macs`). A request runs `runs` such forwards (1, or 1 + samples with
`compare`: the base and every sample). Its seconds are that total over the model's throughput: measured from
the model's own runs (the app's `CostMeasures.throughput`, runs of at least MIN_TIMED_S only: tiny runs are all overhead), else the
`compute_gmacs_per_s` setting; under load, times the slowdown the model's recent runs met: their real seconds over
what the fit says now for them, summed (so the larger runs, the work a long estimate is about, weigh the most).
Batched work timed in steps (a patching scan: `WorkClock`) is learnt from as one run. (A request estimated over its
time limit is answered 413 before it starts: app/admission.py.)

**Memory.** `cache_budgets(settings)` splits `memory_budget_bytes`: the models and torch
(`memory_reserved_bytes`), one run's recorded maps in flight (`max_run_bytes`: runs take turns),
`max_concurrent_decodes` decodes of `max_image_pixels` at DECODE_BYTES_PER_PIXEL each, and what is left to the
result cache (3/4) and the decoded-image cache (1/4).
"""
from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass


# The value-weighted overview per score, in units of the head size d. Measured: at 2,048 tokens on smollm2-135m it
# took 0.83× the long first run itself (benchmarks/results/value_norms_cpu.json), 0.83·forward_macs / (L·H·T²·d) ≈ 4.8:
# the product q̂·k̂ once, then several float32 passes over every score that run far below the matmul rate.
VALUE_OVERVIEW_WEIGHT = 5.0
MIN_TIMED_S = 0.2  # runs shorter than this do not update a model's measured throughput
INTERVENTION_WEIGHT = 4  # elementwise work per score per intervention, in multiply-add equivalents
# A decode's peak: the decoded bitmap (≤ 4 B/px: RGBA, CMYK, 32-bit gray) + its RGB copy (3 B/px) + a stripe.
DECODE_BYTES_PER_PIXEL = 8
MIN_CACHE_BYTES = 64 * 2**20


@dataclass(frozen=True)
class ModelShape:
    params: int
    layers: int
    heads: int
    head_dim: int
    hidden: int = 0  # the residual stream's width D (hidden states: (L+1)·T·D)
    kv_heads: int = 0  # key/value heads per layer (grouped-query attention keeps fewer k̂)


def forward_macs(shape: ModelShape, queries: int, keys: int, interventions: int = 0) -> float:
    """Multiply-adds of one forward over `queries` new tokens attending to `keys` tokens (see the module doc)."""
    scores = shape.layers * shape.heads * queries * keys
    per_key = shape.layers * shape.heads * keys * (queries + shape.head_dim)  # scores + key vectors touched
    return shape.params * queries + 2 * scores * shape.head_dim + INTERVENTION_WEIGHT * interventions * per_key


def request_runs(samples: int, compare: bool) -> int:
    """Forwards of an attention request: the run, and with `compare` the base and each further sample."""
    return 1 + samples if compare else 1


def value_overview_macs(shape: ModelShape, queries: int, keys: int, layers: int | None = None) -> float:
    """The value-weighted overview of a long run over `layers` (default all of the shape's; see the module doc)."""
    layers = shape.layers if layers is None else layers
    return VALUE_OVERVIEW_WEIGHT * layers * shape.heads * queries * keys * shape.head_dim


def stream_macs(shape: ModelShape, prompt: int, new_tokens: int, interventions: int) -> float:
    """A generate stream: two sides (with and without the interventions), the prompt first, then one token a
    step attending to everything before it (the key/value cache keeps the rest)."""
    with_iv = forward_macs(shape, prompt, prompt, interventions)
    base = forward_macs(shape, prompt, prompt, 0)
    for step in range(1, new_tokens):
        keys = prompt + step
        with_iv += forward_macs(shape, 1, keys, interventions)
        base += forward_macs(shape, 1, keys, 0)
    return with_iv + base


class CpuShare:
    """The share of this machine's CPUs the process can have now: cores / (cores + cores kept busy by other
    processes), from /proc/stat and /proc/self/stat, smoothed over the last seconds. 1.0 without /proc or on a GPU
    (device work does not wait for the host's other processes in the same way)."""

    MIN_INTERVAL_S = 0.5

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: tuple[float, int, int] | None = None  # (monotonic, busy ticks of the machine, ticks of this process)
        self._others = 0.0  # busy cores of other processes, smoothed
        self._hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        try:
            self.cores = max(1, len(os.sched_getaffinity(0)))
        except (AttributeError, OSError):
            self.cores = max(1, os.cpu_count() or 1)
        self._smoothed = False  # the first interval's measure is taken as it is
        ticks = self._ticks()  # measured from the import on: the start-up timing's first `now()` has an interval
        if ticks is not None:
            self._last = (time.monotonic(), *ticks)

    @staticmethod
    def _ticks() -> tuple[int, int] | None:
        try:
            with open("/proc/stat") as f:
                fields = [int(v) for v in f.readline().split()[1:]]
            with open("/proc/self/stat") as f:
                own = f.read().rsplit(")", 1)[1].split()
        except (OSError, ValueError, IndexError):
            return None
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return sum(fields[:8]) - idle, int(own[11]) + int(own[12])  # utime + stime of this process

    def now(self) -> float:
        with self._lock:
            if self._last is not None and time.monotonic() - self._last[0] < self.MIN_INTERVAL_S:
                return self.cores / (self.cores + self._others)  # within the interval: nothing to read
            ticks = self._ticks()
            if ticks is None:
                return 1.0
            t = time.monotonic()
            if self._last is None:
                self._last = (t, *ticks)
            elif t - self._last[0] >= self.MIN_INTERVAL_S:
                dt = t - self._last[0]
                others = ((ticks[0] - self._last[1]) - (ticks[1] - self._last[2])) / (self._hz * dt)
                others = max(0.0, min(others, 4.0 * self.cores))
                self._others = 0.5 * self._others + 0.5 * others if self._smoothed else others
                self._smoothed, self._last = True, (t, *ticks)
            return self.cores / (self.cores + self._others)

    def threads_for(self, threads: int) -> int:
        """Torch threads worth running now: at most `threads`, one per core that other processes leave free (at least
        one). A thread more than the free cores waits for one at every parallel region: on 2 cores beside busy
        processes (load 13) a 151-token forward took 8 s on one thread and 69-87 s on two. The busy cores are the
        fewer of the smoothed measure (`now()`) and the other processes' threads runnable at this instant
        (`runnable_others`): a process busy a moment ago that sleeps now (a client or a browser waiting for this very
        response) leaves its core free, while processes that keep the cores busy are runnable at any instant."""
        self.now()
        runnable = self.runnable_others()
        with self._lock:
            others = self._others
        return threads_worth_running(threads, self.cores, others, runnable)

    @staticmethod
    def runnable_others() -> int | None:
        """Threads of other processes running or waiting for a core right now: /proc/stat's procs_running (every
        runnable thread of the machine, the caller's own included) less this process's runnable threads, which are
        counted (/proc/self/task) only when the machine has more than the caller runnable. None without /proc."""
        try:
            with open("/proc/stat", "rb") as f:
                stat = f.read()
            at = stat.index(b"procs_running ") + len(b"procs_running ")
            running = int(stat[at:stat.index(b"\n", at)])
        except (OSError, ValueError):
            return None
        return 0 if running <= 1 else max(0, running - _own_runnable_threads())

    def mark(self) -> tuple[float, int, int] | None:
        """A point to measure the share from (`share_since`): a timed run's own interval."""
        ticks = self._ticks()
        return None if ticks is None else (time.monotonic(), *ticks)

    def share_since(self, mark: tuple[float, int, int] | None) -> float:
        """The share this process had since `mark`, measured over that whole interval (the start-up timing under
        load: the smoothed `now()` said 1.0 at its first call, and the probe's slow runs were then taken as an idle
        machine's, which made a 7-token request "about 107 s" on a busy machine)."""
        ticks = self._ticks() if mark is not None else None
        if ticks is None:
            return 1.0
        dt = time.monotonic() - mark[0]
        if dt < 0.05:
            return self.now()
        others = ((ticks[0] - mark[1]) - (ticks[1] - mark[2])) / (self._hz * dt)
        return self.cores / (self.cores + max(0.0, min(others, 4.0 * self.cores)))


def _own_runnable_threads() -> int:
    """This process's threads in state R (running or waiting for a core); at least the caller."""
    runnable = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 1
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # the thread has ended
        runnable += stat[stat.rindex(b")") + 2:][:1] == b"R"
    return max(1, runnable)


def threads_worth_running(threads: int, cores: int, busy_smoothed: float, runnable_others: int | None) -> int:
    """At most `threads`, one per core that other processes leave free, at least one: their busy cores are the fewer
    of `busy_smoothed` (measured over the last seconds) and `runnable_others` (their threads runnable now; None:
    unknown). Never more busy cores than the smoothed measure, so never fewer threads than it alone would give."""
    busy = busy_smoothed if runnable_others is None else min(busy_smoothed, float(runnable_others))
    return max(1, min(threads, int(cores - busy + 0.5)))


# Process-wide, unlike an app's CostMeasures (app/process.py): the machine's share for this process, whoever asks
CPU_SHARE = CpuShare()
RECENCY = 0.8  # each newer timed run weighs 1/0.8 = 1.25 times the one before it
LOAD_RECENT_S = 60.0  # a slowdown measured on runs this recent is the estimate's load correction (else /proc)
LOAD_RUNS = 64  # the most recent runs a slowdown is measured on
LOAD_HALF_LIFE_S = 20.0  # a run's weight in the slowdown halves every this many seconds


class Throughput:
    """Seconds of one model run ≈ overhead + multiply-adds / rate, per model: a least-squares fit over its timed runs
    (the start-up timing first), the older ones down-weighted (RECENCY), each normalised to an idle machine by the CPU
    share the process had while it ran (an estimate is divided by the share now). Runs of similar size give no
    slope: then the line through the origin, which the largest runs dominate (a short run is mostly per-call overhead
    and must not make a long one look slow: the previous average of per-run rates estimated the 2,933-token sample at
    148-198 s on a server that had served short views; it ran in 7.5 s)."""

    def __init__(self) -> None:
        self._rates: dict[str, float] = {}  # multiply-adds per second on an idle machine
        self._overheads: dict[str, float] = {}  # seconds per run besides the multiply-adds
        self._sums: dict[str, list[float]] = {}  # recency-weighted Σw, Σm, Σs, Σm², Σm·s
        # per model: its last LOAD_RUNS timed runs (when, multiply-adds, real seconds): the load they met is their
        # real time over the fit's idle time for them, the fit as it is when an estimate asks (a slowdown smoothed
        # against each run's fit of the moment mixed fits made under other loads: a 9-token scan at 2.8x its time)
        self._recent: dict[str, deque[tuple[float, float, float]]] = {}
        self._lock = threading.Lock()

    def observe(self, model_id: str, macs: float, seconds: float, share: float = 1.0) -> None:
        if seconds < MIN_TIMED_S or macs <= 0:
            return
        idle_s = seconds * share
        with self._lock:
            self._recent.setdefault(model_id, deque(maxlen=LOAD_RUNS)).append((time.monotonic(), macs, seconds))
            sums = [v * RECENCY for v in self._sums.get(model_id, [0.0] * 5)]
            for i, v in enumerate((1.0, macs, idle_s, macs * macs, macs * idle_s)):
                sums[i] += v
            self._sums[model_id] = sums
            w, m, t, mm, mt = sums
            spread = w * mm - m * m
            slope = (w * mt - m * t) / spread if spread > 1e-3 * m * m else 0.0
            overhead = (t - slope * m) / w if slope > 0 else 0.0
            if slope <= 0 or overhead < 0:  # through the origin
                slope, overhead = mt / mm, 0.0
            self._rates[model_id], self._overheads[model_id] = 1.0 / slope, overhead

    def seconds(self, model_id: str, macs: float, default_rate: float) -> tuple[float, bool]:
        """Idle-machine seconds of `macs` multiply-adds on that model, and whether they come from its timed runs (a
        given rate, compute_gmacs_per_s or set_rate, is taken as it is, with no load correction)."""
        with self._lock:
            seconds = self._overheads.get(model_id, 0.0) + macs / self._rates.get(model_id, default_rate)
            return seconds, model_id in self._sums

    def slowdown(self, model_id: str, macs: float | None = None) -> float | None:
        """Real seconds over the idle fit's, from this model's runs of the last LOAD_RECENT_S (sums weighted by
        recency, LOAD_HALF_LIFE_S); for work of `macs` multiply-adds, runs of a similar size weigh the most (a run k
        times larger or smaller 1/k: a short view on one thread and a long run on all cores meet the same load
        differently, and the fit's overhead, measured under load, errs most for the shortest runs); None: none
        recent."""
        now = time.monotonic()
        with self._lock:
            runs = [run for run in self._recent.get(model_id, ()) if now - run[0] <= LOAD_RECENT_S]
            if not runs or model_id not in self._rates:
                return None
            rate, overhead = self._rates[model_id], self._overheads.get(model_id, 0.0)
        real = fit = 0.0
        for when, run_macs, seconds in runs:
            weight = 0.5 ** ((now - when) / LOAD_HALF_LIFE_S) * (min(run_macs / macs, macs / run_macs) if macs else 1.0)
            real, fit = real + weight * seconds, fit + weight * (overhead + run_macs / rate)
        return min(max(real / fit, 0.2), 20.0) if fit > 0 else None

    def rate(self, model_id: str, default: float) -> float:
        with self._lock:
            return self._rates.get(model_id, default)

    def set_rate(self, model_id: str, macs_per_s: float) -> None:
        """A known rate (tests, a benchmark's measurement), no overhead; later timed runs refit from here on."""
        with self._lock:
            self._rates[model_id], self._overheads[model_id] = macs_per_s, 0.0
            self._sums.pop(model_id, None)
            self._recent.pop(model_id, None)

    def clear(self) -> None:
        with self._lock:
            self._rates.clear()
            self._overheads.clear()
            self._sums.clear()
            self._recent.clear()


_shapes: dict[int, ModelShape] = {}


class StepTimes:
    """Real seconds of one decoding step (one new token over the key/value cache, with its attention rows) per model,
    as measured: the start-up timing's few steps, then every generate's (smoothed, the latest weighing STEP_RECENCY).
    A step is mostly per-call overhead that no multiply-add count sees: smollm2-135m's 8-token generate was estimated
    at 0.6-0.8 s from its multiply-adds and took 4-6 s."""

    def __init__(self) -> None:
        self._seconds: dict[str, float] = {}
        self._lock = threading.Lock()

    def observe(self, model_id: str, seconds: float) -> None:
        with self._lock:
            old = self._seconds.get(model_id)
            self._seconds[model_id] = seconds if old is None else old + STEP_RECENCY * (seconds - old)

    def seconds(self, model_id: str) -> float | None:
        with self._lock:
            return self._seconds.get(model_id)

    def clear(self) -> None:
        with self._lock:
            self._seconds.clear()


STEP_RECENCY = 0.3


class CostMeasures:
    """What one app has measured of its models' speed, per model id: the throughput fit of their forwards and the
    seconds of their decoding steps. Its ProcessState owns it (app/process.py) and its Runtime holds it
    (`runtime.measures`): two apps serving different models under one id learn nothing of each other's."""

    def __init__(self) -> None:
        self.throughput = Throughput()
        self.steps = StepTimes()

    def clear(self) -> None:
        self.throughput.clear()
        self.steps.clear()


def observe_step(measures: CostMeasures, adapter, seconds: float) -> None:
    """Record one decoding step's real seconds (a generate's steps after the prompt; the start-up timing's)."""
    measures.steps.observe(adapter.info.id, seconds)


def stream_seconds(measures: CostMeasures, adapter, settings, prompt: int, new_tokens: int,
                   interventions: int) -> float:
    """A generate stream's seconds: both sides' prompt forwards from the throughput fit (estimated_seconds), then two
    steps per further token at the model's measured seconds per decoding step (`measures.steps`); before any step was measured,
    all of it from stream_macs, as it is where the operator gave a rate (compute_gmacs_per_s is taken as it is)."""
    shape = model_shape(adapter)
    step_s = measures.steps.seconds(adapter.info.id)
    if step_s is None or "compute_gmacs_per_s" in settings.model_fields_set:
        return estimated_seconds(measures, adapter, settings, stream_macs(shape, prompt, new_tokens, interventions))
    prompts = forward_macs(shape, prompt, prompt, interventions) + forward_macs(shape, prompt, prompt, 0)
    return estimated_seconds(measures, adapter, settings, prompts) + 2 * max(0, new_tokens - 1) * step_s


def model_shape(adapter) -> ModelShape:
    """Parameters, layers, heads and sizes of an adapter's model (parameters counted once per adapter)."""
    shape = _shapes.get(id(adapter))
    if shape is None:
        model = getattr(adapter, "model", None)
        params = sum(p.numel() for p in model.parameters()) if model is not None else 0
        info = adapter.info
        layers = info.layers + (info.decoder_layers or 0)
        config = getattr(model, "config", None)
        hidden = getattr(config, "hidden_size", None) or getattr(config, "d_model", None) or info.heads * info.head_dim
        shape = _shapes[id(adapter)] = ModelShape(params, layers, info.heads, info.head_dim, int(hidden),
                                                  info.kv_heads or info.heads)
    return shape


def runs_on_cpu(adapter) -> bool:
    """Whether the adapter's model runs on the CPU (no device given: the CPU), where other processes share its time."""
    device = getattr(adapter, "device", None)
    return device is None or getattr(device, "type", "cpu") == "cpu"


def _share(adapter) -> float:
    return CPU_SHARE.now() if runs_on_cpu(adapter) else 1.0


def estimated_seconds(measures: CostMeasures, adapter, settings, macs: float) -> float:
    """Seconds of `macs` multiply-adds on this adapter's model under the machine's load: the idle fit times the larger
    of the slowdown its recent runs met and the one the CPU share now (/proc) implies. Recent runs alone missed a load
    that came after them (the long sample estimated at 9 s beside two busy processes on 2 cores took 35 s; at load
    ~10, 22 s against 111 s); the share alone misses what it cannot see (oversubscribed threads' waits)."""
    idle, measured = measures.throughput.seconds(adapter.info.id, macs, settings.compute_gmacs_per_s * 1e9)
    if not measured:
        return idle
    slowdown = measures.throughput.slowdown(adapter.info.id, macs)
    by_share = 1.0 / _share(adapter)
    return idle * max(slowdown, by_share) if slowdown is not None else idle * by_share


def cost_field(shape: ModelShape, tokens: int, keys: int, runs: int, interventions: int, input_field: str,
               fits: Callable[[float], bool]) -> str:
    """The request field to change so that a refused request fits: its input when one plain run alone does not fit
    (`fits(macs)`), else the larger of what it adds: its extra runs (compare, samples) or its interventions (each
    touches every score of every run)."""
    one = forward_macs(shape, tokens, keys)
    if not fits(one) or runs == 1 and not interventions:
        return input_field
    extra_runs = (runs - 1) * one
    interventions_part = runs * (forward_macs(shape, tokens, keys, interventions) - one)
    if extra_runs >= interventions_part:
        return "samples" if runs > 2 else "compare"
    return "interventions"


def observe_run(measures: CostMeasures, adapter, tokens: int, keys: int, interventions: int, seconds: float,
                since: tuple[float, int, int] | None = None) -> None:
    """Record a finished forward's time (runtime.run calls this), normalised by the CPU share the process had: over
    the run itself when `since` (CPU_SHARE.mark() taken before it) is given, else the smoothed share now."""
    if seconds < MIN_TIMED_S:
        return  # Throughput.observe keeps only longer runs: their share is not worth the two /proc reads
    on_cpu = runs_on_cpu(adapter)
    share = (CPU_SHARE.share_since(since) if since is not None else CPU_SHARE.now()) if on_cpu else 1.0
    measures.throughput.observe(adapter.info.id, forward_macs(model_shape(adapter), tokens, keys, interventions), seconds, share)


class WorkClock:
    """Model time of work done in steps, each admitted on its own (a patching scan's batches): `step(turn)` times the
    inside of the step's model turn (not the wait for it) with the CPU share over it; `observe` records the whole
    work as one timed run of the multiply-adds its cost check counted. Without it a scan was estimated from first
    views only, whose load and thread count differ: the scan sent plain just before taught its streamed twin nothing."""

    def __init__(self, adapter, measures: CostMeasures) -> None:
        self.adapter, self.measures, self.seconds, self.idle_s = adapter, measures, 0.0, 0.0
        self._on_cpu = runs_on_cpu(adapter)

    @contextlib.contextmanager
    def step(self, turn: contextlib.AbstractContextManager) -> Iterator[None]:
        with turn:
            since, started = CPU_SHARE.mark() if self._on_cpu else None, time.perf_counter()
            yield
            seconds = time.perf_counter() - started
            self.seconds += seconds
            self.idle_s += seconds * (CPU_SHARE.share_since(since) if self._on_cpu else 1.0)

    def observe(self, macs: float) -> None:
        if self.seconds > 0:
            self.measures.throughput.observe(self.adapter.info.id, macs, self.seconds, self.idle_s / self.seconds)


# ---- memory: a request's in-flight peak (app/memory.py) ------------------------------------------------------------
# Transient working memory of one forward, in units of its float32 hidden-state stack (L+1)·T·D·4: measured on
# smollm2-135m at 3,999 tokens with MALLOC_ARENA_MAX=2, RSS rose 0.47 GB above the first run's kept bytes (1.65 stacks)
# and 0.58 GB more for a compare's second run that keeps 0.54 GB (benchmarks/results/memory.md).
TRANSIENT_STACKS = 2.0


def run_kept_bytes(adapter, tokens: int, keys: int | None = None, record_scores: bool = False) -> int:
    """What one run keeps in the result cache: a long run (over full_map_tokens) its atlas (q̂ of every head, k̂ of
    every key/value head, float32; the overview) and float16 hidden states; a short run P (L·H·T·T_k float32),
    q̂/k̂ with scores, and float32 hidden states."""
    shape = model_shape(adapter)
    keys = keys or tokens
    layers, heads, d, hidden = shape.layers, shape.heads, shape.head_dim, shape.hidden
    if tokens > getattr(adapter, "full_map_tokens", 1 << 30):
        blocks = min(getattr(getattr(adapter, "atlas_config", None), "overview_blocks", 128), tokens)
        return (layers * (heads + shape.kv_heads) * tokens * d * 4 + layers * heads * blocks * blocks * 4
                + (layers + 1) * tokens * hidden * 2)
    kept = layers * heads * tokens * keys * 4 + (layers + 1) * tokens * hidden * 4
    if record_scores:
        kept += layers * heads * (tokens + keys) * d * 4 + layers * heads * tokens * keys * 4
    return kept


def request_peak_bytes(adapter, tokens: int, runs: int, keys: int | None = None, record_scores: bool = False) -> int:
    """A request's in-flight peak: the runs it keeps, and one forward's transient working memory at a time."""
    shape = model_shape(adapter)
    transient = TRANSIENT_STACKS * (shape.layers + 1) * tokens * shape.hidden * 4
    return int(runs * run_kept_bytes(adapter, tokens, keys, record_scores) + transient)


def cache_budgets(settings) -> tuple[int, int]:
    """(result_cache_bytes, image_cache_bytes) from memory_budget_bytes (see the module doc)."""
    decodes = settings.max_concurrent_decodes * settings.max_image_pixels * DECODE_BYTES_PER_PIXEL
    free = settings.memory_budget_bytes - settings.memory_reserved_bytes - settings.max_run_bytes - decodes
    free = max(free, 2 * MIN_CACHE_BYTES)
    return int(free * 3 // 4), int(free // 4)
