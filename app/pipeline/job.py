"""An attention request checked once: an `AttentionJob` of the kind its model's family names (`build_job`: Family.job
→ JOB_BUILDERS, a `PlainJob`, `Seq2SeqJob` or `SpeechJob`), built before any work from the request, its adapter and
its encoded input, carries what every later step reads: the validated layers, heads
and query rows, the engine interventions (app/interventions.py, one validator with its per-family table), the
weighting, the run plan (which model runs the request makes) and the work besides them (a long value-weighted
overview), with every 422 and the response-size 413 raised while it is built. `admit()` is the cost check (run
bytes, memory, model time: 413s before work; a job is accepted there), `runs()` makes the runs."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import HTTPException

from app.attention import check_response_numbers
from app.admission import check_extra_cost, check_request_cost, check_work_cost
from app.context import EMPTY, RequestContext
from app.costs import forward_macs, model_shape, request_peak_bytes, value_overview_macs
from app.errors import field_error
from app.interventions import check_indices, engine_interventions, seq2seq_interventions, whisper_interventions
from app.lifecycle import check_cancelled
from app.patch_sources import request_sources
from app.runtime import Runtime
from models.adapters.base import AttentionAdapter, AttentionResult, Encoded
from models.atlas import run_bytes
from models.attribution import value_grams
from models.effects import mean_and_std
from models.families import Family, family_named
from models.head_ops import HeadRun, head_run

# A long value-weighted first view rebuilds its overview from q̂/k̂ (models/attribution.value_weighted_overview)
OVERVIEW_FIELD, OVERVIEW_WHAT = "weighting", "the value-weighted overview (weighting value_norm)"


def check_run_budget(runtime: Runtime, maps: list[tuple[int, int, int, int]], field: str = "text",
                     adapter: AttentionAdapter | None = None) -> None:
    """413 before a run whose kept tensors would exceed the settings' max_run_bytes. Per stack of maps (layers,
    heads, queries, keys): all of P for a short run (every map is recorded and cached, not only the returned
    slices); for a long run (`adapter` given and over full_map_tokens) what its atlas keeps: q̂, k̂, the overview,
    received and one block's temporaries (models/atlas.py, docs/science.md §10)."""
    settings = runtime.settings
    needed = 0
    for l, h, q, k in maps:
        if adapter is not None and max(q, k) > adapter.full_map_tokens:
            info = adapter.info
            needed += run_bytes(l, h, info.kv_heads or h, info.head_dim, q, k, settings.overview_blocks,
                                adapter.atlas_config.block_rows)
        else:
            needed += 4 * l * h * q * k  # float32
    on_gpu = adapter is not None and getattr(adapter, "device", None) is not None and adapter.device.type == "cuda"
    name, cap = ("max_run_bytes_gpu", settings.max_run_bytes_gpu) if on_gpu else ("max_run_bytes", settings.max_run_bytes)
    if needed > cap:
        raise HTTPException(
            413, detail=f"{field}: this input's run keeps {needed / 2**20:,.0f} MiB (attention maps, or for inputs "
            f"over full_map_tokens={settings.full_map_tokens:,} q̂/k̂ and summaries), over the cap "
            f"{name}={cap / 2**20:,.0f} MiB; use a shorter input",
        )
    disk = settings.run_store_disk_bytes  # where a run goes when it leaves RAM (app/runstore.py); 0: no disk tier
    if disk and needed > disk:
        raise HTTPException(
            413, detail=f"{field}: this input's run keeps {needed / 2**20:,.2f} MiB, over the run store's disk tier "
            f"run_store_disk_bytes={disk / 2**20:,.2f} MiB, where runs are kept once they leave memory; use a shorter "
            "input",
        )


class RequestPeak:
    """A request's estimated in-flight memory (app/costs.py request_peak_bytes): refused at once (413) when it could
    never fit the budget; `reserve()` waits for room."""

    def __init__(self, runtime: Runtime, adapter: AttentionAdapter, n_tokens: int, runs: int, record_scores: bool,
                 field: str = "text", keys: int | None = None):
        self.runtime = runtime
        self.nbytes = request_peak_bytes(adapter, n_tokens, runs, keys, record_scores)
        self.what = f"{runs} model run{'s' if runs > 1 else ''} over {n_tokens:,} tokens"
        self.field = "compare" if runs > 1 and field == "text" else field
        runtime.memory.check_fits(self.nbytes, self.field, self.what)

    def reserve(self, ctx: RequestContext) -> None:
        """Wait for the bytes as the request `ctx` (its memory holder, deadline and cancel), for as long as it will
        hold them: a job until it ends, else its model time (its cost check's estimate)."""
        expected_s = ctx.job.board.ends_in_s(ctx.job) if ctx.job is not None else ctx.estimate_s
        self.runtime.memory.reserve(ctx, self.nbytes, self.field, self.what, expected_s)


