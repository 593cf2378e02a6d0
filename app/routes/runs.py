"""Kept runs (docs/science.md §10): exact windows of any head, and one query row over every key, rebuilt from what
the run kept (q̂, k̂, β, masks, extras) without re-running the model.

POST /api/runs/{run_id}/window  — P[r0:r1, c0:c1] of one head (optionally at a view β, optionally with Ŝ), the
                                  entropy of each of its rows over every key, or P̂ − P against another run
POST /api/runs/{run_id}/row     — P[i, :] of the chosen layers × heads, and per head the mass on a span of keys

Both are bounded by what they COMPUTE, not only by what they return: softmax over a row needs every key of it, so a
window of r rows costs r × T_k numbers per pass (the rows rebuilt, re-weighted, their entropy) and a row r × T_k per
layer × head asked, however few numbers come back (a span's mass alone is one number a head). Over
`max_computed_numbers` that is a 413 naming the field that drives it; a repeated layer or head is a 422. The work
runs under the runtime's model lock (`runtime.admitted()`), queued like any other model work: one at a time.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

import torch
from fastapi import APIRouter, HTTPException, Request, Response
from pydantic import Field, ValidationInfo, field_validator

from app.lifecycle import ParsedJsonRoute
from app.attention import check_response_numbers
from app.errors import field_error
from app.deps import RuntimeDep
from app.encoding import binary_fields, tensor_field
from app.streams import answered, wants_binary
from app.ids import is_valid_run_id
from app.runtime import Runtime
from app.schemas import AttentionKind, _Strict
from models.adapters.base import AttentionResult
from models.atlas import LayerRecord, full_row_entropy, full_rows, scores_window, window
from models.attribution import value_weighted_rows
from models.interventions import row_entropy

router = APIRouter(prefix="/api/runs", tags=["runs"], route_class=ParsedJsonRoute)

Index = Annotated[int, Field(ge=0)]
Range = Annotated[list[Index], Field(min_length=2, max_length=2)]
Encoding = Literal["json", "f16", "f32"]
# uniqueItems: a repeated index was computed again (1,024 × 1,024 repeats of one head took minutes of CPU); checked by
# RowRequest._each_once (422 naming the field)
UniqueIndices = Annotated[list[Index], Field(min_length=1, max_length=1024, json_schema_extra={"uniqueItems": True})]
Weighting = Literal["attention", "value_norm"]
WEIGHTING = Field("attention", description="'value_norm': the value-weighted map ‖P[i,j]·v_j W_O^h‖ renormalised per "
                  "row (each row over all its keys) from the per-key norms the run kept, instead of P (text, image, "
                  "encoder–decoder and speech runs; every kind)")


class WindowRequest(_Strict):
    layer: Index = Field(description="layer (within `kind` for encoder–decoders)")
    head: Index = Field(description="query head")
    rows: Range = Field(description="[r0, r1): query rows, half-open")
    cols: Range = Field(description="[c0, c1): keys, half-open")
    kind: AttentionKind | None = Field(None, description="encoder–decoders: encoder | decoder | cross; else null")
    beta: float | None = Field(None, gt=0, le=1e4, description="view-mode β: the window's rows re-normalised at this "
                               "β for this head (from q̂ k̂ᵀ, no model re-run); null = the run's own")
    include_scores: bool = Field(False, description="also Ŝ = q̂ k̂ᵀ for the window (before β, masks and softmax)")
    weighting: Weighting = WEIGHTING
    minus: str | None = Field(None, description="another kept run of the same model and tokens (e.g. a compare's "
                              "base_run_id): `attention` is then this run's window minus that run's (P̂ − P)")
    encoding: Encoding = "json"


class RowRequest(_Strict):
    row: Index = Field(description="the query row i")
    layers: UniqueIndices | None = Field(None, description="layers (null = all), each at most once")
    heads: UniqueIndices | None = Field(None, description="heads (null = all), each at most once")
    kind: AttentionKind | None = None
    beta: float | None = Field(None, gt=0, le=1e4, description="view-mode β for every returned head")
    span: Range | None = Field(None, description="[c0, c1): keys whose attention mass per head is returned")
    include_row: bool = Field(True, description="false: only the span's mass (the retrieval view), no rows")
    weighting: Weighting = WEIGHTING
    encoding: Encoding = "json"

    @field_validator("layers", "heads")
    @classmethod
    def _each_once(cls, values: list[int] | None, info: ValidationInfo) -> list[int] | None:
        if values is not None and len(set(values)) < len(values):
            repeated = sorted({v for v in values if values.count(v) > 1})
            raise ValueError(f"{info.field_name} {repeated} named more than once: name each at most once")
        return values


def _kept(runtime: Runtime, run_id: str) -> AttentionResult:
    result = runtime.get_run(run_id) if is_valid_run_id(run_id) else None
    if result is None or result.atlas is None:
        raise HTTPException(404, detail=missing_run(runtime, run_id, result))
    return result


def missing_run(runtime: Runtime, run_id: str, result: AttentionResult | None = None) -> str:
    """The 404's detail for a run this process cannot answer, saying which case it is: expired (the run store held
    it and dropped it), unknown (never held here), or kept without what windows need."""
    if result is not None:
        return f"run {run_id!r} kept no per-layer records to rebuild windows from: run the input again"
    if runtime.cache.why_missing(run_id) == "expired":
        return (f"run {run_id!r} expired: this server held it and dropped it after its pin (result_pin_s="
                f"{runtime.settings.result_pin_s:g} s after its last use) ended, to make room (RAM and the disk tier, "
                "run_store_disk_bytes, were full): run the input again for a new run_id")
    return (f"run {run_id!r} is unknown: this server never held it (an id from another server, or from before a "
            "restart): run the input again for a new run_id")


def _layer(runtime: Runtime, result: AttentionResult, layer: int, kind: str | None, loc: tuple) -> tuple[int, int, int]:
    """(global layer of the engine, its query rows, its keys); 422 naming the field when out of range."""
    adapter = runtime.adapter(result.model_id) if result.model_id else None
    kind_layers = getattr(adapter, "kind_layers", None)
    if kind_layers is None:
        if kind is not None:
            raise field_error(("kind",), "this run's model has one kind of attention; kind must be null")
        layers = list(range(result.atlas.n_layers))
    else:
        if kind is None:
            raise field_error(("kind",), f"this run's model has kinds {sorted(kind_layers)}: name one")
        layers = kind_layers[kind]
    if layer >= len(layers):
        raise field_error(loc, f"layer {layer} out of range: this run has {len(layers)} layers (0..{len(layers) - 1})")
    record = result.atlas.records[layers[layer]]
    return layers[layer], record.queries.shape[1], record.keys.shape[1]


def _range(values: list[int], size: int, name: str) -> tuple[int, int]:
    start, end = values
    if not start < end <= size:
        raise field_error((name,), f"{name} [{start}, {end}) is not a non-empty range within 0..{size}")
    return start, end


@router.post("/{run_id}/window", responses={
    404: {"description": "a run this server does not hold (this one, or the run named by `minus`): unknown or "
          "expired, the detail says which"},
    413: {"description": "over max_window_cells (rows × cols returned), or over max_computed_numbers (rows × all "
          "keys, per pass, computed): names `rows`"},
    422: {"description": "indices out of range; `minus` a run of another model or other tokens (the detail names "
          "both token counts, or the first position where they differ)"}})
def run_window(run_id: str, req: WindowRequest, runtime: RuntimeDep, request: Request) -> Response:
    """One head's attention P[r0:r1, c0:c1] of a kept run, exactly as the run computed it (every row normalised over
    all its keys), rebuilt from q̂ k̂ᵀ with the run's β, masks and extras — the way to look into inputs over
    full_map_tokens, whose responses carry an overview instead of maps (see /guide#s10). `beta` re-normalises the
    window's rows at another β for this head without re-running the model (view mode). `row_entropy` is the entropy
    of each of the window's rows over ALL its keys (not only the window's columns). With `minus` (another kept run
    of the same model and tokens, e.g. a compare's `base_run_id`) `attention` is the difference P̂ − P of the two
    runs' windows, each computed as above."""
    result = _kept(runtime, run_id)
    global_layer, n_rows, n_cols = _layer(runtime, result, req.layer, req.kind, ("layer",))
    n_heads = result.atlas.records[global_layer].queries.shape[0]  # (a short run's record is built under the lock)
    if req.head >= n_heads:
        raise field_error(("head",), f"head {req.head} out of range: this layer has {n_heads} heads")
    rows, cols = _range(req.rows, n_rows, "rows"), _range(req.cols, n_cols, "cols")
    cells = (rows[1] - rows[0]) * (cols[1] - cols[0])
    cap = runtime.settings.max_window_cells
    if cells > cap:
        raise HTTPException(413, detail=f"rows, cols: the window has {cells:,} cells, over max_window_cells={cap:,}: "
                            "ask for fewer rows or cols")
    other = _minus_run(runtime, result, req, (n_rows, n_cols)) if req.minus is not None else None
    computed = sum(_window_numbers(run, req, rows, cols, n_cols) for run in (result, other) if run is not None)
    limit = runtime.settings.max_computed_numbers
    if computed > limit:
        raise HTTPException(413, detail=(
            f"rows: a window of {rows[1] - rows[0]:,} rows is computed over all {n_cols:,} keys of each row (softmax "
            f"needs every key; the rows' entropy is a second pass{', for both runs of `minus`' if other else ''}): "
            f"{computed:,} numbers, over max_computed_numbers={limit:,}; ask for fewer rows"))
    block = result.atlas.config.block_rows  # rows per block: the run's own block size
    with runtime.admitted():  # model work like any other: one at a time, queued (503 when the queue is full)
        record = result.atlas.record(global_layer)
        attention, entropy = _window_of(result, req, global_layer, rows, cols, block)
        scores = scores_window(record, req.head, rows, cols) if req.include_scores else None
        if other is not None:
            other_attention, other_entropy = _window_of(other, req, global_layer, rows, cols, block)
            attention = attention - other_attention.to(attention.device)  # P̂ − P: (r, c)

    def body() -> dict[str, Any]:
        out = {"layer": req.layer, "head": req.head, "rows": list(rows), "cols": list(cols), "kind": req.kind,
               "beta": req.beta, "weighting": req.weighting, "minus": req.minus,
               "scores": tensor_field(scores, req.encoding) if scores is not None else None}
        if other is not None:
            out["minus_row_entropy"] = other_entropy.tolist()
        out["attention"] = tensor_field(attention, req.encoding)
        out["row_entropy"] = entropy.tolist()  # (r,) nats
        return out
    return _answer(request, body)


def _answer(request: Request, body: Callable[[], dict[str, Any]]) -> Response:
    """The route's answer as JSON, or in the binary form when the request accepts application/octet-stream
    (app/encoding.py: its f16/f32 fields' bytes after a JSON header), as POST /api/text/attention answers."""
    if not wants_binary(request):
        return answered(body())
    with binary_fields() as parts:  # the tensor_field calls inside body() keep their arrays for the binary body
        out = body()
    return answered(out, parts)


def _window_numbers(result: AttentionResult, req: WindowRequest, rows: tuple[int, int], cols: tuple[int, int],
                    n_keys: int) -> int:
    """The numbers one run's window computes: r × T_k per pass over its rows (a short run's kept P at the run's β is
    sliced, not rebuilt; a value-weighted row is a pass of its own; the entropy over every key is one more), plus
    the window's scores when asked."""
    r = rows[1] - rows[0]
    kept = _kept_maps(result, req.kind, req.layer) is not None and req.beta is None
    passes = (0 if kept else 1) + (1 if req.weighting == "value_norm" else 0) + 1
    return r * n_keys * passes + (r * (cols[1] - cols[0]) if req.include_scores else 0)


def _minus_run(runtime: Runtime, result: AttentionResult, req: WindowRequest, shape: tuple[int, int]) -> AttentionResult:
    """The run named by `minus`: kept (else 404), of the same model, with the same tokens (422 naming both counts,
    or the first position where they differ) and the same query and key counts in the asked layer (else 422 naming
    `minus`)."""
    other = _kept(runtime, req.minus)
    if other.model_id != result.model_id:
        raise field_error(("minus",), f"run {req.minus!r} is of model {other.model_id}, this run of {result.model_id}: "
                          "a difference window needs two runs of the same model")
    mine, theirs = list(result.tokens or ()), list(other.tokens or ())
    if len(mine) != len(theirs):
        raise field_error(("minus",), f"run {req.minus!r} has {len(theirs)} tokens and this run {len(mine)}: a "
                          "difference window needs two runs of the same tokens")
    differ = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), None)
    if differ is not None:  # as many tokens but other ones (a generate's continuations that part): P̂ − P means nothing
        raise field_error(("minus",), f"run {req.minus!r} has other tokens than this run from position {differ} on "
                          f"({theirs[differ]!r} there, this run {mine[differ]!r}): a difference window needs two runs "
                          "of the same tokens")
    _, other_rows, other_cols = _layer(runtime, other, req.layer, req.kind, ("layer",))
    if (other_rows, other_cols) != shape:
        raise field_error(("minus",), f"run {req.minus!r} has {other_rows} query × {other_cols} key tokens here and "
                          f"this run {shape[0]} × {shape[1]}: a difference window needs the same tokens")
    return other


