"""The scale's statistics and the permutation check, worked for app/routes/scale.py: every check before any work, then
the work the route hands to app/streams.py `respond`.

score_stats: one head's raw q·k over the pairs its mask allows, the Gaussian theory fitted with the head's own q and
k, the rows' entropy at scale 1 and 1/√d, and the attention's parameter and map counts (models/score_stats.py).
permutation_check: the maps of a permuted input against the permuted maps with positions off and on
(models/positions.py). Both are forwards of the model without interventions, under the runtime's model lock.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable

from app.admission import check_work_cost
from app.attention import check_request_limits
from app.context import RequestContext
from app.costs import forward_macs, model_shape
from app.deps import adapter_for
from app.errors import field_error
from app.lifecycle import check_cancelled
from models.positions import permutation_check
from models.score_stats import allowed_pairs, attention_counting, map_counting, score_stats

Work = Callable[[RequestContext], dict[str, Any]]
ENCODER_OUTPUTS = ("similarity", "mlm", "embedding")

_counted: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # adapter → its counting


def _counting(adapter) -> dict[str, Any]:
    """The model's attention parameters (models/score_stats.py), counted once per adapter."""
    kept = _counted.get(adapter)
    if kept is None:
        info, config = adapter.info, adapter.model.config
        kept = _counted[adapter] = attention_counting(adapter.model, adapter.layer_of, int(config.hidden_size),
                                                      info.heads, info.kv_heads or info.heads, info.head_dim)
    return kept


def _encoded_text(runtime, adapter, text: str, fewest: int, need: str):
    """The request's text encoded, refused (422 naming `text`) when blank or outside fewest..the analysis limit."""
    if not text.strip():
        raise field_error(("text",), "text is empty or only white space")
    encoded = adapter.encode(text)
    n_tokens, limit = len(encoded.tokens), min(runtime.settings.analysis_max_tokens, adapter.full_map_tokens)
    if not fewest <= n_tokens <= limit:
        raise field_error(("text",), f"text has {n_tokens} tokens; {need} {fewest} to {limit} (analysis_max_tokens)")
    return encoded


def _admitted_run(runtime, adapter, macs: int, runs: int, what: str, ctx: RequestContext):
    """The work's cost checked (413 when over), then the runtime's model lock held for it (a context manager)."""
    seconds = check_work_cost(adapter, runtime, macs, runs, "text", what, ctx)
    check_cancelled(ctx)
    return runtime.admitted(ctx=ctx.with_(estimate_s=seconds))


def score_stats_work(runtime, req) -> Work:
    """POST /api/text/score_stats, checked: layer and head in range, an encoder or decoder LM, the text's tokens."""
    check_request_limits(runtime.settings, req)
    adapter = adapter_for(runtime, req.model, "text")
    info = adapter.info
    if info.output not in (*ENCODER_OUTPUTS, "next_token"):
        raise field_error(("model",), f"model {info.id} is an encoder–decoder: score_stats is offered for encoders "
                          "and decoder language models")
    encoded = _encoded_text(runtime, adapter, req.text, 1, "the statistics take")
    n_tokens = len(encoded.tokens)
    for name, value, size in (("layer", req.layer, info.layers), ("head", req.head, info.heads)):
        if value >= size:
            raise field_error((name,), f"{name} {value} out of range: this model has {size} {name}s (0..{size - 1})")
    causal = info.output == "next_token"
    sliding = bool(info.layer_types) and info.layer_types[req.layer] == "sliding"
    allowed = allowed_pairs(n_tokens, causal, info.sliding_window if sliding else None)

    def work(ctx: RequestContext) -> dict[str, Any]:
        macs = forward_macs(model_shape(adapter), n_tokens, n_tokens)
        with _admitted_run(runtime, adapter, macs, 1, "the score statistics", ctx):
            result = adapter.run(encoded, (), record_scores=True)
            queries, keys = result.queries[req.layer, req.head], result.keys[req.layer, req.head]  # (T, d) each
        stats = score_stats(queries, keys, allowed, info.native_beta, req.bins)
        return {"model": info.id, "tokens": encoded.tokens, "truncated": encoded.truncated, "layer": req.layer,
                "head": req.head, "causal": causal, **stats, "counting": _counting(adapter),
                "maps": map_counting(n_tokens, info.layers, info.heads, int(allowed.sum()))}

    return work


def permutation_check_work(runtime, req) -> Work:
    """POST /api/text/permutation_check, checked: an encoder with position embeddings, 4 tokens or more."""
    check_request_limits(runtime.settings, req)
    adapter = adapter_for(runtime, req.model, "text")
    info = adapter.info
    if info.output not in ENCODER_OUTPUTS or adapter.positions_kind is None:
        raise field_error(("model",), f"model {info.id} is not an encoder with position embeddings: the permutation "
                          "check needs attention that is not causal")
    encoded = _encoded_text(runtime, adapter, req.text, 4, "the check needs")
    n_tokens = len(encoded.tokens)

    def work(ctx: RequestContext) -> dict[str, Any]:
        macs = 4 * forward_macs(model_shape(adapter), n_tokens, n_tokens)
        with _admitted_run(runtime, adapter, macs, 4, "the permutation check", ctx):
            found = permutation_check(adapter, encoded, req.seed)
        return {"model": info.id, "tokens": encoded.tokens, "seed": req.seed, **found}

    return work
