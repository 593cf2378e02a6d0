"""One view per family, each written once: the response of a checked job (app/pipeline/job.py) from its runs and its
maps (app/pipeline/maps.py, the weighting already applied). `answer(job, ctx)` is the whole pipeline after the route:
admit (the cost check), run, maps, view."""
from __future__ import annotations

import math
import time
from typing import Any

import torch

from app.attention import read_to_host, threads_on_this_thread
from app.context import RequestContext
from app.lifecycle import check_cancelled
from app.pipeline.job import AttentionJob, PlainJob, Seq2SeqJob, SpeechJob
from app.pipeline.maps import KindMaps, LongMaps, ShortMaps, SpeechMaps
from app.runtime import PerRuntime, Runtime
from models.adapters.base import AttentionResult, Encoded, pending_dead_rows, settle_dead_rows
from models.adapters.seq2seq import KINDS
from models.adapters.whisper import POSITION_S
from models.effects import attention_tv, hidden_cosine
from models.head_ops import head_run
from models.interventions import row_entropy
from models.lru import BoundedLRU
from models.summaries import mean_token_distance, sink_mass

THREADS_DECIDED_S = 1.0  # a run's thread count stands for its first view's tensor work this long after the run


def answer(job: AttentionJob, ctx: RequestContext) -> dict[str, Any]:
    """The job's response for the request `ctx` (app/context.py: a plain request's, or its job's in the job's
    thread): its cost checked (a job is accepted there), its runs made, its family's view (Family.view → VIEWS);
    with the request's patch sources and value grams in reach throughout (runs keep their value norms; norms a run did
    not keep are recorded under the same patches). The planned runs are held in the run store meanwhile: a kept base that admit() counted
    as done is never dropped before the compare reads it (nor the intervened run before the base is made)."""
    job.ctx = ctx  # every later step (cost check, memory, runs, maps) reads the request's state from here
    with head_run(job.sources), job.runtime.holding_runs(job.adapter, job.encoded, job.plan(), ctx):
        job.admit()
        return VIEWS[job.family.view](job)


def _elapsed(job: AttentionJob, result: AttentionResult) -> float | None:
    # a cache oracle otherwise: timings only where the settings expose them
    return getattr(result, "elapsed_s", None) if job.runtime.settings.expose_timings else None


# ---- plain: encoders, decoder LMs, ViTs ---------------------------------------------------------------------------
def _plain_effect(job: PlainJob, base: AttentionResult, run: AttentionResult) -> dict[str, Any]:
    adapter, encoded = job.adapter, job.encoded
    if run.kept_attention is None or base.kept_attention is None:  # long inputs keep no P: the TV distance would re-run it all
        return {"hidden_cosine": hidden_cosine(run.hidden_states, base.hidden_states).tolist(),
                "output": adapter.output_effect(base, run, encoded)}
    after = run.kept_attention[job.layers][:, job.heads]  # (l, h, T, T), on the runs' device: only the distances are read
    before = base.kept_attention[job.layers][:, job.heads]
    return {
        "attention_tv": attention_tv(after, before).tolist(),
        "attention_tv_all": attention_tv(run.kept_attention, base.kept_attention).tolist(),  # (L, H): every head, cheap
        "hidden_cosine": hidden_cosine(run.hidden_states, base.hidden_states).tolist(),
        "output": adapter.output_effect(base, run, encoded),
    }


def plain_view(job: PlainJob) -> dict[str, Any]:
    """Slices of P or of the value-weighted maps (and Ŝ), effects, summaries of every head; a long input's overview
    instead of P (docs/science.md §10)."""
    result, base, effect = job.runs(lambda base, run: _plain_effect(job, base, run))
    n_tokens = len(job.encoded.tokens)
    truncated = [f"input truncated to {n_tokens} tokens (the model's max_tokens)"] if job.encoded.truncated else []
    if result.is_long:
        response = long_response(job, result, LongMaps(job, result, base), effect, list(result.warnings) + truncated)
        response["base_run_id"] = base.run_id if base is not None else None  # its windows, and /window's `minus`
        response["elapsed_s"] = _elapsed(job, result)
        if job.page_fields is not None:
            response.update(job.page_fields(result))
    else:
        response = short_response(job, result, ShortMaps(job, result, base))
        # after short_response: a short run's dead-row warnings come with its one read
        response.update(effect=effect, warnings=list(result.warnings) + truncated, elapsed_s=_elapsed(job, result))
    if job.value_weighted:
        response["weighting"] = "value_norm"
    return response