def _window_of(result: AttentionResult, req: WindowRequest, global_layer: int, rows: tuple[int, int],
               cols: tuple[int, int], block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the window (r, c), the entropy of each of its rows over every key (r,) float32 on the host) of one run, at
    the request's β and weighting. Rebuilt rows are built `block` rows at a time: no r × T_k map is held."""
    record = result.atlas.record(global_layer)
    kept = _kept_maps(result, req.kind, req.layer)
    blocks = [(b0, min(rows[1], b0 + block)) for b0 in range(rows[0], rows[1], block)]
    if req.weighting == "value_norm":  # every key of the rows is needed: each row is renormalised over all of them
        _check_norms(record)
        parts, entropies = [], []
        for b0, b1 in blocks:
            probs = kept[req.head, b0:b1][None] if kept is not None and req.beta is None else None  # (1, b, T_k)
            full = value_weighted_rows(record, [req.head], b0, b1, req.beta, probs)[0]  # (b, T_k)
            parts.append(full[:, cols[0]:cols[1]])
            # the entropy of the map shown: the value-weighted rows, each a distribution over every key
            entropies.append(row_entropy(full).float().cpu())
            del full
        return torch.cat(parts), torch.cat(entropies)
    if kept is not None and req.beta is None:  # a short run keeps P: the window and its rows are slices of it
        full = kept[req.head, rows[0]:rows[1]]  # (r, T_k)
        return full[:, cols[0]:cols[1]], row_entropy(full).float().cpu()
    attention = torch.cat([window(record, req.head, (b0, b1), cols, req.beta) for b0, b1 in blocks])
    # from q̂ k̂ᵀ and each row's log-sum-exp, blocks of rows: no r × T_k map beyond one block
    entropy = full_row_entropy(record, [req.head], rows[0], rows[1], req.beta, block)[0].cpu()  # (r,)
    return attention, entropy


