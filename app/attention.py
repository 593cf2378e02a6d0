"""Building an attention response (text or image) from a request, an adapter and an encoded input."""
from __future__ import annotations

import base64
import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from fastapi import HTTPException
from pydantic import BaseModel

from app.costs import check_request_cost, request_peak_bytes
from app.encoding import fast_json, tensor_field  # noqa: F401  (fast_json: routes import it from here)
from app.errors import field_error
from app.interventions import check_indices, engine_interventions, seq2seq_interventions
from app.lifecycle import check_cancelled
from app.runtime import Runtime, request_deadline
from app.schemas import AttentionRequestBase
from app.settings import Settings
from models.adapters.base import AttentionAdapter, AttentionResult, Encoded, pending_dead_rows, settle_dead_rows
from models.adapters.seq2seq import KINDS, Seq2SeqAdapter
from models.effects import attention_tv, hidden_cosine, mean_and_std
from models.atlas import full_rows, run_bytes
from models.interventions import row_entropy
from models.summaries import sink_mass


# Request fields that hold text, each at most max_text_chars characters.
TEXT_FIELDS = ("text", "text_pair", "target", "clean", "corrupt")


def check_request_limits(limits: Settings, req: BaseModel) -> None:
    """The settings' limits on what one request may ask (docs/configuration.md), in one place: every route calls it
    first, before any model loads or runs (text attention, generate, image, speech attention and transcript,
    patching, lens, faithfulness). A 422 naming the field and the setting. What depends on the model or the input
    (indices, tokens, response size, run bytes, cost) is checked once they are known."""
    for name in TEXT_FIELDS:
        value = getattr(req, name, None)
        if isinstance(value, str) and len(value) > limits.max_text_chars:
            raise field_error((name,), f"{name} has {len(value):,} characters; the limit is {limits.max_text_chars:,} "
                              "(max_text_chars)")
    new_tokens = getattr(req, "max_new_tokens", None)
    if new_tokens is not None and new_tokens > limits.max_new_tokens:
        raise field_error(("max_new_tokens",), f"max_new_tokens={new_tokens}; the limit is {limits.max_new_tokens} "
                          "(max_new_tokens)")
    interventions = getattr(req, "interventions", ())
    if len(interventions) > limits.max_interventions:
        raise field_error(("interventions",), f"{len(interventions)} interventions; the limit is "
                          f"{limits.max_interventions} (max_interventions)")
    samples = getattr(req, "samples", 1)
    if samples > limits.max_samples:
        raise field_error(("samples",), f"samples={samples}; the limit is {limits.max_samples} (max_samples)")
    thumbnail = getattr(req, "thumbnail_size", None)
    if thumbnail is not None and thumbnail > limits.max_thumbnail_size:
        raise field_error(("thumbnail_size",), f"thumbnail_size={thumbnail}; the limit is {limits.max_thumbnail_size} "
                          "(max_thumbnail_size)")


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


def _effect(adapter: AttentionAdapter, base: AttentionResult, run: AttentionResult, encoded: Encoded,
            layers: list[int], heads: list[int]) -> dict[str, Any]:
    if run.kept_attention is None or base.kept_attention is None:  # long inputs keep no P: the TV distance would re-run it all
        return {"hidden_cosine": hidden_cosine(run.hidden_states, base.hidden_states).tolist(),
                "output": adapter.output_effect(base, run, encoded)}
    after = run.kept_attention[layers][:, heads]  # (l, h, T, T), on the runs' device: only the distances are read
    before = base.kept_attention[layers][:, heads]
    return {
        "attention_tv": attention_tv(after, before).tolist(),
        "attention_tv_all": attention_tv(run.kept_attention, base.kept_attention).tolist(),  # (L, H): every head, cheap
        "hidden_cosine": hidden_cosine(run.hidden_states, base.hidden_states).tolist(),
        "output": adapter.output_effect(base, run, encoded),
    }