def short_response(job: PlainJob, result: AttentionResult, maps: ShortMaps) -> dict[str, Any]:
    """The first view of a short run (P kept whole, on the device it ran on: GPU memory on a GPU): the maps' fields,
    summaries of every head, the output panel, and the page's fields.

    Everything taken from the run's device tensors is formed there, batched over every layer and head (the thumbnails
    one pooled product over the stacked (L, H, T, T) maps), and read to the host in ONE copy (read_to_host), with the
    run's entropy (kept on its device by the run) and the output panel's tensors where the adapter forms them on the
    device (adapter.output_parts: a decoder LM's top-k); other adapters' panels (output_summary) are read on their
    own. A page field returned as a tensor (the text route's mean distance) joins that copy and is sent as nested
    lists. On a GPU each separate read is a synchronisation and a copy of its own, and at 128-512 tokens the first
    view is bound by them and by kernel launches, not by arithmetic (benchmarks/results/gpu_long.md, "Response
    building (CPU proxy)")."""
    adapter, encoded = job.adapter, job.encoded
    kept = result.kept_attention  # (L, H, T, T) on the run's device
    with threads_on_this_thread(response_threads(job, result)):
        host, page, tensor_fields, output_parts = _read_first_view(job, result, maps, kept)
    if "dead_rows" in host:
        settle_dead_rows(result, host["dead_rows"])
    if "entropy" in host:
        result.derived["entropy"] = host["entropy"].astype("float64").tolist()
    page.update({name: host[f"page.{name}"].tolist() for name in tensor_fields})

    info = adapter.info
    response: dict[str, Any] = {
        "model": info.id, "tokens": encoded.tokens, "truncated": encoded.truncated, "layers": job.layers,
        "heads": job.heads, "native_beta": info.native_beta,
        **maps.fields(host),  # attention, scores, base_attention, received, thumbnails
        "entropy": result.derived["entropy"],  # (L, H): every head
        "sink_mass": host["sink_mass"].astype("float64").tolist(),  # (L, H): every head
        "output": adapter.output_summary(result, encoded) if output_parts is None else
        output_parts.build({name: host[f"output.{name}"] for name in output_parts.tensors}),
        "effect": None, "warnings": [], "elapsed_s": None, "run_id": result.run_id, "overview": None,
    }
    if job.requested_queries is not None:
        response["queries"] = job.queries
    response.update(page)
    return response


def response_threads(job: PlainJob, result: AttentionResult) -> int:
    """Torch threads for the first view's tensor work on a CPU (0: leave them): as many as the run itself would get
    now (app/runtime.py Runtime.threads_wanted): one for inputs up to single_thread_max_tokens, else one per core that other
    processes leave free (app/costs.py). This work runs after the model lock is let go, on the request's thread; at the
    process's default count its dozen parallel regions each waited for a second core that other processes held (2
    ms on one thread, 69 ms on two beside a load of 4: benchmarks/results/first_view.md, 2026-11-29).
    A run made under THREADS_DECIDED_S ago gives its own count: asking again read /proc for ~0.3 ms a fresh view
    (the machine's runnable threads, then this process's, since torch's helper thread still spins after the forward)."""
    kept = result.kept_attention
    if kept.device.type != "cpu" or job.runtime is None:
        return 0
    decided = getattr(result, "threads_decided", None)  # (threads, monotonic time) of its run: app/runtime.py
    if decided is not None and time.monotonic() - decided[1] < THREADS_DECIDED_S:
        return decided[0]
    return job.runtime.threads_wanted(kept.shape[-1])