@dataclass(frozen=True)
class ExtraWork:
    """Work a request does besides its model runs, counted by the cost check with them: the field to name when it
    is over the limit, what it is, its multiply-adds, and the passes over the layers it reports as progress."""

    field: str
    what: str
    macs: float
    passes: int


@dataclass
class AttentionJob:
    """One attention request, checked (see the module doc): what every kind of job has. Its kind is its class, picked
    by the model's family (Family.job → JOB_BUILDERS below); its answer is its family's view (Family.view →
    app/pipeline/views.py VIEWS). PlainJob: encoders, decoder LMs, ViTs; Seq2SeqJob: encoder–decoders, per kind;
    SpeechJob: Whisper."""

    runtime: Runtime
    adapter: AttentionAdapter
    encoded: Encoded
    req: Any
    family: Family  # the model's family (models/families/): its `view` names the answer
    layers: list[int]
    heads: list[int]
    interventions: tuple
    long: bool  # the runs keep an atlas, not P (docs/science.md §10)
    sources: HeadRun  # patch sources and value grams in reach while the runs are made
    input_field: str = "text"  # the field a refusal of the input's size names
    cost_tokens: int = 0
    # the request's context (app/context.py), given by answer(): its client, deadline, cancel, progress, cache scope,
    # job and memory; after admit() its first missing run carries the cost check's estimate (estimate_s)
    ctx: RequestContext = EMPTY

    @property
    def weighting(self) -> str:
        return getattr(self.req, "weighting", "attention")

    @property
    def value_weighted(self) -> bool:
        return self.weighting == "value_norm"

    def plan(self) -> list[tuple[tuple, bool]]:
        """The model runs the request makes, as (interventions, record_scores)."""
        raise NotImplementedError

    def admit(self) -> None:
        """The 413s before any model run (the cost check; a job is accepted there)."""
        raise NotImplementedError

    def missing_runs(self) -> int:
        """The planned runs the result cache does not hold: only they cost model time."""
        return sum(not self._cached(ivs, scores) for ivs, scores in self.plan())

    def _cached(self, interventions: tuple, record_scores: bool) -> bool:
        return self.runtime.is_cached(self.adapter, self.encoded, interventions, record_scores, self.ctx)

    def run(self, interventions: tuple, record_scores: bool = False) -> AttentionResult:
        """One planned run for the request's context; the first that is not cached takes the cost check's estimate
        to the scheduler (refused at its turn when it no longer fits), the later ones belong to the same estimate."""
        ctx = self.ctx
        if ctx.estimate_s is not None and not self._cached(interventions, record_scores):
            self.ctx = ctx.with_(estimate_s=None)
        return self.runtime.run(self.adapter, self.encoded, interventions, record_scores, ctx)


