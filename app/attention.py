"""Building an attention response (text or image) from a request, an adapter and an encoded input."""
from __future__ import annotations

import base64
from collections.abc import Callable
from typing import Any

import torch
from fastapi import HTTPException
from fastapi.exceptions import RequestValidationError

from app.encoding import fast_json, tensor_field  # noqa: F401  (fast_json: routes import it from here)
from app.lifecycle import check_cancelled
from app.runtime import Runtime
from app.schemas import AttentionRequestBase, to_engine
from models.adapters.base import AttentionAdapter, AttentionResult, Encoded
from models.effects import attention_tv, hidden_cosine, mean_and_std
from models.interventions import Intervention, row_entropy


def field_error(loc: tuple, message: str) -> RequestValidationError:
    """A 422 in FastAPI's usual shape, naming the field."""
    return RequestValidationError([{"loc": ("body", *loc), "msg": message, "type": "value_error"}])


def _check_indices(values: list[int] | None, size: int, loc: tuple, what: str) -> list[int]:
    if values is None:
        return list(range(size))
    bad = [v for v in values if v >= size]
    if bad:
        raise field_error(loc, f"{what} {bad} out of range: this model/input has {size} {what}s (0..{size - 1})")
    return list(dict.fromkeys(values))  # de-duplicated, order kept


def engine_interventions(req: AttentionRequestBase, adapter: AttentionAdapter, n_tokens: int) -> tuple[Intervention, ...]:
    """Check every index against the model and the input; 422 naming the field if out of range."""
    info = adapter.info
    result = []
    for i, item in enumerate(req.interventions):
        _check_indices(item.layers, info.layers, ("interventions", i, "layers"), "layer")
        _check_indices(item.heads, info.heads, ("interventions", i, "heads"), "head")
        tokens = getattr(item, "tokens", None)
        if tokens is not None:
            _check_indices(tokens, n_tokens, ("interventions", i, "tokens"), "token")
        result.append(to_engine(item))
    return tuple(result)


def _effect(adapter: AttentionAdapter, base: AttentionResult, run: AttentionResult, encoded: Encoded,
            layers: list[int], heads: list[int]) -> dict[str, Any]:
    after = run.attention[layers][:, heads]  # (l, h, T, T)
    before = base.attention[layers][:, heads]
    return {
        "attention_tv": attention_tv(after, before).tolist(),
        "attention_tv_all": attention_tv(run.attention, base.attention).tolist(),  # (L, H): every head, cheap
        "hidden_cosine": hidden_cosine(run.hidden_states, base.hidden_states).tolist(),
        "output": adapter.output_effect(base, run, encoded),
    }