def _read_first_view(job: PlainJob, result: AttentionResult, maps: ShortMaps, kept: torch.Tensor
                     ) -> tuple[dict[str, Any], dict[str, Any], list[str], Any]:
    """short_response's tensors, formed on the run's device and read to the host in one copy; with the page's
    fields, the names of those among them that were tensors, and the adapter's output parts."""
    adapter, encoded = job.adapter, job.encoded
    device_parts = maps.device_parts()  # what is read to the host, in one copy
    entropy = result.derived.get("entropy")  # the run's own, taken during its forward: (L, H) on its device until read
    if entropy is None:
        entropy = row_entropy(kept).mean(dim=-1)  # (L, H)
    if isinstance(entropy, torch.Tensor):
        device_parts["entropy"] = entropy
    device_parts["sink_mass"] = sink_mass(kept)  # (L, H): every head's mean P[i, 0]
    page = job.page_fields(result) if job.page_fields is not None else {}
    tensor_fields = [name for name, value in page.items() if isinstance(value, torch.Tensor)]
    device_parts.update({f"page.{name}": page[name] for name in tensor_fields})
    output_parts = adapter.output_parts(result, encoded)  # a decoder LM's next-token top-k, formed on the device
    if output_parts is not None:
        device_parts.update({f"output.{name}": tensor for name, tensor in output_parts.tensors.items()})
    dead_rows = pending_dead_rows(result)  # (L, H) counts behind the run's warnings, until they are read
    if dead_rows is not None:
        device_parts["dead_rows"] = dead_rows
    return read_to_host(device_parts), page, tensor_fields, output_parts  # the one device → host copy


def long_response(job: PlainJob, result: AttentionResult, maps: LongMaps, effect: dict[str, Any] | None,
                  warnings: list[str]) -> dict[str, Any]:
    """The first view of a long input (over full_map_tokens): no P but its overview (B × B blocks, the mean of P
    over each), received, every head's entropy, distance and thumbnails; exact windows come from
    POST /api/runs/{run_id}/window (docs/science.md §10)."""
    adapter, req = job.adapter, job.req
    if effect is not None:
        effect = {**effect, "attention_tv": None, "attention_tv_all": None}
        warnings.append(f"effect.attention_tv is not computed for inputs over full_map_tokens={adapter.full_map_tokens:,} "
                        "(the runs keep no maps); hidden_cosine and the output change are")
    if req.compare and req.include_base:
        warnings.append("base_attention is not sent for long inputs: ask the base run's windows instead (base_run_id)")
    if req.include_scores:
        warnings.append(f"scores are not sent for inputs over full_map_tokens={adapter.full_map_tokens:,}: they come by "
                        "window (POST /api/runs/{run_id}/window with include_scores)")
    response: dict[str, Any] = {
        "model": adapter.info.id, "tokens": job.encoded.tokens, "truncated": job.encoded.truncated,
        "layers": job.layers, "heads": job.heads, "native_beta": adapter.info.native_beta, "run_id": result.run_id,
        "scores": None, "base_attention": None,
        **maps.fields(),  # attention (query rows), overview, base_overview, received, thumbnails
        "entropy": result.derived["entropy"],
        "sink_mass": result.atlas.sink_mass().double().tolist(),  # (L, H): every head's mean P[i, 0], from received
        "output": adapter.output_summary(result, job.encoded),
        "effect": effect, "warnings": warnings, "full_map_tokens": adapter.full_map_tokens, "elapsed_s": None,
    }
    if job.requested_queries is not None:
        response["queries"] = job.queries
    return response


def text_fields(result: AttentionResult) -> dict:
    """Text-only summaries: mean attention distance in tokens for every head (docs/science.md §6); a long input's
    was taken block by block during the run (docs/science.md §10). A short run's is left on the run's device, (L, H):
    short_response below reads it with the rest of the first view in one copy."""
    if result.is_long:
        return {"mean_distance": result.atlas.mean_distance().tolist()}
    return {"mean_distance": result.summary("mean_distance", lambda: mean_token_distance(result.kept_attention))}


