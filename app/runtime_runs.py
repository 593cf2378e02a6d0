"""The runtime's runs (app/runtime.py Runtime is made of this and app/runtime_models.py): the model's turns
(app/scheduler.py), threads per input size, cached encodings, the run store's keys (app/runstore.py), and `run`, the
engine's run from the store or admitted and kept."""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

import torch

from app.context import RequestContext, add_timing, after_response, current
from app.costs import CPU_SHARE, observe_run
from app.ids import new_run_id
from app.runstore import ResultCache
from app.scheduler import ModelScheduler
from app.settings import Settings
from models.adapters.base import AttentionAdapter, AttentionResult, Encoded
from models.interventions import Intervention
from models.lru import BoundedLRU


class ModelRuns:
    """The runs part of Runtime. Runtime.__init__ sets the state below; `adapter` is app/runtime_models.py's."""

    settings: Settings
    scheduler: ModelScheduler  # the model's turns: one forward at a time
    cache: ResultCache  # the run store
    _encoded: BoundedLRU[tuple, Encoded]
    adapter: Callable[..., AttentionAdapter]

    def get_run(self, run_id: str) -> AttentionResult | None:
        """A kept run by its `run_id` (every attention response carries one), or None once evicted from the result
        cache (or unknown). The result's `atlas` rebuilds any window of P (models/atlas.py); `model_id` names the
        adapter that ran it. Used by POST /api/runs/{run_id}/window and by interventions that take a source run."""
        return self.cache.by_run_id(run_id)


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
                observe_run(self.measures, adapter, n, n, len(interventions), result.elapsed_s, since)  # app/costs.py's throughput
                self.cache.put(key, result, ctx.client, make_room=False)
        # older runs leave RAM after the response: their files are encoded and queued off the answer's path (1.5 ms
        # of a fresh minilm view: benchmarks/results/first_view_floor_issue55.md); written after the model is free
        after_response(ctx, lambda: self.cache.make_room(keep=key))
        return result