@dataclass
class ComparedJob(AttentionJob):
    """A job whose `compare` runs the model again without the interventions and once more per extra sample, with
    work besides the runs (a long value-weighted overview) and a run budget of kept maps: the plain and the
    encoder–decoder jobs."""

    record_scores: bool = False
    run_maps: list[tuple[int, int, int, int]] = field(default_factory=list)  # (layers, heads, queries, keys) per stack
    extra: ExtraWork | None = None
    _extra_pending: bool = field(default=True, init=False, repr=False)  # the extra work not yet counted

    def plan(self) -> list[tuple[tuple, bool]]:
        """The run with the interventions, and with `compare` the run without them and one more per extra sample (the
        perturbations' noise re-seeded)."""
        samples = getattr(self.req, "samples", 1)
        sample_sets = [tuple(iv.with_seed_offset(s) for iv in self.interventions) for s in range(samples)]
        runs = [(sample_sets[0], self.record_scores)]
        if self.req.compare:
            runs += [((), False)] + [(sample, False) for sample in sample_sets[1:]]
        return runs

    def budget_adapter(self) -> AttentionAdapter | None:
        """The adapter check_run_budget sizes a long run's atlas with; None: every map counted as P."""
        return self.adapter

    def admit(self) -> None:
        """The 413s before any model run: what the runs would keep (check_run_budget), their in-flight memory, then
        their model time and the extra work with them (the cost estimate, app/costs.py; a job is accepted here), then
        the wait for memory beside the kept runs (app/memory.py). Runs already in the result cache cost nothing: a
        request served from them (a head or mode change after a long first view) is never refused; its extra work
        alone is checked when it is done (check_extra)."""
        runtime, adapter = self.runtime, self.adapter
        missing = self.missing_runs()
        if not missing:
            return
        check_run_budget(runtime, self.run_maps, self.input_field, self.budget_adapter())
        memory = RequestPeak(runtime, adapter, self.cost_tokens, missing, self.record_scores, self.input_field)
        seconds = check_request_cost(adapter, runtime, self.cost_tokens, missing, len(self.interventions),
                                     input_field=self.input_field, extra=self.extra, ctx=self.ctx)
        self._extra_pending = False  # counted with the runs
        self.ctx = self.ctx.with_(estimate_s=seconds)
        memory.reserve(self.ctx)

    def check_extra(self) -> None:
        """Just before the extra work, when admit() did not count it (every run was cached): 413 naming its field
        when it alone would not finish in time (app/costs.check_extra_cost)."""
        if self._extra_pending and self.extra is not None:
            self._extra_pending = False
            check_extra_cost(self.adapter, self.runtime, self.extra, self.ctx)

    def runs(self, effect_of: Callable[[AttentionResult, AttentionResult], dict[str, Any]]
             ) -> tuple[AttentionResult, AttentionResult | None, dict[str, Any] | None]:
        """The planned runs: the run with the interventions, and with `compare` the run without them and the effect
        of each sample (effect_of(base, run)), merged as mean ± std when there are several. Each run first checks that
        the client is still there (a client that left, or a shutdown, stops the work here). Made inside
        head_run(self.sources) (views.answer)."""
        (first, first_scores), *others = self.plan()
        check_cancelled(self.ctx)
        result = self.run(first, first_scores)
        if not self.req.compare:
            return result, None, None
        check_cancelled(self.ctx)
        base = self.run(*others[0])
        effects = [effect_of(base, result)]
        for sample, scores in others[1:]:
            check_cancelled(self.ctx)
            effects.append(effect_of(base, self.run(sample, scores)))
        # both runs pinned from now, when they are answered: the first run's pin began when it was put, and a long
        # second run could outlast it (a 4,096-token compare's run_id answered 404 right after the compare)
        for kept in (result, base):
            if kept.run_id is not None:
                self.runtime.get_run(kept.run_id)
        return result, base, effects[0] if len(effects) == 1 else _merge_samples(effects)


@dataclass
class PlainJob(ComparedJob):
    """An encoder's, decoder LM's or ViT's request: one stack of T × T maps, its query rows, and the fields the page
    asking shows besides the shared ones."""

    queries: list[int] = field(default_factory=list)
    requested_queries: list[int] | None = None  # a request's own `queries` (images): only those rows are answered
    # (result) → what the page shows besides (a text's mean distance, an image's rollout and grid)
    page_fields: Callable[[AttentionResult], dict[str, Any]] | None = None


@dataclass
class Seq2SeqJob(ComparedJob):
    """An encoder–decoder's request: attention per kind (encoder M × M, decoder N × N, cross N × M)."""

    def budget_adapter(self) -> AttentionAdapter | None:
        return self.adapter if self.long else None  # a short run's every kind is kept as P


@dataclass
class SpeechJob(AttentionJob):
    """A speech request on Whisper: the run without interventions (its words and alignment) and the one with them;
    the encoder overview's layers and the decoded clip."""

    encoder_layers: list[int] = field(default_factory=list)  # the encoder overview's layers
    audio: Any = None  # the decoded clip

    def plan(self) -> list[tuple[tuple, bool]]:
        return [((), False)] + ([(self.interventions, False)] if self.interventions else [])

    def admit(self) -> None:
        """The runs' model time, as runtime.run counts it: 413 naming audio_id over the limit (a job is accepted
        here). Runs already in the result cache cost nothing."""
        missing = self.missing_runs()
        if not missing:
            return
        n = len(self.encoded.tokens)
        macs = missing * forward_macs(model_shape(self.adapter), n, n, len(self.interventions))
        seconds = check_work_cost(self.adapter, self.runtime, macs, missing, "audio_id",
                                  f"{missing} Whisper run{'s' if missing > 1 else ''}", self.ctx)
        self.ctx = self.ctx.with_(estimate_s=seconds)

    def runs(self, effect_of: None = None) -> tuple[AttentionResult, AttentionResult, None]:
        """(the run with the interventions, the run without them, None); made inside head_run(self.sources)."""
        check_cancelled(self.ctx)
        base = self.run(())
        return (self.run(self.interventions) if self.interventions else base), base, None


