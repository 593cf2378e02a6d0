"""The inference runtime: loaded models, a bounded queue in front of them, and a result cache.

One runtime per process. Model runs are serialised (one forward at a time uses every core, or the
GPU); requests beyond `queue_depth` waiting are refused at once with 503 + Retry-After rather than
piling up. Forward results are cached by (model, input, interventions, scores?) so slider moves and
repeated views of the same input skip the model entirely.

Runtime is made of two parts: its models (app/runtime_models.py ModelCatalog: loading, preparing, describing) and its
runs (app/runtime_runs.py ModelRuns: turns, threads, the run store's keys, `run`); here are its state, made once, and
the start-up warm-up that times the default models.
"""
from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable

import torch

from app.context import RequestContext, add_timing, current, request_deadline  # noqa: F401  (re-exported)
from app.costs import CPU_SHARE, CostMeasures, observe_run, observe_step
from app.errors import Overloaded  # noqa: F401  (re-exported: app/errors.py holds it)
from app.memory import MemoryBudget
from app.runstore import ResultCache  # noqa: F401  (re-exported: the run store moved there)
from app.runtime_models import (  # noqa: F401  (re-exported: where the routes and tests take them from)
    PARITY_DIR, ModelCatalog, ModelPreparing, UnknownModel, configure_atlas, gpu_total_bytes, host_weight_bytes,
)
from app.runtime_runs import ModelRuns
from app.scheduler import ModelScheduler
from app.settings import Settings
from models.adapters.base import AttentionAdapter, Encoded
from models.cpu_linear import set_cpu_linear
from models.lru import BoundedLRU
from models.registry import ModelSpec, build_registry

log = logging.getLogger("attnlab")

# cache_scope (app/lifecycle.py): the client a request's cached results belong to when result_cache_scope is
# "client" (set by RequestGuard from the cookie or header); None: the cache is shared by everyone.
# The start-up timing forwards (Runtime.time_model), in characters/4 (about tokens): a short view and a long input over
# full_map_tokens, about 0.3 s and 1.5 s for smollm2-135m on an idle 2-core CPU.
TIMING_TOKENS = (128, 640)


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


class Runtime(ModelCatalog, ModelRuns):
    def __init__(self, settings: Settings, measures: CostMeasures | None = None):
        self.settings = settings
        # its models' measured speed (app/costs.py): the app's ProcessState's (app/process.py), else its own
        self.measures = measures if measures is not None else CostMeasures()
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
        self.scheduler = ModelScheduler(settings)  # the model's turns: one forward at a time
        self._encoded: BoundedLRU[tuple, Encoded] = BoundedLRU(settings.result_cache_items)
        self.cache = ResultCache(settings.result_cache_items, settings.result_cache_bytes,
                                 result_cache_device_bytes(settings, gpu_total_bytes(settings)), settings.result_pin_s,
                                 settings.run_store_disk_bytes, settings.run_store_dir,
                                 settings.run_store_min_free_bytes, settings.run_store_write_queue)
        # kept runs + in-flight peaks within memory_budget_bytes (app/memory.py); app/costs.py reserves before runs
        self.memory = MemoryBudget(settings.memory_budget_bytes, settings.memory_reserved_bytes, self.cache,
                                   settings.memory_watch_rss, wait_s=settings.memory_wait_s)
        self.ready = False
        if settings.torch_threads > 0:
            torch.set_num_threads(settings.torch_threads)
        set_cpu_linear(settings.cpu_linear)  # for the models it loads (process-wide: a property of the CPU)

    # ---- start-up: load and time the default models ---------------------------------------------------------
    def warm_up(self) -> None:
        """Load the default models and time them (startup_timing: before /api/ready turns 200, or just after)."""
        adapters = [self.adapter(model_id) for model_id in self.settings.default_models]
        timing = "compute_gmacs_per_s" not in self.settings.model_fields_set  # a rate the operator gave is taken as is
        if self.settings.startup_timing == "after_ready":
            self.ready = True
        for adapter in adapters if timing else ():
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
                    since, started = CPU_SHARE.mark(), time.perf_counter()
                    adapter.run(encoded, (), False)
                    seconds = time.perf_counter() - started
                observe_run(self.measures, adapter, n, n, 0, seconds, since)  # the load measured over the run itself
                timed.append(seconds)
                log.info("timed %s at start-up: %d tokens in %.2f s", adapter.info.id, n, seconds)
            self._time_steps(adapter, encoded)
        return timed

    def _time_steps(self, adapter: AttentionAdapter, encoded, steps: int = 3) -> None:
        """A decoder LM's decoding steps (one token each over the key/value cache), timed at start-up: a generate's
        first estimate then uses their measured seconds (app/costs.py stream_seconds), not only its multiply-adds."""
        continuation = getattr(adapter, "continuation", None)
        if continuation is None or "input_ids" not in encoded.inputs:
            return
        prompt = encoded.inputs["input_ids"][0, :32].tolist()
        stepping = continuation(prompt, (), steps + 1)
        next(stepping, None)  # the prompt's forward
        for _ in range(steps):
            started = time.perf_counter()
            if next(stepping, None) is None:
                return
            observe_step(self.measures, adapter, time.perf_counter() - started)


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