def _check_norms(record: LayerRecord) -> None:
    if record.value_norms is None:
        raise field_error(("weighting",), "value_norm: this run kept no value norms (runs of /api/text/attention, "
                          "/api/image/attention and /api/audio/attention keep them): run the input again")


def _kept_maps(result: AttentionResult, kind: str | None, layer: int) -> torch.Tensor | None:
    """A short run's P of that layer (H, T_q, T_k), or None for a long run."""
    if result.by_kind is not None and kind is not None:
        # a kind whose P the run did not keep (Whisper's encoder: only q̂/k̂) is rebuilt from the atlas
        return result.by_kind[kind][layer] if kind in result.by_kind else None
    return None if result.kept_attention is None else result.kept_attention[layer]  # on the run's device: sliced there


@router.post("/{run_id}/row", responses={
    404: {"description": "a run this server does not hold: unknown or expired, the detail says which"},
    413: {"description": "over max_response_numbers (returned), or over max_computed_numbers (layers × heads × all "
          "keys, computed): names `layers` or `heads`"},
    422: {"description": "indices out of range; a layer or head named more than once"}})
def run_row(run_id: str, req: RowRequest, runtime: RuntimeDep, request: Request) -> Response:
    """Query row i over every key, for the chosen layers × heads (default all): `attention` [l][h][T_k]; with
    `span` [c0, c1), `span_mass` [l][h] = Σ_{c0 ≤ j < c1} P[i, j], the attention each head puts on those keys
    from row i (the retrieval view: which heads fetch a fact from far back, /guide#s10)."""
    result = _kept(runtime, run_id)
    n_layers = _kind_layer_count(runtime, result, req.kind)
    layers = req.layers if req.layers is not None else list(range(n_layers))
    bad = [l for l in layers if l >= n_layers]
    if bad:
        raise field_error(("layers",), f"layers {bad} out of range: this run has {n_layers} layers")
    resolved = [_layer(runtime, result, l, req.kind, ("layers",)) for l in layers]
    n_rows, n_cols = resolved[0][1], resolved[0][2]
    n_heads = result.atlas.records[resolved[0][0]].queries.shape[0]
    heads = req.heads if req.heads is not None else list(range(n_heads))
    bad = [h for h in heads if h >= n_heads]
    if bad:
        raise field_error(("heads",), f"heads {bad} out of range: this run has {n_heads} heads")
    if req.row >= n_rows:
        raise field_error(("row",), f"row {req.row} out of range: this run has {n_rows} query rows (0..{n_rows - 1})")
    span = _range(req.span, n_cols, "span") if req.span is not None else None
    driver = "layers" if len(layers) >= len(heads) else "heads"  # the field with more entries drives the product
    numbers = len(layers) * len(heads) * (n_cols if req.include_row else 1)
    check_response_numbers(runtime.settings, numbers, {"layers": len(layers), "heads": len(heads)},
                           "ask for fewer layers/heads")
    # every head's row is computed over all T_k keys (softmax needs them), whether or not the row is returned
    computed = len(layers) * len(heads) * n_cols
    limit = runtime.settings.max_computed_numbers
    if computed > limit:
        raise HTTPException(413, detail=(
            f"{driver}: row {req.row} of {len(layers)} layers × {len(heads)} heads is computed over all {n_cols:,} "
            f"keys (softmax needs every key, even for a span's mass alone): {computed:,} numbers, over "
            f"max_computed_numbers={limit:,}; ask for fewer layers or heads"))
    with runtime.admitted():  # model work like any other: one at a time, queued (503 when the queue is full)
        if req.weighting == "value_norm":
            for g, _, _ in resolved:
                _check_norms(result.atlas.record(g))
            rows = torch.stack([value_weighted_rows(result.atlas.record(g), heads, req.row, req.row + 1, req.beta)[:, 0]
                                for g, _, _ in resolved]).cpu()  # (l, h, T_k)
        else:
            rows = torch.stack([full_rows(result.atlas.record(g), heads, req.row, req.row + 1, req.beta)[:, 0]
                                for g, _, _ in resolved]).cpu()  # (l, h, T_k)
    return _answer(request, lambda: {
        "row": req.row, "layers": layers, "heads": heads, "kind": req.kind, "beta": req.beta, "weighting": req.weighting,
        "attention": tensor_field(rows, req.encoding) if req.include_row else None, "span": list(span) if span else None,
        "span_mass": rows[..., span[0]:span[1]].sum(dim=-1).tolist() if span else None})


def _kind_layer_count(runtime: Runtime, result: AttentionResult, kind: str | None) -> int:
    adapter = runtime.adapter(result.model_id) if result.model_id else None
    kind_layers = getattr(adapter, "kind_layers", None)
    if kind_layers is None:
        if kind is not None:
            raise field_error(("kind",), "this run's model has one kind of attention; kind must be null")
        return result.atlas.n_layers
    if kind is None:
        raise field_error(("kind",), f"this run's model has kinds {sorted(kind_layers)}: name one")
    return len(kind_layers[kind])