def _merge_samples(effects: list[dict[str, Any]]) -> dict[str, Any]:
    merged = mean_and_std([{k: v for k, v in e.items() if k != "output"} for e in effects])
    merged["output"] = mean_and_std([e["output"] for e in effects])
    merged["samples"] = len(effects)
    return merged


def check_response_numbers(limits: Settings, numbers: int, counts: dict[str, int], ask: str) -> None:
    """413 before any work when the response would hold more than max_response_numbers numbers, naming first the
    request field among `counts` ({field: entries asked}, e.g. layers and heads) with the most entries (the first
    on a tie); `ask` says how to ask for less. Every route's refusal has this one form."""
    cap = limits.max_response_numbers
    if numbers > cap:
        field = max(counts, key=counts.__getitem__)
        raise HTTPException(413, detail=f"{field}: the response would hold {numbers:,} numbers, over the cap "
                            f"max_response_numbers={cap:,}; {ask}")


def _request_runs(req: AttentionRequestBase, interventions: tuple, record_scores: bool) -> list[tuple[tuple, bool]]:
    """The model runs a request makes, as (interventions, record_scores): the run with the interventions, and with
    `compare` the run without them and one more per extra sample (the perturbations' noise re-seeded)."""
    sample_sets = [tuple(iv.with_seed_offset(s) for iv in interventions) for s in range(req.samples)]
    runs = [(sample_sets[0], record_scores)]
    if req.compare:
        runs += [((), False)] + [(sample, False) for sample in sample_sets[1:]]
    return runs


def _check_before_runs(runtime: Runtime, adapter: AttentionAdapter, encoded: Encoded, req: AttentionRequestBase,
                       interventions: tuple, record_scores: bool, maps: list[tuple[int, int, int, int]], n_tokens: int,
                       field: str, budget_adapter: AttentionAdapter | None) -> None:
    """The 413s before any model run, shared by every response builder: what the run would keep (check_run_budget,
    counted by `budget_adapter` as it is there) and its model time (the cost estimate, app/costs.py): refused now
    rather than minutes of work that would end in a 503 timeout. Runs already in the result cache cost nothing: a
    request served from them (a head or mode change after a long first view) is never refused."""
    missing = sum(not runtime.is_cached(adapter, encoded, ivs, scores)
                  for ivs, scores in _request_runs(req, interventions, record_scores))
    if not missing:
        return
    check_run_budget(runtime, maps, field, budget_adapter)
    # its in-flight peak must fit memory_budget_bytes at all (413), then its time (a job is accepted here), then it
    # waits for room beside the kept runs (app/memory.py)
    memory = RequestPeak(runtime, adapter, n_tokens, missing, record_scores, field)
    check_request_cost(adapter, runtime.settings, n_tokens, missing, len(interventions), input_field=field)
    memory.reserve()


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

    def reserve(self) -> None:
        self.runtime.memory.reserve(self.nbytes, self.field, self.what, request_deadline.get())


def _sample_runs(runtime: Runtime, adapter: AttentionAdapter, encoded: Encoded, req: AttentionRequestBase,
                 interventions: tuple, record_scores: bool,
                 effect_of: Callable[[AttentionResult, AttentionResult], dict[str, Any]],
                 ) -> tuple[AttentionResult, AttentionResult | None, dict[str, Any] | None]:
    """The run with the interventions, and with `compare` the run without them and the effect of each of the
    request's samples (the perturbations' noise re-seeded per sample; effect_of(base, run)), merged as mean ± std
    when there are several. Shared by every response builder; each model run first checks that the client is still
    there (a client that left, or a shutdown, stops the work here)."""
    (first, first_scores), *others = _request_runs(req, interventions, record_scores)
    check_cancelled()
    result = runtime.run(adapter, encoded, first, first_scores)
    if not req.compare:
        return result, None, None
    check_cancelled()
    base = runtime.run(adapter, encoded, *others[0])
    effects = [effect_of(base, result)]
    for sample, scores in others[1:]:
        check_cancelled()
        effects.append(effect_of(base, runtime.run(adapter, encoded, sample, scores)))
    # both runs pinned from now, when they are answered: the first run's pin began when it was put, and a long second
    # run could outlast it (a 4,096-token compare's run_id answered 404 right after the compare on a busy machine)
    for kept in (result, base):
        if kept.run_id is not None:
            runtime.get_run(kept.run_id)
    return result, base, effects[0] if len(effects) == 1 else _merge_samples(effects)