# ---- encoder–decoders: per kind -----------------------------------------------------------------------------------
def seq2seq_view(job: Seq2SeqJob) -> dict[str, Any]:
    """Attention, entropy and effects per kind (encoder M × M, decoder N × N, cross N × M) for the requested
    layers/heads, the target tokens and their probabilities; a long run's overview and received per kind."""
    adapter, encoded, req = job.adapter, job.encoded, job.req
    layers, heads = job.layers, job.heads

    def effect_of(base: AttentionResult, run: AttentionResult) -> dict[str, Any]:
        return {
            "attention_tv": None if job.long else {  # long runs keep no maps
                kind: attention_tv(run.by_kind[kind][layers][:, heads], base.by_kind[kind][layers][:, heads]).tolist()
                for kind in KINDS},
            "hidden_cosine": hidden_cosine(run.hidden_states, base.hidden_states).tolist(),
            "output": adapter.output_effect(base, run, encoded),
        }

    result, base, effect = job.runs(effect_of)
    maps = KindMaps(job, result, base)
    warnings = list(result.warnings)
    if encoded.truncated:
        warnings.append(f"source truncated to {len(encoded.tokens)} tokens (the model's max_tokens)")
    response: dict[str, Any] = {
        "model": adapter.info.id, "tokens": encoded.tokens, "target_tokens": encoded.extra["target_tokens"],
        "truncated": encoded.truncated, "layers": layers, "heads": heads, "native_beta": adapter.info.native_beta,
        "kinds": list(KINDS), "scores": None, "entropy": result.derived["entropy"],
        "sink_mass": kind_sink_mass(adapter, result),
        "output": adapter.output_summary(result, encoded), "effect": effect, "warnings": warnings,
        "run_id": result.run_id,
    }
    if result.is_long:  # exact windows of any kind from POST /api/runs/{run_id}/window with `kind`
        if effect is not None:
            warnings.append(f"effect.attention_tv is not computed for inputs over full_map_tokens="
                            f"{adapter.full_map_tokens:,} (the runs keep no maps); hidden_cosine and the output change are")
        if req.compare and req.include_base:
            warnings.append("base_attention is not sent for long inputs: ask the base run's windows instead (base_run_id)")
        overview, received = maps.overview()
        response.update(attention=None, base_attention=None, full_map_tokens=adapter.full_map_tokens,
                        overview=overview, received=received,
                        base_run_id=base.run_id if base is not None else None)  # for /window's `minus` (P̂ − P)
    else:
        response.update(attention=maps.slices(result),
                        base_attention=maps.slices(base) if base is not None and req.include_base else None)
    if job.value_weighted:
        response["weighting"] = "value_norm"
    return response


def kind_sink_mass(adapter, result: AttentionResult) -> dict[str, list]:
    """{kind: [L][H]} mean P[i, 0] over each kind's rows (its first key: the first source token or audio frame for
    cross-attention): from the kept maps of a short run, from each layer's `received` of key 0 of a long one."""
    if result.by_kind is not None:
        return {kind: sink_mass(maps).double().tolist() for kind, maps in result.by_kind.items()}
    summaries = result.atlas.summaries if result.atlas is not None else {}
    return {kind: torch.stack([summaries[g].received[:, 0] for g in layers]).double().cpu().tolist()
            for kind, layers in adapter.kind_layers.items() if layers and all(g in summaries for g in layers)}


# ---- Whisper ------------------------------------------------------------------------------------------------------
# greedy transcripts with interventions, per runtime (each app's own, bounded by its result_cache_items) and
# (client scope, model, audio, interventions): a re-view needs no new decoding; with result_cache_scope="client" a
# client never reads another's, as with the result cache (app/runtime.py)
transcript_cache = PerRuntime(lambda runtime: BoundedLRU(runtime.settings.result_cache_items))