def _merge_samples(effects: list[dict[str, Any]]) -> dict[str, Any]:
    merged = mean_and_std([{k: v for k, v in e.items() if k != "output"} for e in effects])
    merged["output"] = mean_and_std([e["output"] for e in effects])
    merged["samples"] = len(effects)
    return merged


def _refuse_without_w_o(adapter: AttentionAdapter, req) -> None:
    if getattr(req, "weighting", "attention") == "value_norm" and value_grams(adapter) is None:
        raise field_error(("weighting",), f"value_norm: no output projection W_O found in model {adapter.info.id}")


# ---- one builder per kind of job, picked by the model's family -------------------------------------------------
@dataclass(frozen=True)
class PageInput:
    """What the page asking gives its job besides the request: the fields it shows besides the shared ones (text: the
    mean distance; image: geometry, rollout, predictions), read by a plain job's view, and the speech page's decoded
    clip, kept by a speech job. A job that does not use one leaves it."""

    fields: Callable[[AttentionResult], dict[str, Any]] | None = None
    audio: Any = None


def plain_job(runtime: Runtime, family: Family, adapter: AttentionAdapter, encoded: Encoded, req,
              page: PageInput) -> PlainJob:
    """An encoder's, decoder LM's or ViT's request (text and image routes), with the patch sources its interventions
    name (app/patch_sources.py: 404/410 for a run not kept) and value norms kept by every run; `page.fields(result)`
    adds what the page shows besides (a text's mean distance, an image's rollout and grid). A request with a
    `queries` field (images) gets only those query rows."""
    sources = request_sources(runtime, adapter, req.interventions, value_norms=True)
    info, limits = adapter.info, runtime.settings
    n_tokens = len(encoded.tokens)
    layers = check_indices(req.layers, info.layers, ("layers",), "layer")
    heads = check_indices(req.heads, info.heads, ("heads",), "head")
    requested_queries = getattr(req, "queries", None)
    queries = check_indices(requested_queries, n_tokens, ("queries",), "query token")
    with head_run(sources):  # patch_heads items are checked against their sources' token counts
        interventions = engine_interventions(req, adapter, n_tokens)
    _refuse_without_w_o(adapter, req)
    long = n_tokens > adapter.full_map_tokens
    record_scores = req.include_scores and not long

    maps = 1 + int(record_scores) + int(req.compare and req.include_base)  # P, Ŝ, P without interventions
    numbers = len(layers) * len(heads) * len(queries) * n_tokens * maps
    if long:  # the overview (with compare the base run's too) and received instead of P, and any requested query rows
        blocks = min(limits.overview_blocks, n_tokens)
        numbers = len(layers) * len(heads) * (blocks * blocks * (1 + int(req.compare)) + n_tokens
                                              + (0 if requested_queries is None else len(queries) * n_tokens))
    counts = {"layers": len(layers), "heads": len(heads), **({} if requested_queries is None else {"queries": len(queries)})}
    check_response_numbers(limits, numbers, counts, "ask for fewer layers/heads/queries (fields 'layers', 'heads', "
                           "'queries') or turn off include_scores")
    extra = None
    if req.weighting == "value_norm" and long:  # one pass over the layers, reported as progress
        extra = ExtraWork(OVERVIEW_FIELD, OVERVIEW_WHAT, value_overview_macs(model_shape(adapter), n_tokens, n_tokens), 1)
    return PlainJob(
        runtime, adapter, encoded, req, family, layers, heads, interventions, long, sources, queries=queries,
        requested_queries=requested_queries, record_scores=record_scores,
        input_field="text" if info.kind == "text" else "image_size",
        run_maps=[(len(adapter.layer_of), info.heads, n_tokens, n_tokens)], cost_tokens=n_tokens, extra=extra,
        page_fields=page.fields)