def build_attention_response(
    runtime: Runtime,
    adapter: AttentionAdapter,
    encoded: Encoded,
    req: AttentionRequestBase,
    family_fields: Callable[[AttentionResult], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The response shared by text and image: slices of P (and Ŝ), effects, summaries of every head.

    `family_fields(result)` adds what one model family shows besides (e.g. rollout and grid for images).
    A request with a `queries` field (images) gets only those query rows: [l][h][len(queries)][T].
    """
    info = adapter.info
    limits = runtime.settings  # the request's own limits were checked by its route (check_request_limits)
    n_tokens = len(encoded.tokens)
    layers = check_indices(req.layers, info.layers, ("layers",), "layer")
    heads = check_indices(req.heads, info.heads, ("heads",), "head")
    requested_queries = getattr(req, "queries", None)
    queries = check_indices(requested_queries, n_tokens, ("queries",), "query token")
    interventions = engine_interventions(req, adapter, n_tokens)
    long = n_tokens > adapter.full_map_tokens  # the run keeps an atlas, not P (docs/science.md §10)
    _check_before_runs(runtime, adapter, encoded, req, interventions, req.include_scores and not long,
                       [(len(adapter.layer_of), info.heads, n_tokens, n_tokens)],
                       n_tokens, "text" if info.kind == "text" else "image_size", adapter)

    maps = 1 + int(req.include_scores and not long) + int(req.compare and req.include_base)  # P, Ŝ, P without interventions
    numbers = len(layers) * len(heads) * len(queries) * n_tokens * maps
    if long:  # the overview (with compare the base run's too) and received instead of P, and any requested query rows
        blocks = min(limits.overview_blocks, n_tokens)
        numbers = len(layers) * len(heads) * (blocks * blocks * (1 + int(req.compare)) + n_tokens
                                              + (0 if requested_queries is None else len(queries) * n_tokens))
    counts = {"layers": len(layers), "heads": len(heads), **({} if requested_queries is None else {"queries": len(queries)})}
    check_response_numbers(limits, numbers, counts, "ask for fewer layers/heads/queries (fields 'layers', 'heads', "
                           "'queries') or turn off include_scores")

    result, base, effect = _sample_runs(runtime, adapter, encoded, req, interventions, req.include_scores and not long,
                                        lambda base, run: _effect(adapter, base, run, encoded, layers, heads))

    truncated = [f"input truncated to {n_tokens} tokens (the model's max_tokens)"] if encoded.truncated else []
    if result.is_long:
        warnings = list(result.warnings) + truncated
        response = _long_response(adapter, encoded, req, result, layers, heads, requested_queries, queries, effect, warnings)
        # the run without the interventions, kept too: its windows, and P̂ − P by /window's `minus`; its overview on the
        # same blocks (same tokens), so that the page can show the overview of P̂ − P (a block mean is linear in P)
        response["base_run_id"] = base.run_id if base is not None else None
        response["base_overview"] = (tensor_field(base.atlas.overview(layers, heads), req.encoding)  # (l, h, B, B)
                                     if base is not None and base.atlas is not None else None)
        response["elapsed_s"] = getattr(result, "elapsed_s", None) if limits.expose_timings else None
        if family_fields is not None:
            response.update(family_fields(result))
        return response
    response = short_response(adapter, encoded, req, result, base, layers, heads, requested_queries, queries, family_fields)
    # after short_response: a short run's dead-row warnings come with its one read
    response.update(effect=effect, warnings=list(result.warnings) + truncated,
                    elapsed_s=getattr(result, "elapsed_s", None) if limits.expose_timings else None)  # a cache oracle otherwise
    return response


def short_response(adapter: AttentionAdapter, encoded: Encoded, req: AttentionRequestBase, result: AttentionResult,
                   base: AttentionResult | None, layers: list[int], heads: list[int], requested_queries: list[int] | None,
                   queries: list[int], family_fields: Callable[[AttentionResult], dict[str, Any]] | None = None,
                   ) -> dict[str, Any]:
    """The first view of a short run (P kept whole, on the device it ran on: GPU memory on a GPU): slices of P (and Ŝ),
    received, thumbnails and summaries of every head, the output panel, and the family's fields.

    Everything taken from the run's device tensors is formed there, batched over every layer and head (the thumbnails
    one pooled product over the stacked (L, H, T, T) maps), and read to the host in ONE copy (read_to_host), with the
    run's entropy (kept on its device by the run) and the output panel's tensors where the adapter forms them on the
    device (adapter.output_parts: a decoder LM's top-k); other adapters' panels (output_summary) are read on their
    own. A family field returned as a tensor (the text route's mean distance) joins that copy and is sent as nested
    lists. On a GPU each separate read is a synchronisation and a copy of its own, and at 128-512 tokens the first
    view is bound by them and by kernel launches, not by arithmetic (benchmarks/results/gpu_long.md, "Response building (CPU proxy)")."""
    kept = result.kept_attention  # (L, H, T, T) on the run's device
    layer_index, head_index = _as_index(layers), _as_index(heads)
    # (l, h, T, T): one copy kernel when the indices run in steps of one (the layout the means below had before)
    selected = kept[layer_index][:, head_index].contiguous()
    rows = slice(None) if requested_queries is None else queries
    device_parts: dict[str, torch.Tensor] = {  # what is read to the host, in one copy
        "attention": selected if requested_queries is None else selected[:, :, rows],  # (l, h, q, T)
        "received": selected.mean(dim=2),  # (l, h, T): the attention each key gets, averaged over queries
    }
    if req.include_scores:
        device_parts["scores"] = result.scores_slice(layers, heads, rows)  # (l, h, q, T)
    if base is not None and req.include_base:
        device_parts["base_attention"] = base.kept_attention[layer_index][:, head_index][:, :, rows]  # (l, h, q, T)
    entropy = result.derived.get("entropy")  # the run's own, taken during its forward: (L, H) on its device until read
    if entropy is None:
        entropy = row_entropy(kept).mean(dim=-1)  # (L, H)
    if isinstance(entropy, torch.Tensor):
        device_parts["entropy"] = entropy
    device_parts["sink_mass"] = sink_mass(kept)  # (L, H): every head's mean P[i, 0]
    thumbnail_key = f"thumbnails{req.thumbnail_size}"
    if req.thumbnail_size and thumbnail_key not in result.derived:  # (L, H, t, t) levels and each head's max
        device_parts["thumbnail_levels"], device_parts["thumbnail_max"] = thumbnail_levels(kept, req.thumbnail_size)
    family = family_fields(result) if family_fields is not None else {}
    tensor_fields = [name for name, value in family.items() if isinstance(value, torch.Tensor)]
    device_parts.update({f"family.{name}": family[name] for name in tensor_fields})
    output_parts = adapter.output_parts(result, encoded)  # a decoder LM's next-token top-k, formed on the device
    if output_parts is not None:
        device_parts.update({f"output.{name}": tensor for name, tensor in output_parts.tensors.items()})
    dead_rows = pending_dead_rows(result)  # (L, H) counts behind the run's warnings, until they are read
    if dead_rows is not None:
        device_parts["dead_rows"] = dead_rows

    host = read_to_host(device_parts)  # the one device → host copy

    if "dead_rows" in host:
        settle_dead_rows(result, host["dead_rows"])

    if "entropy" in host:
        result.derived["entropy"] = host["entropy"].astype("float64").tolist()
    if "thumbnail_levels" in host:
        result.derived[thumbnail_key] = thumbnail_field(host["thumbnail_levels"], host["thumbnail_max"])
    family.update({name: host[f"family.{name}"].tolist() for name in tensor_fields})

    def field(name: str) -> object:
        return tensor_field(torch.from_numpy(host[name]), req.encoding) if name in host else None

    info = adapter.info
    response: dict[str, Any] = {
        "model": info.id, "tokens": encoded.tokens, "truncated": encoded.truncated, "layers": layers, "heads": heads,
        "native_beta": info.native_beta,
        "attention": field("attention"), "scores": field("scores"), "base_attention": field("base_attention"),
        "entropy": result.derived["entropy"],  # (L, H): every head
        "sink_mass": host["sink_mass"].astype("float64").tolist(),  # (L, H): every head
        "output": adapter.output_summary(result, encoded) if output_parts is None else
        output_parts.build({name: host[f"output.{name}"] for name in output_parts.tensors}),
        "thumbnails": result.derived[thumbnail_key] if req.thumbnail_size else None,
        "effect": None, "warnings": [], "elapsed_s": None,
        "run_id": result.run_id, "overview": None,
        "received": field("received"),
    }
    if requested_queries is not None:
        response["queries"] = queries
    response.update(family)
    return response


def _long_response(adapter: AttentionAdapter, encoded: Encoded, req: AttentionRequestBase, result: AttentionResult,
                   layers: list[int], heads: list[int], requested_queries: list[int] | None, queries: list[int],
                   effect: dict[str, Any] | None, warnings: list[str]) -> dict[str, Any]:
    """The first view of a long input (over full_map_tokens): no P but its overview (B × B blocks, the mean of P
    over each), received, every head's entropy, distance and thumbnails; exact windows come from
    POST /api/runs/{run_id}/window (docs/science.md §10)."""
    atlas = result.atlas
    attention = None
    if requested_queries is not None:  # the rows asked for, each normalised over all keys, rebuilt from q̂/k̂
        rows = [torch.stack([full_rows(atlas.record(l), heads, q, q + 1)[:, 0] for q in queries], dim=1) for l in layers]
        attention = tensor_field(torch.stack(rows).cpu(), req.encoding)  # (l, h, q, T)
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
        "model": adapter.info.id, "tokens": encoded.tokens, "truncated": encoded.truncated, "layers": layers,
        "heads": heads, "native_beta": adapter.info.native_beta, "run_id": result.run_id,
        "attention": attention, "scores": None, "base_attention": None,
        "overview": {"edges": atlas.row_edges(), "col_edges": atlas.col_edges(),
                     "maps": tensor_field(atlas.overview(layers, heads), req.encoding)},  # (l, h, B, B)
        "received": tensor_field(atlas.received(layers, heads), req.encoding),  # (l, h, T)
        "entropy": result.derived["entropy"],
        "sink_mass": atlas.sink_mass().double().tolist(),  # (L, H): every head's mean P[i, 0], from received
        "output": adapter.output_summary(result, encoded),
        "thumbnails": result.summary(f"thumbnails{req.thumbnail_size}", lambda: atlas.thumbnails(req.thumbnail_size))
        if req.thumbnail_size else None,
        "effect": effect, "warnings": warnings, "full_map_tokens": adapter.full_map_tokens,
        "elapsed_s": None,
    }
    if requested_queries is not None:
        response["queries"] = queries
    return response


def build_seq2seq_response(runtime: Runtime, adapter: Seq2SeqAdapter, encoded: Encoded, req: AttentionRequestBase) -> dict[str, Any]:
    """The response for an encoder–decoder: attention, entropy and effects per kind (encoder M × M, decoder
    N × N, cross N × M) for the requested layers/heads, the target tokens and their probabilities."""
    info = adapter.info
    limits = runtime.settings
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
    maps = [(info.layers, info.heads, *shapes["encoder"]), (info.decoder_layers, info.decoder_heads, *shapes["decoder"]),
            (info.decoder_layers, info.decoder_heads, *shapes["cross"])]
    # a long run keeps q̂/k̂ and summaries (a short one's P goes to the host)
    _check_before_runs(runtime, adapter, encoded, req, interventions, False, maps, n_source + n_target, "text",
                       adapter if long else None)
    check_response_numbers(limits, numbers, {"layers": len(layers), "heads": len(heads)}, "ask for fewer layers/heads")

    def sliced(result: AttentionResult) -> dict[str, Any]:
        return {kind: tensor_field(maps[layers][:, heads], req.encoding) for kind, maps in result.by_kind.items()}

    def effect_of(base: AttentionResult, run: AttentionResult) -> dict[str, Any]:
        return {
            "attention_tv": None if long else {  # long runs keep no maps
                kind: attention_tv(run.by_kind[kind][layers][:, heads], base.by_kind[kind][layers][:, heads]).tolist()
                for kind in KINDS},
            "hidden_cosine": hidden_cosine(run.hidden_states, base.hidden_states).tolist(),
            "output": adapter.output_effect(base, run, encoded),
        }

    result, base, effect = _sample_runs(runtime, adapter, encoded, req, interventions, False, effect_of)
    warnings = list(result.warnings)
    if encoded.truncated:
        warnings.append(f"source truncated to {n_source} tokens (the model's max_tokens)")
    if result.is_long:
        response = _seq2seq_long_response(adapter, encoded, req, result, layers, heads, effect, warnings)
        response["base_run_id"] = base.run_id if base is not None else None  # for /window's `minus` (P̂ − P)
        return response
    return {
        "model": info.id, "tokens": encoded.tokens, "target_tokens": encoded.extra["target_tokens"],
        "truncated": encoded.truncated, "layers": layers, "heads": heads, "native_beta": info.native_beta,
        "kinds": list(KINDS), "attention": sliced(result),
        "base_attention": sliced(base) if base is not None and req.include_base else None,
        "scores": None, "entropy": result.derived["entropy"], "output": adapter.output_summary(result, encoded),
        "effect": effect, "warnings": warnings, "run_id": result.run_id,
    }


def _seq2seq_long_response(adapter: Seq2SeqAdapter, encoded: Encoded, req: AttentionRequestBase, result: AttentionResult,
                           layers: list[int], heads: list[int], effect: dict[str, Any] | None,
                           warnings: list[str]) -> dict[str, Any]:
    """An encoder–decoder run over full_map_tokens (source or target): per kind the overview and received instead of
    P; exact windows of any kind from POST /api/runs/{run_id}/window with `kind` (docs/science.md §10)."""
    if effect is not None:
        warnings.append(f"effect.attention_tv is not computed for inputs over full_map_tokens={adapter.full_map_tokens:,} "
                        "(the runs keep no maps); hidden_cosine and the output change are")
    if req.compare and req.include_base:
        warnings.append("base_attention is not sent for long inputs: ask the base run's windows instead (base_run_id)")
    atlas = result.atlas
    overview = {}
    for kind in KINDS:
        part = adapter.kind_overview(atlas, kind, layers, heads)
        overview[kind] = {**part, "maps": tensor_field(part["maps"], req.encoding)}  # (l, h, nR, nC)
    return {
        "model": adapter.info.id, "tokens": encoded.tokens, "target_tokens": encoded.extra["target_tokens"],
        "truncated": encoded.truncated, "layers": layers, "heads": heads, "native_beta": adapter.info.native_beta,
        "kinds": list(KINDS), "attention": None, "base_attention": None, "scores": None,
        "entropy": result.derived["entropy"], "output": adapter.output_summary(result, encoded),
        "effect": effect, "warnings": warnings, "run_id": result.run_id, "full_map_tokens": adapter.full_map_tokens,
        "overview": overview,
        "received": {kind: tensor_field(adapter.kind_received(atlas, kind, layers, heads), req.encoding) for kind in KINDS},
    }


def _as_index(values: list[int]) -> slice | list[int]:
    """Indices that run in steps of one as a slice: the selection is then a view and one copy, not two index kernels
    and, on a GPU, each index list's own copy to the device."""
    if values and values == list(range(values[0], values[0] + len(values))):
        return slice(values[0], values[0] + len(values))
    return values


def thumbnails(attention: torch.Tensor, size: int) -> dict[str, Any]:
    """Every head's map average-pooled to at most size × size, as pictures: uint8 relative to each head's
    maximum (`max`, (L, H)), base64. (L, H, T, T) → {"dtype": "uint8", "shape": [L, H, t, t], "max", "data"}.
    The first view forms the same levels inside its one read (short_response); this reads them on their own."""
    levels, peak = thumbnail_levels(attention, size)
    host = read_to_host({"levels": levels, "max": peak})  # one copy for both
    return thumbnail_field(host["levels"], host["max"])


def thumbnail_levels(attention: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The thumbnails of every head at once, on the maps' device: one pooled product over the stacked maps, levels
    0-255 relative to each head's maximum. (L, H, T, T) → levels (L, H, t, t) uint8, max (L, H) float32."""
    pooled = attention
    if attention.shape[-1] > size:
        pool = _pooling_on(attention.shape[-1], size, attention.device)  # (size, T), kept where the maps are
        pooled = pool @ attention @ pool.T  # (L, H, size, size): two batched products, no copy of the maps
    peak = pooled.amax(dim=(-1, -2)).clamp_min(1e-12)  # (L, H)
    levels = torch.round(pooled / peak[..., None, None] * 255).to(torch.uint8)  # (L, H, t, t)
    return levels, peak


def thumbnail_field(levels: np.ndarray, peak: np.ndarray) -> dict[str, Any]:
    """The thumbnails' response field from host arrays: levels (L, H, t, t) uint8, base64; max (L, H)."""
    return {"dtype": "uint8", "shape": list(levels.shape), "max": peak.tolist(),
            "data": base64.b64encode(np.ascontiguousarray(levels, dtype=np.uint8).tobytes()).decode("ascii")}


def read_to_host(tensors: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """Tensors of one device → numpy arrays on the host, in ONE device → host copy: their bytes concatenated on the
    device (widest element first, so every part stays aligned), copied once, then viewed per tensor. On a GPU each
    `.cpu()`, `.tolist()` or `float(t)` is a synchronisation and a copy of its own (a first view made six). The
    arrays are fresh host memory: they never alias a tensor of the run (on a CPU the concatenation copies)."""
    if not tensors:
        return {}
    names = sorted(tensors, key=lambda name: -tensors[name].element_size())  # stable: the given order within a width
    parts = [tensors[name].detach().contiguous().reshape(-1).view(torch.uint8) for name in names]  # bytes of each
    data = torch.cat(parts).cpu().numpy()  # the one transfer
    host, offset = {}, 0
    for name, part in zip(names, parts):
        tensor = tensors[name]
        dtype = torch.empty(0, dtype=tensor.dtype).numpy().dtype
        host[name] = data[offset:offset + part.numel()].view(dtype).reshape(tuple(tensor.shape))
        offset += part.numel()
    return host


def pooling_matrix(n: int, size: int) -> torch.Tensor:
    """The averaging of adaptive_avg_pool over one axis as a (size, n) matrix: bin i covers
    [⌊i n / size⌋, ⌈(i + 1) n / size⌉), so A M Aᵀ equals adaptive_avg_pool2d(M, size). Each weight is 1 / (bin width)
    rounded once to float32."""
    bins = torch.arange(size)
    start, end = (bins * n) // size, -((-(bins + 1) * n) // size)  # (size,): each bin's first and past-the-last index
    columns = torch.arange(n)
    inside = (columns[None, :] >= start[:, None]) & (columns[None, :] < end[:, None])  # (size, n)
    weights = (1.0 / (end - start).double()).float()  # (size,): as a Python float rounded to float32
    return inside.float() * weights[:, None]


@functools.lru_cache(maxsize=32)
def _pooling_on(n: int, size: int, device: torch.device) -> torch.Tensor:
    """pooling_matrix on `device`, once per (n, size, device): a first view neither rebuilds it nor copies it to a
    GPU again. A plain tensor (not an inference tensor), usable in and outside inference mode."""
    with torch.inference_mode(False):
        return pooling_matrix(n, size).to(device)