def _merge_samples(effects: list[dict[str, Any]]) -> dict[str, Any]:
    merged = mean_and_std([{k: v for k, v in e.items() if k != "output"} for e in effects])
    merged["output"] = mean_and_std([e["output"] for e in effects])
    merged["samples"] = len(effects)
    return merged


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
    limits = runtime.settings
    if len(req.interventions) > limits.max_interventions:
        raise field_error(("interventions",), f"{len(req.interventions)} interventions; the limit is "
                          f"{limits.max_interventions} (max_interventions)")
    if req.samples > limits.max_samples:
        raise field_error(("samples",), f"samples={req.samples}; the limit is {limits.max_samples} (max_samples)")
    n_tokens = len(encoded.tokens)
    layers = _check_indices(req.layers, info.layers, ("layers",), "layer")
    heads = _check_indices(req.heads, info.heads, ("heads",), "head")
    requested_queries = getattr(req, "queries", None)
    queries = _check_indices(requested_queries, n_tokens, ("queries",), "query token")
    interventions = engine_interventions(req, adapter, n_tokens)

    maps = 1 + int(req.include_scores) + int(req.compare and req.include_base)  # P, Ŝ, P without interventions
    numbers = len(layers) * len(heads) * len(queries) * n_tokens * maps
    cap = runtime.settings.max_response_numbers
    if numbers > cap:
        raise HTTPException(
            413,
            detail=f"the response would hold {numbers:,} numbers, over the cap max_response_numbers={cap:,}; "
            "ask for fewer layers/heads/queries (fields 'layers', 'heads', 'queries') or turn off include_scores",
        )

    sample_sets = [tuple(iv.with_seed_offset(s) for iv in interventions) for s in range(req.samples)]
    check_cancelled()  # before each model run: a client that left (or a shutdown) stops the work here
    result = runtime.run(adapter, encoded, sample_sets[0], req.include_scores)
    effect = base = None
    if req.compare:
        check_cancelled()
        base = runtime.run(adapter, encoded, (), False)
        effects = [_effect(adapter, base, result, encoded, layers, heads)]
        for sample in sample_sets[1:]:
            check_cancelled()
            effects.append(_effect(adapter, base, runtime.run(adapter, encoded, sample, False), encoded, layers, heads))
        effect = effects[0] if len(effects) == 1 else _merge_samples(effects)

    rows = slice(None) if requested_queries is None else queries

    def sliced(tensor: torch.Tensor) -> torch.Tensor:
        return tensor[layers][:, heads][:, :, rows]  # (l, h, q, T)

    warnings = list(result.warnings)
    if encoded.truncated:
        warnings.append(f"input truncated to {n_tokens} tokens (the model's max_tokens)")
    response: dict[str, Any] = {
        "model": info.id,
        "tokens": encoded.tokens,
        "truncated": encoded.truncated,
        "layers": layers,
        "heads": heads,
        "native_beta": info.native_beta,
        "attention": tensor_field(sliced(result.attention), req.encoding),
        "scores": tensor_field(result.scores_slice(layers, heads, rows), req.encoding) if req.include_scores else None,
        "base_attention": tensor_field(sliced(base.attention), req.encoding) if base is not None and req.include_base else None,
        # (L, H) summaries of every head, computed once per cached result
        "entropy": result.summary("entropy", lambda: row_entropy(result.attention).mean(dim=-1).tolist()),
        "output": adapter.output_summary(result, encoded),
        "thumbnails": result.summary(f"thumbnails{req.thumbnail_size}", lambda: thumbnails(result.attention, req.thumbnail_size))
        if req.thumbnail_size else None,
        "effect": effect,
        "warnings": warnings,
        "elapsed_s": getattr(result, "elapsed_s", None) if limits.expose_timings else None,  # a cache oracle otherwise
    }
    if requested_queries is not None:
        response["queries"] = queries
    if family_fields is not None:
        response.update(family_fields(result))
    return response


def thumbnails(attention: torch.Tensor, size: int) -> dict[str, Any]:
    """Every head's map average-pooled to at most size × size, as pictures: uint8 relative to each head's
    maximum (`max`, (L, H)), base64. (L, H, T, T) → {"dtype": "uint8", "shape": [L, H, t, t], "max", "data"}."""
    n_layers, n_heads, n_tokens, _ = attention.shape
    pooled = attention
    if n_tokens > size:
        pool = pooling_matrix(n_tokens, size)  # (size, T)
        pooled = pool @ attention @ pool.T  # (L, H, size, size): two batched products, no copy of the maps
    peak = pooled.amax(dim=(-1, -2)).clamp_min(1e-12)  # (L, H)
    levels = torch.round(pooled / peak[..., None, None] * 255).to(torch.uint8)  # (L, H, t, t)
    return {
        "dtype": "uint8",
        "shape": list(levels.shape),
        "max": peak.tolist(),
        "data": base64.b64encode(levels.numpy().tobytes()).decode("ascii"),
    }


def pooling_matrix(n: int, size: int) -> torch.Tensor:
    """The averaging of adaptive_avg_pool over one axis as a (size, n) matrix: bin i covers
    [⌊i n / size⌋, ⌈(i + 1) n / size⌉), so A M Aᵀ equals adaptive_avg_pool2d(M, size)."""
    matrix = torch.zeros(size, n)
    for i in range(size):
        start, end = (i * n) // size, -((-(i + 1) * n) // size)
        matrix[i, start:end] = 1.0 / (end - start)
    return matrix