def seq2seq_job(runtime: Runtime, family: Family, adapter, encoded: Encoded, req, page: PageInput) -> Seq2SeqJob:
    """An encoder–decoder's request: attention per kind (encoder M × M, decoder N × N, cross N × M); its view shows
    no page fields."""
    _refuse_without_w_o(adapter, req)
    info, limits = adapter.info, runtime.settings
    if req.include_scores:
        raise field_error(("include_scores",), "scores are not offered for encoder–decoder models yet")
    n_source, n_target = len(encoded.tokens), len(encoded.extra["target_tokens"])
    layers = check_indices(req.layers, min(info.layers, info.decoder_layers), ("layers",), "layer")
    heads = check_indices(req.heads, min(info.heads, info.decoder_heads), ("heads",), "head")
    interventions = seq2seq_interventions(req, adapter, n_source, n_target)
    shapes = {"encoder": (n_source, n_source), "decoder": (n_target, n_target), "cross": (n_target, n_source)}
    long = max(n_source, n_target) > adapter.full_map_tokens  # every kind runs blockwise, keeping an atlas (§10)
    numbers = sum(len(layers) * len(heads) * q * k for q, k in shapes.values()) * (1 + int(req.compare and req.include_base))
    if long:  # per kind its overview and received instead of P
        blocks = limits.overview_blocks
        numbers = sum(len(layers) * len(heads) * (min(blocks, q) * min(blocks, k) + k) for q, k in shapes.values())
    check_response_numbers(limits, numbers, {"layers": len(layers), "heads": len(heads)}, "ask for fewer layers/heads")
    extra = None
    if req.weighting == "value_norm" and long:  # every kind's overview; the kinds' overviews report no progress
        shape = model_shape(adapter)
        macs = sum(value_overview_macs(shape, q, k, kind_layers) for q, k, kind_layers in (
            (n_source, n_source, info.layers), (n_target, n_target, info.decoder_layers),
            (n_target, n_source, info.decoder_layers)))
        extra = ExtraWork(OVERVIEW_FIELD, OVERVIEW_WHAT, macs, 0)
    return Seq2SeqJob(
        runtime, adapter, encoded, req, family, layers, heads, interventions, long,
        HeadRun(value_grams=value_grams(adapter)), input_field="text",
        # a long run keeps q̂/k̂ and summaries (a short one's P goes to the host)
        run_maps=[(info.layers, info.heads, *shapes["encoder"]), (info.decoder_layers, info.decoder_heads, *shapes["decoder"]),
                  (info.decoder_layers, info.decoder_heads, *shapes["cross"])],
        cost_tokens=n_source + n_target, extra=extra)


def whisper_job(runtime: Runtime, family: Family, adapter, encoded: Encoded, req, page: PageInput) -> SpeechJob:
    """A speech request on Whisper: decoder/cross layers and heads, the encoder overview's layers, the kinds asked;
    `page.audio` the decoded clip."""
    info = adapter.info
    n = len(encoded.tokens)
    layers = check_indices(req.layers, info.decoder_layers, ("layers",), "layer")
    heads = check_indices(req.heads, info.heads, ("heads",), "head")
    encoder_layers = check_indices(req.encoder_layers, info.encoder_layers, ("encoder_layers",), "encoder layer")
    interventions = whisper_interventions(req, adapter, n)
    numbers = len(layers) * len(heads) * n * ((1500 if "cross" in req.kinds else 0) + (n if "decoder" in req.kinds else 0))
    check_response_numbers(runtime.settings, numbers, {"layers": len(layers), "heads": len(heads), "kinds": len(req.kinds)},
                           "ask for fewer layers/heads/kinds")
    _refuse_without_w_o(adapter, req)
    # every run keeps its value norms: windows/rows can be value-weighted
    return SpeechJob(runtime, adapter, encoded, req, family, layers, heads, interventions, False,
                     HeadRun(value_grams=value_grams(adapter)), input_field="audio_id", cost_tokens=n,
                     encoder_layers=encoder_layers, audio=page.audio)


# the app's side of a model family's `job` (models/families/: Family.job names a key here; models/ cannot import the
# app): the builder of each kind of job
JOB_BUILDERS: dict[str, Callable[[Runtime, Family, Any, Encoded, Any, PageInput], AttentionJob]] = {
    "plain": plain_job, "seq2seq": seq2seq_job, "whisper": whisper_job}


def model_family(runtime: Runtime, model_id: str) -> Family:
    """The family the runtime's catalog serves `model_id` with (its ModelSpec.family, models/registry.py)."""
    return family_named(runtime.specs[model_id].family)


def build_job(runtime: Runtime, adapter: AttentionAdapter, encoded: Encoded, req,
              page: PageInput = PageInput()) -> AttentionJob:
    """The request checked once, before any work, by the job its model's family names (Family.job): every 422 and
    the response-size 413 raised here."""
    family = model_family(runtime, adapter.info.id)
    return JOB_BUILDERS[family.job](runtime, family, adapter, encoded, req, page)

