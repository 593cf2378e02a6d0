"""The inference runtime: loaded models, a bounded queue in front of them, and a result cache.

One runtime per process. Model runs are serialised (one forward at a time uses every core, or the
GPU); requests beyond `queue_depth` waiting are refused at once with 503 + Retry-After rather than
piling up. Forward results are cached by (model, input, interventions, scores?) so slider moves and
repeated views of the same input skip the model entirely.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import threading
import time
import weakref
from pathlib import Path
from collections.abc import Callable, Iterator

import torch

from app.costs import CPU_SHARE, observe_run, observe_step
from app.context import RequestContext, add_timing, current, request_deadline  # noqa: F401  (re-exported)
from app.errors import Overloaded  # noqa: F401  (re-exported: app/errors.py holds it)
from app.ids import new_run_id
from app.memory import MemoryBudget, process_rss
from app.scheduler import ModelScheduler
from app.runstore import ResultCache  # noqa: F401  (re-exported: the run store moved there)
from app.settings import Settings
from models.adapters.base import AttentionAdapter, AttentionResult, Encoded
from models.cpu_linear import set_cpu_linear
from models.hooks import UnsupportedAttention
from models.interventions import Intervention
from models import preparing
from models.lru import BoundedLRU
from models.registry import ModelSpec, build_registry


log = logging.getLogger("attnlab")
PARITY_DIR = ".measured"  # under the weights folder: each model's last load-time parity (Runtime._keep_parity)


class UnknownModel(KeyError):
    pass


class ModelPreparing(UnknownModel):
    """A model whose weights a preparation is making now (models/preparing.py, `make run`): 503 with Retry-After
    (app/deps.py), not the 422 of a model this server does not have."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


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
        self.scheduler = ModelScheduler(settings)  # the model's turns: one forward at a time
        self._encoded: BoundedLRU[tuple, Encoded] = BoundedLRU(settings.result_cache_items)
        self.cache = ResultCache(settings.result_cache_items, settings.result_cache_bytes,
                                 result_cache_device_bytes(settings, _gpu_total_bytes(settings)), settings.result_pin_s,
                                 settings.run_store_disk_bytes, settings.run_store_dir,
                                 settings.run_store_min_free_bytes, settings.run_store_write_queue)
        # kept runs + in-flight peaks within memory_budget_bytes (app/memory.py); app/costs.py reserves before runs
        self.memory = MemoryBudget(settings.memory_budget_bytes, settings.memory_reserved_bytes, self.cache,
                                   settings.memory_watch_rss, wait_s=settings.memory_wait_s)
        self.ready = False
        if settings.torch_threads > 0:
            torch.set_num_threads(settings.torch_threads)
        set_cpu_linear(settings.cpu_linear)  # for the models it loads (process-wide: a property of the CPU)

    # ---- models ------------------------------------------------------------------------------------
    def adapter(self, model_id: str, kind: str | None = None) -> AttentionAdapter:
        spec = self.specs.get(model_id)
        if spec is None or (kind is not None and spec.kind != kind):
            names = self.available_ids(kind)
            raise UnknownModel(f"unknown {kind or ''} model {model_id!r}; available: {names}".replace("  ", " "))
        adapter = self._adapters.get(model_id)
        if adapter is None:
            self._refuse_unprepared(model_id)
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

    def preparation(self, model_id: str) -> dict | None:
        """Its preparation's state while a model's weights are not in place (models/preparing.py): "preparing" (or
        queued for it) or "failed", with the reason and the log; None when it is prepared or none is recorded."""
        spec = self.specs.get(model_id)
        if spec is None or model_id in self._adapters or spec.prepared is None or spec.prepared():
            return None
        return preparing.read(self.settings.weights_dir, model_id)

    def _refuse_unprepared(self, model_id: str) -> None:
        """ModelPreparing while a model is being prepared, UnknownModel when its preparation failed (not remembered
        in `unavailable`: the model is served once its weights are in place, without a restart)."""
        state = self.preparation(model_id)
        if state is None:
            return
        log_name = self.preparation_log(state)
        if state["state"] == "preparing":
            raise ModelPreparing(f"model {model_id!r} is being prepared on this server (`attnlab prepare`, started "
                                 f"{time.time() - state['since']:.0f} s ago; log: {log_name}); try again in a moment",
                                 preparing.RETRY_AFTER_S)
        raise UnknownModel(f"model {model_id!r} is unavailable: its preparation failed ({state.get('error')}); "
                           f"log: {log_name}")

    def preparation_log(self, state: dict) -> str | None:
        """A preparation's log by its absolute path on the server (weights/.preparing/<id>.log resolved): a path relative
        to the weights folder's bare name (`w2/.preparing/…`) left the reader to guess the folder it starts from."""
        log_path = state.get("log")
        if not log_path:
            return None
        return str((Path(self.settings.weights_dir) / preparing.STATE_DIR / Path(log_path).name).resolve())

    def not_ready(self, kind: str | None = None) -> list[dict]:
        """The models of `kind` being prepared, or whose preparation failed (GET /api/models `not_ready`, the pages'
        model menus): id, kind, description, state, log, and retry_after_s or error."""
        entries = []
        for model_id, spec in self.specs.items():
            state = self.preparation(model_id) if kind is None or spec.kind == kind else None
            if state is None:
                continue
            entry = {"id": model_id, "kind": spec.kind, "description": spec.description, "state": state["state"],
                     "log": self.preparation_log(state)}
            if state["state"] == "preparing":
                entry["retry_after_s"] = preparing.RETRY_AFTER_S
            else:
                entry["error"] = state.get("error")
            entries.append(entry)
        return entries

    def _unprepared(self, spec: ModelSpec) -> bool:
        """Its weights are not in place (yet): a refusal for that is not remembered, the model may be prepared later."""
        return spec.prepared is not None and not spec.prepared()

    def available_ids(self, kind: str | None = None) -> list[str]:
        """The models of `kind` a request may name here (for the 422 on an unknown one): loaded, or described from
        their prepared files, or not refused so far; never one whose weights are not prepared (qwen2.5-0.5b before
        `make qwen2.5-0.5b`), which GET /api/models leaves out too. Nothing is loaded to answer."""
        names = []
        for model_id, spec in self.specs.items():
            if (kind is not None and spec.kind != kind) or model_id in self.unavailable:
                continue
            if model_id not in self._adapters and spec.prepared is not None and not spec.prepared():
                continue
            if model_id not in self._adapters and spec.describe is not None:
                try:
                    self.describe(model_id, load=False)
                except UnknownModel:  # not prepared here (now in `unavailable`)
                    continue
            names.append(model_id)
        return sorted(names)

    def _load(self, model_id: str, spec: ModelSpec) -> AttentionAdapter:
        """Load a model once (under the load lock); refused loads are remembered in `unavailable`."""
        with self._load_lock:
            adapter = self._adapters.get(model_id)
            if adapter is None:
                if model_id in self.unavailable:  # refused once: say why again, without retrying the load
                    raise UnknownModel(f"model {model_id!r} is unavailable: {self.unavailable[model_id]}")
                first_use = model_id not in self.settings.default_models  # memory_reserved_bytes: the defaults
                booked = spec.weight_files() if first_use and spec.weight_files and self._on_host() else 0
                if booked:  # room before it loads: kept runs leave RAM, or the load waits (503)
                    # its weights and, while it loads, the probe's outputs (about as much again: gemma3-270m's
                    # logits over the long probe input, ours and eager's, 1.0 GiB beside 1.0 GiB of weights)
                    self.memory.reserve_model(model_id, 2 * booked, request_deadline.get())
                rss_before = process_rss()
                try:
                    adapter = spec.load(self.settings.device, self.settings.dtype)
                except BaseException as exc:
                    if booked:
                        self.memory.unreserve_model(model_id)
                    if not isinstance(exc, (ImportError, OSError, ValueError, UnsupportedAttention)):
                        raise
                    if not self._unprepared(spec):
                        self.unavailable[model_id] = str(exc)
                    raise UnknownModel(f"model {model_id!r} is unavailable: {exc}") from exc
                configure_atlas(adapter, self.settings)
                if first_use:  # its weights, or what the load left resident if more (gemma3-270m: its 262k-token
                    # tokenizer too, 1.4 GiB for 1.0 GiB of weights), never more than was booked for the load
                    grown = min(max(0, process_rss() - rss_before), 2 * booked) if booked else 0
                    self.memory.add_model(model_id, max(host_weight_bytes(adapter), grown))
                self._adapters[model_id] = adapter
                self._keep_parity(adapter)
        return adapter

    def _on_host(self) -> bool:
        """Whether loaded weights live in host memory (the budget's concern): not when a GPU takes them."""
        return _gpu_total_bytes(self.settings) is None

    def describe(self, model_id: str, load: bool = True) -> dict | None:
        """The ModelInfo dict of a model without loading it when its spec can read its facts from its files (a
        prepared decoder LM: no parity until it is loaded), else that of the loaded model (loaded here, once; with
        `load` False, None instead). UnknownModel when it is not prepared here or was refused."""
        adapter = self._adapters.get(model_id)
        if adapter is not None:
            return adapter.info.to_dict()
        spec = self.specs.get(model_id)
        if spec is not None:
            # Weights not in place: being prepared (ModelPreparing), or not prepared here. Such a refusal is not
            # remembered in `unavailable` (the model is served once prepared), so it is decided here on every call.
            self._refuse_unprepared(model_id)
            if self._unprepared(spec):
                raise UnknownModel(f"model {model_id!r} is not prepared on this server")
        if spec is not None and spec.describe is not None and model_id not in self.unavailable:
            described = self._described.get(model_id)
            if described is None:
                try:
                    info = spec.describe(self.settings.dtype)
                except (OSError, ValueError) as exc:  # not prepared (the load would say the same)
                    if not self._unprepared(spec):
                        self.unavailable[model_id] = str(exc)
                    raise UnknownModel(f"model {model_id!r} is unavailable: {exc}") from exc
                except Exception:  # noqa: BLE001 - files of a shape the description does not know: the load decides
                    log.exception("describing %s from its files failed; it is loaded to be listed", model_id)
                    info = None
                if info is not None:
                    described = self._described[model_id] = info.to_dict()
            if described is not None:
                return self._with_last_parity(model_id, described)
        return self.adapter(model_id).info.to_dict() if load else None

    # ---- the load-time parity, kept for the listing before a load --------------------------------------------------
    def _parity_file(self, model_id: str) -> Path:
        return Path(self.settings.weights_dir) / PARITY_DIR / f"{model_id}.json"

    def _keep_parity(self, adapter: AttentionAdapter) -> None:
        """The load-time probe's parity, kept in the weights folder (.measured/<id>.json) so that GET /api/models
        states it beside the model before its next load (Whisper, a decoder LM: described from their files)."""
        parity = adapter.info.parity
        if not isinstance(parity, (int, float)):
            return
        path = self._parity_file(adapter.info.id)
        try:
            path.parent.mkdir(exist_ok=True)
            path.write_text(json.dumps({"parity": parity, "dtype": self.settings.dtype, "source": adapter.info.source,
                                        "measured_at": time.time()}))
        except OSError as exc:  # a read-only weights folder: the listing says nothing until a load, as before
            log.warning("could not keep %s's parity in %s: %s", adapter.info.id, path, exc)

    def _with_last_parity(self, model_id: str, described: dict) -> dict:
        """A model described from its files: with the parity its last load measured (same files, this dtype), if any."""
        if described.get("parity") is not None:
            return described
        try:
            kept = json.loads(self._parity_file(model_id).read_text())
        except (OSError, ValueError):
            return described
        # the same files at the same dtype: another model under this id (a test's tiny model) has its own figure
        same = kept.get("dtype") == self.settings.dtype and kept.get("source") == described.get("source")
        if not same or not isinstance(kept.get("parity"), (int, float)):
            return described
        return {**described, "parity": kept["parity"]}

    def get_run(self, run_id: str) -> AttentionResult | None:
        """A kept run by its `run_id` (every attention response carries one), or None once evicted from the result
        cache (or unknown). The result's `atlas` rebuilds any window of P (models/atlas.py); `model_id` names the
        adapter that ran it. Used by POST /api/runs/{run_id}/window and by interventions that take a source run."""
        return self.cache.by_run_id(run_id)

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
                observe_run(adapter, n, n, 0, seconds, since)  # the load measured over the run itself
                timed.append(seconds)
                log.info("timed %s at start-up: %d tokens in %.2f s", adapter.info.id, n, seconds)
            self._time_steps(adapter, encoded)
        return timed

    @staticmethod
    def _time_steps(adapter: AttentionAdapter, encoded, steps: int = 3) -> None:
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
            observe_step(adapter, time.perf_counter() - started)

    def loaded_adapters(self) -> list[AttentionAdapter]:
        return list(self._adapters.values())

    # ---- admission: the model's turns (app/scheduler.py) ---------------------------------------------------
    def admitted(self, interactive: bool | None = None, ctx: RequestContext | None = None):
        """Hold the model lock for the request `ctx` in the scheduler's fair order (app/scheduler.py
        ModelScheduler.admitted)."""
        return self.scheduler.admitted(interactive, ctx)

    @property
    def waiting(self) -> int:
        return self.scheduler.waiting

    @property
    def yields(self) -> int:
        return self.scheduler.yields

    # ---- runs --------------------------------------------------------------------------------------
    def threads_wanted(self, n_tokens: int) -> int:
        """Torch threads for CPU work on an input of n_tokens: one for small inputs (settings.single_thread_max_tokens),
        else no more than the cores other processes leave free (app/costs.py CpuShare.threads_for)."""
        if n_tokens <= self.settings.single_thread_max_tokens:
            return 1
        return CPU_SHARE.threads_for(torch.get_num_threads())

    @contextlib.contextmanager
    def _threads_for(self, n_tokens: int) -> Iterator[int]:
        """The run's threads_wanted, set process-wide and given to the block; called under the model lock."""
        threads = torch.get_num_threads()
        wanted = self.threads_wanted(n_tokens)
        if wanted == threads:
            yield wanted
            return
        torch.set_num_threads(wanted)
        try:
            yield wanted
        finally:
            torch.set_num_threads(threads)

    @contextlib.contextmanager
    def step(self, n_tokens: int, interactive: bool | None = None, ctx: RequestContext | None = None
             ) -> Iterator[None]:
        """One step of a longer piece of work (a patching batch, a decoding step) of the request `ctx` (None: the
        current context), admitted on its own so other requests interleave, on one thread for small inputs. Every step
        counts against the same deadline: the job's (job_timeout_s) or the request's (request_timeout_s); outside a
        request, request_timeout_s from now. A decoding step is interactive (`interactive=True`): it goes before
        waiting jobs."""
        ctx = ctx or current()
        if ctx.deadline is None:
            ctx = ctx.with_(deadline=time.monotonic() + self.settings.request_timeout_s)
        with self.admitted(interactive, ctx), self._threads_for(n_tokens):
            yield

    def encode(self, adapter: AttentionAdapter, input_key: tuple, encode: Callable[[], Encoded],
               ctx: RequestContext | None = None) -> Encoded:
        """Encoded inputs are cached too (per the request `ctx`'s cache scope; None: the current context's);
        encoding may run the model (a pair's embedding), so it is admitted."""
        ctx = ctx or current()
        key = (ctx.cache_scope, adapter.info.id, input_key)
        encoded = self._encoded.get(key)
        if encoded is not None:
            return encoded
        with self.admitted(ctx=ctx):
            encoded = encode()
        return self._encoded.put(key, encoded)

    @staticmethod
    def _cache_keys(adapter: AttentionAdapter, encoded: Encoded, interventions: tuple[Intervention, ...],
                    record_scores: bool, scope: str | None) -> list[tuple]:
        """The cache keys that answer a run, in order: its own, and without scores the run with them (it serves).
        `scope`: the request's cache scope (result_cache_scope="client": each client's own entries, docs/deploy.md)."""
        key = (scope, adapter.info.id, encoded.key, interventions, record_scores)
        return [key] if record_scores else [key, (*key[:-1], True)]

    def is_cached(self, adapter: AttentionAdapter, encoded: Encoded, interventions: tuple[Intervention, ...],
                  record_scores: bool, ctx: RequestContext | None = None) -> bool:
        """Whether `run` with these arguments would be answered from the cache (for the checks before the work)."""
        scope = (ctx or current()).cache_scope
        return any(key in self.cache for key in self._cache_keys(adapter, encoded, interventions, record_scores, scope))

    def holding_runs(self, adapter: AttentionAdapter, encoded: Encoded,
                     runs: list[tuple[tuple[Intervention, ...], bool]], ctx: RequestContext | None = None
                     ) -> contextlib.AbstractContextManager:
        """While a job runs: its planned runs, each (interventions, record_scores), are held in the run store, kept
        already or put meanwhile; they may move to disk but are never dropped (a compare never computes its kept
        base twice)."""
        scope = (ctx or current()).cache_scope
        keys = [key for interventions, scores in runs
                for key in self._cache_keys(adapter, encoded, interventions, scores, scope)]
        return self.cache.holding(keys)

    def promise_run(self, adapter: AttentionAdapter, encoded: Encoded, interventions: tuple[Intervention, ...],
                    ctx: RequestContext | None = None) -> str:
        """The run id of `run(adapter, encoded, interventions, False)` without running it now: a kept run's id when
        there is one, else a promise (app/runstore.py ResultCache.promise) that runs it, once, on first use of the id,
        as the request that uses it (its deadline and turn), in this request's cache scope. A continuation's kept runs
        (app/routes/text.py) are named so: most are never looked into, and the decode has just done the model's work."""
        ctx = ctx or current()
        keys = self._cache_keys(adapter, encoded, interventions, False, ctx.cache_scope)
        for candidate in keys:
            if candidate in self.cache:
                kept = self.cache.get(candidate)
                if kept is not None and kept.run_id is not None:
                    return kept.run_id
        run_id, model_id, scope = new_run_id(), adapter.info.id, ctx.cache_scope

        def make() -> AttentionResult:
            return self.run(self.adapter(model_id), encoded, interventions, False,
                            current().with_(cache_scope=scope), run_id=run_id)

        self.cache.promise(run_id, keys[0], make)
        return run_id

    def run(self, adapter: AttentionAdapter, encoded: Encoded, interventions: tuple[Intervention, ...],
            record_scores: bool, ctx: RequestContext | None = None, run_id: str | None = None) -> AttentionResult:
        """The engine's run for the request `ctx` (None: the current context): from the result cache (its cache
        scope's), else admitted by the scheduler (its job, client, deadline, cancel, estimate, progress) and kept
        (under `run_id` when given: a promised run's, else a new one)."""
        ctx = ctx or current()
        keys = self._cache_keys(adapter, encoded, interventions, record_scores, ctx.cache_scope)
        key = keys[0]
        for candidate in keys:
            result = self.cache.get(candidate)
            if result is not None:
                return result
        with self.admitted(ctx=ctx):
            result = self.cache.get(key)  # another request may have computed it while we waited
            if result is None:
                since, started = CPU_SHARE.mark(), time.perf_counter()
                with self._threads_for(len(encoded.tokens)) as threads:
                    result = adapter.run(encoded, interventions, record_scores)
                result.elapsed_s = time.perf_counter() - started  # type: ignore[attr-defined]
                # its first view's tensor work, a moment later, takes the same count (app/pipeline/views.py)
                result.threads_decided = (threads, time.monotonic())  # type: ignore[attr-defined]
                result.run_id, result.model_id = run_id or new_run_id(), adapter.info.id
                add_timing("model", result.elapsed_s, ctx)
                n = len(encoded.tokens)
                observe_run(adapter, n, n, len(interventions), result.elapsed_s, since)  # app/costs.py's throughput
                self.cache.put(key, result, ctx.client, make_room=False)
        self.cache.make_room(keep=key)  # runs moving to disk are written after the model is free for others
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
