"""Positions and the scale, on the text page. POST /api/text/permutation_check: with positions off an encoder's maps
of a permuted input are the permuted maps (models/positions.py, docs/science.md "Positions off"). The scale's
statistics: POST /api/text/score_stats, the raw q·k of one head over its allowed pairs, the Gaussian
theory fitted with the head's own q and k, the rows' entropy at scale 1 and 1/√d, and the attention's parameter and
map counts (models/score_stats.py, docs/science.md "Why the scale is 1/√d").

One forward of the model without interventions, under the runtime's model lock like any run; the statistics are a
T × T product of one head.
"""
from __future__ import annotations

import weakref
from typing import Any

from fastapi import APIRouter, Request, Response
from pydantic import Field

from app.admission import check_work_cost
from app.attention import check_request_limits
from app.context import RequestContext
from app.costs import forward_macs, model_shape
from app.deps import RuntimeDep, adapter_for
from app.errors import field_error
from app.lifecycle import ParsedJsonRoute, check_cancelled
from app.schemas import NonNegInt, _Strict
from app.streams import respond
from models.positions import permutation_check
from models.score_stats import DEFAULT_BINS, allowed_pairs, attention_counting, map_counting, score_stats

router = APIRouter(prefix="/api/text", tags=["analysis"], route_class=ParsedJsonRoute)


class ScoreStatsRequest(_Strict):
    """One head's raw scores q·k and what the 1/√d scale does to them (see /guide)."""

    model: str = Field("minilm", max_length=200)
    text: str = Field(min_length=1)
    layer: NonNegInt = Field(description="the layer of the head")
    head: NonNegInt = Field(description="the query head")
    bins: int = Field(DEFAULT_BINS, ge=5, le=200, description="the histogram's bins")


_counted: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # adapter → its counting


def _counting(adapter) -> dict[str, Any]:
    """The model's attention parameters (models/score_stats.py), counted once per adapter."""
    kept = _counted.get(adapter)
    if kept is None:
        info, config = adapter.info, adapter.model.config
        kept = _counted[adapter] = attention_counting(adapter.model, adapter.layer_of, int(config.hidden_size),
                                                      info.heads, info.kv_heads or info.heads, info.head_dim)
    return kept


@router.post("/score_stats", responses={
    422: {"description": "a field is wrong: layer or head out of range, too many tokens, a model without it"},
    503: {"description": "queue full"}})
def score_stats_route(req: ScoreStatsRequest, request: Request, runtime: RuntimeDep) -> Response:
    """The raw scores s_ij = q_i·k_j of head `head` at layer `layer` (before any scale, after RoPE) over every pair
    the model's mask allows: histogram, mean and variance; the theory for independent Gaussian entries fitted with
    the head's own q and k (`theory`, and `theory.pooled` for one μ, σ); the rows' softmax entropy in nats at scale
    1, 1/√d and the model's β₀; the attention's parameters by the textbook formula beside the real tensors
    (`counting`) and the N² attention weights of this input (`maps`). Encoders and decoder LMs."""
    check_request_limits(runtime.settings, req)
    adapter = adapter_for(runtime, req.model, "text")
    info = adapter.info
    if info.output not in ("similarity", "mlm", "embedding", "next_token"):
        raise field_error(("model",), f"model {info.id} is an encoder–decoder: score_stats is offered for encoders "
                          "and decoder language models")
    if not req.text.strip():
        raise field_error(("text",), "text is empty or only white space")
    encoded = adapter.encode(req.text)
    n_tokens, limit = len(encoded.tokens), min(runtime.settings.analysis_max_tokens, adapter.full_map_tokens)
    if n_tokens > limit:
        raise field_error(("text",), f"text has {n_tokens} tokens; the limit is {limit} (analysis_max_tokens)")
    for name, value, size in (("layer", req.layer, info.layers), ("head", req.head, info.heads)):
        if value >= size:
            raise field_error((name,), f"{name} {value} out of range: this model has {size} {name}s (0..{size - 1})")
    causal = info.output == "next_token"
    sliding = bool(info.layer_types) and info.layer_types[req.layer] == "sliding"
    allowed = allowed_pairs(n_tokens, causal, info.sliding_window if sliding else None)

    def work(ctx: RequestContext) -> dict[str, Any]:
        seconds = check_work_cost(adapter, runtime.settings, forward_macs(model_shape(adapter), n_tokens, n_tokens),
                                  1, "text", "the score statistics", ctx)
        check_cancelled(ctx)
        with runtime.admitted(ctx=ctx.with_(estimate_s=seconds)):
            result = adapter.run(encoded, (), record_scores=True)
            queries, keys = result.queries[req.layer, req.head], result.keys[req.layer, req.head]  # (T, d) each
        stats = score_stats(queries, keys, allowed, info.native_beta, req.bins)
        return {"model": info.id, "tokens": encoded.tokens, "truncated": encoded.truncated, "layer": req.layer,
                "head": req.head, "causal": causal, **stats, "counting": _counting(adapter),
                "maps": map_counting(n_tokens, info.layers, info.heads, int(allowed.sum()))}

    return respond(request, work, "POST /api/text/score_stats")


class PermutationCheckRequest(_Strict):
    """An encoder's maps of a permuted input against the permuted maps, with positions off and on (see /guide)."""

    model: str = Field("minilm", max_length=200)
    text: str = Field(min_length=1)
    seed: int = Field(0, ge=0, le=2**31 - 1, description="seeds the permutation of the tokens between [CLS] and [SEP]")


@router.post("/permutation_check", responses={
    422: {"description": "a field is wrong: not an encoder, too few or too many tokens"}, 503: {"description": "queue full"}})
def permutation_check_route(req: PermutationCheckRequest, request: Request, runtime: RuntimeDep) -> Response:
    """Permute the tokens of `text` (the first and last, [CLS] and [SEP], stay) and compare the maps of the permuted
    input with the permuted maps, max |P(πx) − Π P(x) Πᵀ| over every layer and head: with positions off (the
    `positions` intervention) they agree to float rounding, with positions on they do not. Encoders only (a
    decoder's causal mask is not permutation-symmetric); four runs of the model."""
    check_request_limits(runtime.settings, req)
    adapter = adapter_for(runtime, req.model, "text")
    info = adapter.info
    if info.output not in ("similarity", "mlm", "embedding") or adapter.positions_kind is None:
        raise field_error(("model",), f"model {info.id} is not an encoder with position embeddings: the permutation "
                          "check needs attention that is not causal")
    if not req.text.strip():
        raise field_error(("text",), "text is empty or only white space")
    encoded = adapter.encode(req.text)
    n_tokens, limit = len(encoded.tokens), min(runtime.settings.analysis_max_tokens, adapter.full_map_tokens)
    if not 4 <= n_tokens <= limit:
        raise field_error(("text",), f"text has {n_tokens} tokens; the check needs 4 to {limit} (analysis_max_tokens)")

    def work(ctx: RequestContext) -> dict[str, Any]:
        seconds = check_work_cost(adapter, runtime.settings,
                                  4 * forward_macs(model_shape(adapter), n_tokens, n_tokens), 4, "text",
                                  "the permutation check", ctx)
        check_cancelled(ctx)
        with runtime.admitted(ctx=ctx.with_(estimate_s=seconds)):
            found = permutation_check(adapter, encoded, req.seed)
        return {"model": info.id, "tokens": encoded.tokens, "seed": req.seed, **found}

    return respond(request, work, "POST /api/text/permutation_check")