def transcript(runtime: Runtime, adapter, encoded: Encoded, interventions: tuple,
               ctx: RequestContext) -> tuple[list[int], list[float]]:
    """The greedy transcript (ids, probabilities) of a clip with the interventions active, decoded once per cache key
    (the request `ctx`'s cache scope)."""
    cache = transcript_cache(runtime)
    key = (ctx.cache_scope, adapter.info.id, encoded.key, interventions)
    value = cache.get(key)
    if value is None:
        with runtime.admitted(ctx=ctx):
            value = adapter.transcribe(encoded.inputs["input_features"], interventions, prompt=encoded.extra["prompt"])
        cache.put(key, value)
    return value


def speech_view(job: SpeechJob) -> dict[str, Any]:
    """Whisper's attention on a clip: the decoder tokens (prompt included) and the transcript; the maps of the
    requested kinds; each target token's probability (teacher-forced); words with times from the alignment heads and
    the heads ranked by alignment (both from the run without interventions). With `compare`: the text before/after
    (greedy with the interventions active, `transcript`), per-token probability change and KL, attention TV per
    kind."""
    adapter, encoded, req, audio = job.adapter, job.encoded, job.req, job.audio
    info = adapter.info
    n_positions = min(1500, math.ceil(audio.samples.size / (POSITION_S * 16000)))  # the positions the clip fills
    result, base, _ = job.runs(None)
    attention = SpeechMaps(job, result).attention(n_positions)
    effect = None
    warnings = list(result.warnings)
    interventions = job.interventions
    if req.compare:
        check_cancelled(job.ctx)
        after_ids, after_probs = transcript(job.runtime, adapter, encoded, interventions, job.ctx) if interventions else (
            encoded.extra["labels"], base.output["label_log_probs"].exp().tolist())
        effect = {
            "attention_tv": {kind: attention_tv(result.by_kind[kind], base.by_kind[kind]).tolist()
                             for kind in ("cross", "decoder")},
            "output": {"text_before": encoded.extra["text"], "text_after": adapter.decode(after_ids),
                       "tokens_after": [{"token": adapter.token_text(t), "prob": p} for t, p in zip(after_ids, after_probs)],
                       **adapter.output_effect(base, result, encoded)},
        }
        if after_ids and after_ids[-1] != adapter.eot:
            warnings.append(f"the transcript with interventions stopped at max_transcript_tokens={adapter.max_new_tokens}")
    if encoded.extra["labels"] and len(encoded.extra["labels"]) > adapter.max_new_tokens:
        warnings.append(f"the transcript stopped at max_transcript_tokens={adapter.max_new_tokens}")
    return {
        "model": info.id, "audio_id": req.audio_id, "run_id": result.run_id, "tokens": encoded.tokens, "positions": 1500,
        "clip_positions": n_positions, "frame_s": POSITION_S, "duration_s": round(audio.duration_s, 4),
        "transcript": encoded.extra["text"], "task": encoded.extra["task"], "language": encoded.extra["language"],
        "language_prob": encoded.extra["language_prob"], "languages": info.languages,
        "shape": {"encoder_layers": info.encoder_layers, "decoder_layers": info.decoder_layers, "heads": info.heads},
        "layers": job.layers, "heads": job.heads, "kinds": req.kinds, "weighting": req.weighting,
        "native_beta": info.native_beta, "attention": attention, "entropy": result.derived["entropy"],
        "sink_mass": kind_sink_mass(adapter, result),
        "output": adapter.output_summary(result, encoded), "effect": effect,
        "words": adapter.word_times(base, encoded), "alignment": adapter.alignment_ranking(base, encoded),
        "warnings": warnings,
    }


# the app's side of a model family's `view` (models/families/: Family.view names a key here; models/ cannot import the
# app): the answer of each kind of job (app/pipeline/job.py JOB_BUILDERS)
VIEWS = {"plain": plain_view, "seq2seq": seq2seq_view, "whisper": speech_view}
