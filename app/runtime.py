"""The inference runtime: loaded models, a bounded queue in front of them, and a result cache.

One runtime per process. Model runs are serialised (one forward at a time uses every core, or the
GPU); requests beyond `queue_depth` waiting are refused at once with 503 + Retry-After rather than
piling up. Forward results are cached by (model, input, interventions, scores?) so slider moves and
repeated views of the same input skip the model entirely.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import itertools
import logging
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator

import torch

from app.costs import observe_run, request_model_seconds
from app.errors import Overloaded  # noqa: F401  (re-exported: app/errors.py holds it)
from app.ids import new_run_id
from app.jobs import current_job, request_client
from app.memory import MemoryBudget
from app.lifecycle import RequestCancelled, after_layer, cache_scope, request_cancel  # noqa: F401  (cache_scope: re-exported)
from app.runstore import ResultCache  # noqa: F401  (re-exported: the run store moved there)
from app.settings import Settings
from models.adapters.base import AttentionAdapter, AttentionResult, Encoded
from models.hooks import UnsupportedAttention, on_each_layer
from models.interventions import Intervention
from models.registry import ModelSpec, build_registry


log = logging.getLogger("attnlab")


class UnknownModel(KeyError):
    pass


# Per-request time limit: the HTTP layer sets a monotonic deadline when a request arrives (see
# app.main.request_deadline); every wait for the model inside that request counts against it, so a
# request that queues twice (encode, then run) still waits at most `request_timeout_s` in all.
request_deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar("request_deadline", default=None)
# Seconds this request spent waiting for the model ("queue") and running it ("model"), for the
# Server-Timing header (app.main.ServerTiming); a dict shared with the worker thread of the request.
request_timings: contextvars.ContextVar[dict[str, float] | None] = contextvars.ContextVar("request_timings", default=None)
# cache_scope (app/lifecycle.py): the client a request's cached results belong to when result_cache_scope is
# "client" (set by RequestGuard from the cookie or header); None: the cache is shared by everyone.
CANCEL_POLL_S = 0.1
# The start-up timing forwards (Runtime.time_model), in characters/4 (about tokens): a short view and a long input over
# full_map_tokens, about 0.3 s and 1.5 s for smollm2-135m on an idle 2-core CPU.
TIMING_TOKENS = (128, 640)  # a queued request whose client left stops waiting within this


def _add_timing(name: str, seconds: float) -> None:
    timings = request_timings.get()
    if timings is not None:
        timings[name] = timings.get(name, 0.0) + seconds


def text_max_tokens(settings: Settings) -> int:
    """The text limit: max_tokens on a CPU; on a GPU max_tokens_gpu, or (None) the model's own context (each adapter
    caps the limit at its model's max_position_embeddings)."""
    on_gpu = settings.device == "cuda" or (settings.device == "auto" and torch.cuda.is_available())
    if not on_gpu:
        return settings.max_tokens
    return settings.max_tokens_gpu if settings.max_tokens_gpu is not None else 1 << 20


def result_cache_device_bytes(settings: Settings, gpu_total_bytes: int | None) -> int:
    """The result cache's budget in accelerator memory, where a long run's atlas stays: none on a CPU; on a GPU
    (gpu_total_bytes given) result_cache_bytes_gpu, or a quarter of the device's memory. Host memory keeps its own
    budget (result_cache_bytes) for what a run copies to the host."""
    if gpu_total_bytes is None:
        return 0
    if settings.result_cache_bytes_gpu is not None:
        return settings.result_cache_bytes_gpu
    return gpu_total_bytes // 4


def _gpu_total_bytes(settings: Settings) -> int | None:
    on_gpu = settings.device == "cuda" or (settings.device == "auto" and torch.cuda.is_available())
    return torch.cuda.get_device_properties(0).total_memory if on_gpu and torch.cuda.is_available() else None


def host_weight_bytes(adapter: AttentionAdapter) -> int:
    """Bytes of a loaded model's parameters and buffers in host memory (tied tensors once; 0 on a GPU)."""
    model = getattr(adapter, "model", None)
    if model is None or adapter.device.type != "cpu":
        return 0
    tensors = {t.data_ptr(): t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers())}
    return sum(tensors.values())


def configure_atlas(adapter: AttentionAdapter, settings: Settings) -> None:
    """Long inputs (docs/science.md §10): the adapter's threshold and block settings from the settings."""
    adapter.full_map_tokens = settings.full_map_tokens_image if adapter.info.kind == "image" else settings.full_map_tokens
    block_rows = settings.atlas_block_rows or (1024 if adapter.device.type == "cuda" else 128)
    adapter.atlas_config = dataclasses.replace(
        adapter.atlas_config, block_rows=block_rows, overview_blocks=settings.overview_blocks,
    )


class Runtime:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.specs: dict[str, ModelSpec] = build_registry(
            max_tokens=text_max_tokens(settings), weights_dir=settings.weights_dir,
            extra_text=settings.extra_text_models, extra_image=settings.extra_image_models,
            extra=settings.extra_models, max_new_tokens=settings.max_new_tokens,
            max_transcript_tokens=settings.max_transcript_tokens, max_audio_s=settings.max_audio_s,
        )
        self._adapters: dict[str, AttentionAdapter] = {}
        self.unavailable: dict[str, str] = {}  # model id → why it could not load
        self._described: dict[str, dict] = {}  # model id → its ModelInfo read from its files (not loaded yet)
        self._load_lock = threading.Lock()
        self._run_lock = threading.Lock()  # one forward at a time
        self._turns = threading.Condition()  # the lock is handed over by priority (see _acquire_in_order)
        # waiting turns as (priority, ticket): interactive work (0, arrival) before jobs (1, the job's arrival)
        self._fifo: list[tuple[tuple[int, int], int]] = []
        self._tickets = itertools.count(1)
        self.yields = 0  # times a running job handed the model to waiting interactive work (for the benchmarks)
        self._waiting = 0
        self._waiting_lock = threading.Lock()
        self._encoded: OrderedDict[tuple, Encoded] = OrderedDict()
        self._encoded_lock = threading.Lock()
        self.cache = ResultCache(settings.result_cache_items, settings.result_cache_bytes,
                                 result_cache_device_bytes(settings, _gpu_total_bytes(settings)), settings.result_pin_s)
        # kept runs + in-flight peaks within memory_budget_bytes (app/memory.py); app/costs.py reserves before runs
        self.memory = MemoryBudget(settings.memory_budget_bytes, settings.memory_reserved_bytes, self.cache,
                                   settings.memory_watch_rss)
        self.ready = False
        if settings.torch_threads > 0:
            torch.set_num_threads(settings.torch_threads)

    # ---- models ------------------------------------------------------------------------------------
    def adapter(self, model_id: str, kind: str | None = None) -> AttentionAdapter:
        spec = self.specs.get(model_id)
        if spec is None or (kind is not None and spec.kind != kind):
            names = sorted(i for i, s in self.specs.items() if kind is None or s.kind == kind)
            raise UnknownModel(f"unknown {kind or ''} model {model_id!r}; available: {names}".replace("  ", " "))
        adapter = self._adapters.get(model_id)
        if adapter is None:
            waited_from = time.monotonic()
            try:
                return self._load(model_id, spec)
            finally:
                # a first use's load (gemma3-270m: its weights and two probes, over a minute on a busy machine) is the
                # server's one-time cost: it does not count against the request's time limit
                deadline = request_deadline.get()
                if deadline is not None:
                    request_deadline.set(deadline + time.monotonic() - waited_from)
        return adapter

    def _load(self, model_id: str, spec: ModelSpec) -> AttentionAdapter:
        """Load a model once (under the load lock); refused loads are remembered in `unavailable`."""
        with self._load_lock:
            adapter = self._adapters.get(model_id)
            if adapter is None:
                if model_id in self.unavailable:  # refused once: say why again, without retrying the load
                    raise UnknownModel(f"model {model_id!r} is unavailable: {self.unavailable[model_id]}")
                try:
                    adapter = spec.load(self.settings.device, self.settings.dtype)
                except (ImportError, OSError, ValueError, UnsupportedAttention) as exc:
                    self.unavailable[model_id] = str(exc)
                    raise UnknownModel(f"model {model_id!r} is unavailable: {exc}") from exc
                configure_atlas(adapter, self.settings)
                if model_id not in self.settings.default_models:  # memory_reserved_bytes covers the defaults only
                    self.memory.add_model(model_id, host_weight_bytes(adapter))
                self._adapters[model_id] = adapter
        return adapter

    def describe(self, model_id: str, load: bool = True) -> dict | None:
        """The ModelInfo dict of a model without loading it when its spec can read its facts from its files (a
        prepared decoder LM: no parity until it is loaded), else that of the loaded model (loaded here, once; with
        `load` False, None instead). UnknownModel when it is not prepared here or was refused."""
        adapter = self._adapters.get(model_id)
        if adapter is not None:
            return adapter.info.to_dict()
        spec = self.specs.get(model_id)
        if spec is not None and spec.describe is not None and model_id not in self.unavailable:
            described = self._described.get(model_id)
            if described is None:
                try:
                    info = spec.describe(self.settings.dtype)
                except (OSError, ValueError) as exc:  # not prepared (the load would say the same)
                    self.unavailable[model_id] = str(exc)
                    raise UnknownModel(f"model {model_id!r} is unavailable: {exc}") from exc
                except Exception:  # noqa: BLE001 - files of a shape the description does not know: the load decides
                    log.exception("describing %s from its files failed; it is loaded to be listed", model_id)
                    info = None
                if info is not None:
                    described = self._described[model_id] = info.to_dict()
            if described is not None:
                return described
        return self.adapter(model_id).info.to_dict() if load else None

    def get_run(self, run_id: str) -> AttentionResult | None:
        """A kept run by its `run_id` (every attention response carries one), or None once evicted from the result
        cache (or unknown). The result's `atlas` rebuilds any window of P (models/atlas.py); `model_id` names the
        adapter that ran it. Used by POST /api/runs/{run_id}/window and by interventions that take a source run."""
        return self.cache.by_run_id(run_id)

    def warm_up(self) -> None:
        for model_id in self.settings.default_models:
            adapter = self.adapter(model_id)
            if "compute_gmacs_per_s" not in self.settings.model_fields_set:  # a rate the operator gave is taken as is
                self.time_model(adapter)
        self.ready = True

    def time_model(self, adapter: AttentionAdapter, sizes: tuple[int, ...] = TIMING_TOKENS) -> list[float] | None:
        """Time forwards of a text model at start-up, so that the first cost estimates use this machine's measured
        speed (app/costs.py) instead of the compute_gmacs_per_s assumption: a short input and one over full_map_tokens
        (the long path), so the fit has an overhead and a rate. The runs are not kept. Returns their seconds (None: not
        a text model)."""
        if adapter.info.kind != "text" or adapter.info.output == "seq2seq":
            return None
        words = "the model reads every token of this sentence and attends to the tokens before it".split()
        timed = []
        with self.admitted():
            adapter.run(adapter.encode(" ".join(words)), (), False)  # the first call's one-time set-up, untimed
            for size in sizes:
                encoded = adapter.encode(" ".join(words * (size // len(words) + 1))[: size * 6])
                n = len(encoded.tokens)
                with self._threads_for(n):
                    started = time.perf_counter()
                    adapter.run(encoded, (), False)
                    seconds = time.perf_counter() - started
                observe_run(adapter, n, n, 0, seconds)
                timed.append(seconds)
                log.info("timed %s at start-up: %d tokens in %.2f s", adapter.info.id, n, seconds)
        return timed

    def loaded_adapters(self) -> list[AttentionAdapter]:
        return list(self._adapters.values())

    # ---- admission ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def admitted(self, interactive: bool | None = None) -> Iterator[None]:
        """Hold the model lock; refuse at once when `queue_depth` requests already wait.

        Interactive work (a plain request, a decoding step; `interactive` None: whatever is not a job) takes the lock
        before any waiting job, and a running job hands the lock to it at the next layer boundary (`_layer_done`):
        short work waits for at most one layer of a long job (docs/api.md "Jobs"). Jobs take turns in arrival order."""
        job = current_job.get()
        if interactive is None:
            interactive = job is None
        priority = (0, next(self._tickets)) if interactive or job is None else (1, job.seq)
        with self._waiting_lock:
            if self._waiting >= self.settings.queue_depth:
                raise Overloaded(f"server busy: {self._waiting} requests already waiting (queue_depth)")
            self._waiting += 1
        deadline = request_deadline.get()
        timeout = self.settings.request_timeout_s if deadline is None else deadline - time.monotonic()
        waited_from = time.perf_counter()
        try:
            acquired = timeout > 0 and self._acquire_in_order(timeout, priority)
        finally:
            _add_timing("queue", time.perf_counter() - waited_from)
            with self._waiting_lock:
                self._waiting -= 1
        if acquired == "cancelled":
            raise RequestCancelled(request_cancel.get().reason)
        if not acquired:
            raise self._timed_out(job)
        holding = [True]

        def layer_done(layer: int, n_layers: int) -> None:
            after_layer(layer, n_layers)  # cancel and progress first: a job that should stop does not queue again
            if priority[0] == 1:
                self._hand_over_if_waited(priority, holding, job)

        try:
            cancel = request_cancel.get()
            if cancel is not None and cancel.is_set():  # the client left while we waited: the lock goes on at once
                raise RequestCancelled(cancel.reason)
            self._refuse_if_out_of_time(deadline)
            with on_each_layer(layer_done):  # a client that leaves stops the forward at its next layer
                yield
        finally:
            if holding[0]:
                self._run_lock.release()
            with self._turns:
                self._turns.notify_all()

    def _timed_out(self, job) -> Overloaded:
        if job is not None:
            return Overloaded(f"timed out waiting for the model: the job ran past job_timeout_s="
                              f"{self.settings.job_timeout_s:g} s", retry_after=max(1, round(self.settings.request_timeout_s / 4)))
        return Overloaded(
            f"timed out after {self.settings.request_timeout_s:g} s waiting for the model (request_timeout_s)",
            retry_after=max(1, round(self.settings.request_timeout_s / 4)),
        )

    def _hand_over_if_waited(self, priority: tuple[int, int], holding: list[bool], job) -> None:
        """Between two layers of a job's forward: when interactive work waits, let it run, then take the lock back in
        the job's own place (its arrival order among jobs). The forward's state lives in this thread and the engine's
        recording in context variables, so another forward in between changes nothing of this one."""
        with self._turns:
            if not any(p[0] == 0 for p, _ in self._fifo):
                return
            holding[0] = False
            self._run_lock.release()
            self.yields += 1
            self._turns.notify_all()
        deadline = request_deadline.get()
        timeout = self.settings.job_timeout_s if deadline is None else deadline - time.monotonic()
        acquired = timeout > 0 and self._acquire_in_order(timeout, priority)
        if acquired == "cancelled":
            raise RequestCancelled(request_cancel.get().reason)
        if not acquired:
            raise self._timed_out(job)
        holding[0] = True

    def _refuse_if_out_of_time(self, deadline: float | None) -> None:
        """At a request's first turn with the model: 503 when its estimated model time no longer fits before its
        deadline (it waited in a long queue), instead of starting work that the deadline would throw away."""
        estimate = request_model_seconds.get()
        if estimate is None:
            return
        request_model_seconds.set(None)  # the request's later runs belong to the same estimate
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and estimate > left:
            raise Overloaded(
                f"server busy: this request needs about {estimate:.0f} s of model time and {max(left, 0):.0f} s "
                f"of request_timeout_s={self.settings.request_timeout_s:g} s are left after its wait in the queue",
                retry_after=max(1, round(self.settings.request_timeout_s / 4)),
            )

    def _acquire_in_order(self, timeout: float, priority: tuple[int, int] | None = None) -> bool | str:
        """Take the model lock in priority order (interactive work first, each kind in arrival order): with a bare Lock a
        newcomer may overtake the queue, so an unlucky request could wait until its time limit however short the queue
        is. "cancelled": the request's client left (or the server stops) while it waited; it leaves the queue then."""
        end = time.monotonic() + timeout
        entry = (priority or (0, next(self._tickets)), next(self._tickets))
        cancel = request_cancel.get()
        with self._turns:
            self._fifo.append(entry)
            try:
                while True:
                    if cancel is not None and cancel.is_set():
                        return "cancelled"
                    if min(self._fifo) == entry and self._run_lock.acquire(blocking=False):
                        return True
                    remaining = end - time.monotonic()
                    if remaining <= 0:
                        return False
                    # woken at each release; the poll notices a cancelled request (a client that left)
                    self._turns.wait(min(remaining, CANCEL_POLL_S if cancel is not None else 0.5))
            finally:
                self._fifo.remove(entry)
                self._turns.notify_all()

    @property
    def waiting(self) -> int:
        return self._waiting

    # ---- runs --------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _threads_for(self, n_tokens: int) -> Iterator[None]:
        """One torch thread for small inputs (settings.single_thread_max_tokens); called under the model lock."""
        threads = torch.get_num_threads()
        if n_tokens > self.settings.single_thread_max_tokens or threads == 1:
            yield
            return
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(threads)

    @contextlib.contextmanager
    def step(self, n_tokens: int, interactive: bool | None = None) -> Iterator[None]:
        """One step of a longer piece of work (a patching batch, a decoding step), admitted on its own so other requests
        interleave, on one thread for small inputs. Every step counts against the same deadline: the job's
        (job_timeout_s) or the request's (request_timeout_s); outside a request, request_timeout_s from now.
        A decoding step is interactive (`interactive=True`): it goes before waiting jobs."""
        token = None
        if request_deadline.get() is None:
            token = request_deadline.set(time.monotonic() + self.settings.request_timeout_s)
        try:
            with self.admitted(interactive), self._threads_for(n_tokens):
                yield
        finally:
            if token is not None:
                request_deadline.reset(token)

    def encode(self, adapter: AttentionAdapter, input_key: tuple, encode: Callable[[], Encoded]) -> Encoded:
        """Encoded inputs are cached too; encoding may run the model (a pair's embedding), so it is admitted."""
        key = (cache_scope.get(), adapter.info.id, input_key)
        with self._encoded_lock:
            encoded = self._encoded.get(key)
            if encoded is not None:
                self._encoded.move_to_end(key)
                return encoded
        with self.admitted():
            encoded = encode()
        with self._encoded_lock:
            self._encoded[key] = encoded
            while len(self._encoded) > self.settings.result_cache_items:
                self._encoded.popitem(last=False)
        return encoded

    @staticmethod
    def _cache_keys(adapter: AttentionAdapter, encoded: Encoded, interventions: tuple[Intervention, ...],
                    record_scores: bool) -> list[tuple]:
        """The cache keys that answer a run, in order: its own, and without scores the run with them (it serves)."""
        scope = cache_scope.get()  # result_cache_scope="client": each client's own entries (docs/deploy.md)
        key = (scope, adapter.info.id, encoded.key, interventions, record_scores)
        return [key] if record_scores else [key, (*key[:-1], True)]

    def is_cached(self, adapter: AttentionAdapter, encoded: Encoded, interventions: tuple[Intervention, ...],
                  record_scores: bool) -> bool:
        """Whether `run` with these arguments would be answered from the cache (for the checks before the work)."""
        return any(key in self.cache for key in self._cache_keys(adapter, encoded, interventions, record_scores))

    def run(
        self, adapter: AttentionAdapter, encoded: Encoded, interventions: tuple[Intervention, ...], record_scores: bool
    ) -> AttentionResult:
        keys = self._cache_keys(adapter, encoded, interventions, record_scores)
        key = keys[0]
        for candidate in keys:
            result = self.cache.get(candidate)
            if result is not None:
                return result
        with self.admitted():
            result = self.cache.get(key)  # another request may have computed it while we waited
            if result is None:
                started = time.perf_counter()
                with self._threads_for(len(encoded.tokens)):
                    result = adapter.run(encoded, interventions, record_scores)
                result.elapsed_s = time.perf_counter() - started  # type: ignore[attr-defined]
                result.run_id, result.model_id = new_run_id(), adapter.info.id
                _add_timing("model", result.elapsed_s)
                n = len(encoded.tokens)
                observe_run(adapter, n, n, len(interventions), result.elapsed_s)  # app/costs.py's throughput
                self.cache.put(key, result, request_client.get())
        return result


class PerRuntime:
    """One object per Runtime (per app), made by factory(runtime) on first use and dropped with the runtime: the
    caches and stores that routes keep beside the result cache (transcripts, patch sources, head-kind answers)."""

    def __init__(self, factory: Callable[[Runtime], object]):
        self._factory = factory
        self._items: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def __call__(self, runtime: Runtime):
        with self._lock:
            item = self._items.get(runtime)
            if item is None:
                item = self._items[runtime] = self._factory(runtime)
            return item
