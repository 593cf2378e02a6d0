"""Checking a request's interventions against its model and input: one validator, driven by a table per family.

A family's table says, per kind of attention, how many layers and heads it has, how many keys and query rows (the
indices of `tokens`: keys or query rows, as each op declares (models/ops/)) and how a refusal names them. Plain models (encoders, decoder LMs, ViTs) have one kind; encoder–decoders three (encoder: source × source,
decoder: target × target, cross: target rows × source keys); Whisper the same three over 1,500 encoder positions.
Every refusal is a 422 naming the field (interventions[i].layers/heads/tokens/kind/op/source).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from app.errors import field_error
from app.schemas import to_engine
from models.adapters.seq2seq import KINDS, KindScopedIntervention
from models.head_ops import current_residual_sources, current_sources
from models.interventions import Intervention
from models.ops import OPS

WHISPER_POSITIONS = 1500  # Whisper's encoder positions (30 s at 20 ms each), whatever the clip's length


def check_indices(values: list[int] | None, size: int, loc: tuple, what: str) -> list[int]:
    """The indices asked for (all of 0..size-1 when None), de-duplicated in order; 422 naming `loc` if one is out
    of range."""
    if values is None:
        return list(range(size))
    bad = [v for v in values if v >= size]
    if bad:
        raise field_error(loc, f"{what} {bad} out of range: this model/input has {size} {what}s (0..{size - 1})")
    return list(dict.fromkeys(values))  # de-duplicated, order kept


def check_patch_source(source: str, n_tokens: int, loc: tuple, op: str = "patch_heads") -> None:
    """A patch_heads / patch_residual source (an op whose Op reads a kept run's head outputs or residual stream)
    must be a run kept for this request's model with this input's token count (app/patch_sources.py `request_sources`
    puts them in reach for the attention, lens and patching work; elsewhere, e.g. continuations, none is)."""
    heads = OPS[op].patch_source == "heads"
    kept = (current_sources() if heads else current_residual_sources()).get(source)
    if kept is None:
        raise field_error(loc, f"unknown or expired run {source!r}: {op} takes the clean_run_id of POST "
                          "/api/text/patching, on /api/text/attention and /api/text/lens with the same model")
    kept_tokens = kept[0].shape[1] if heads else kept.shape[1]  # (H, T, d_v) per layer; (L, T, D)
    if kept_tokens != n_tokens:
        raise field_error(loc, f"run {source!r} has {kept_tokens} tokens and this input {n_tokens}: "
                          f"{op} needs the same token count")


@dataclass(frozen=True)
class KindBounds:
    """One kind of attention: its layers and heads, its keys and query rows, and how a refusal names a key index
    and a query-row index."""
    layers: int
    heads: int
    keys: int
    queries: int
    key_name: str = "token"
    query_name: str = "token"


@dataclass(frozen=True)
class InterventionTable:
    """What a family accepts. `kinds` maps each kind to its bounds; a model with one kind of attention has the
    single key None (a request's `kind` must then be null). An intervention with kind null targets every kind, and
    its indices must fit the smallest."""
    model: str
    kinds: dict[str | None, KindBounds]
    name_the_kinds: bool = False  # messages say which kind(s) bound the index ("layer (cross attention)")
    tokens_need_kind: str | None = None  # refusal of `tokens` without a kind ("{op}" = the op), where keys differ
    refused_ops: dict[str, str] = field(default_factory=dict)  # op → why this family does not offer it
    patch_sources: bool = False  # patch_heads / patch_residual sources are checked against kept runs


NO_POSITIONS = "positions is not offered for this model: no position embeddings or rotary module was found"
# encoder–decoders and speech: their positions (learned, sinusoidal or relative) are not hooked (models/positions.py)
SEQ2SEQ_POSITIONS = "positions is offered for encoders, decoder LMs and ViTs, not for encoder–decoder or speech models"


def plain_table(info: Any, n_tokens: int, positions_kind: str | None = "absolute") -> InterventionTable:
    """Encoders, decoder LMs and ViTs: one kind, keys and query rows are the input's tokens. `positions_kind`: where
    the model's positions op acts (None: refused)."""
    refused = {} if positions_kind else {"positions": NO_POSITIONS}
    return InterventionTable(info.id, {None: KindBounds(info.layers, info.heads, n_tokens, n_tokens)},
                             patch_sources=True, refused_ops=refused)


def seq2seq_table(info: Any, n_source: int, n_target: int) -> InterventionTable:
    """Encoder–decoders: keys are source tokens for encoder and cross attention, target tokens for the decoder;
    query rows are source tokens for the encoder, target tokens for the decoder and cross attention."""
    key, query = "token", "query token"
    bounds = {
        "encoder": KindBounds(info.layers, info.heads, n_source, n_source, key, query),
        "decoder": KindBounds(info.decoder_layers, info.decoder_heads, n_target, n_target, key, query),
        "cross": KindBounds(info.decoder_layers, info.decoder_heads, n_source, n_target, key, query),
    }
    return InterventionTable(info.id, {kind: bounds[kind] for kind in KINDS}, name_the_kinds=True,
                             refused_ops={"positions": SEQ2SEQ_POSITIONS})


def whisper_table(info: Any, n_target: int) -> InterventionTable:
    """Whisper: keys are encoder positions (0 … 1499, 20 ms each) for cross and encoder attention, decoder tokens for
    the decoder; a cross-attention query row is a decoder token. Token numbers mean different things per kind, so
    `tokens` needs a kind."""
    positions, decoder = WHISPER_POSITIONS, "decoder token"
    bounds = {
        "encoder": KindBounds(info.encoder_layers, info.heads, positions, positions, "encoder position", "encoder position"),
        "decoder": KindBounds(info.decoder_layers, info.heads, n_target, n_target, decoder, decoder),
        "cross": KindBounds(info.decoder_layers, info.heads, positions, n_target, "encoder position",
                            f"{decoder} (cross-attention queries)"),
    }
    return InterventionTable(
        info.id, {kind: bounds[kind] for kind in KINDS},
        tokens_need_kind="{op} with tokens needs a kind: token numbers are encoder positions (20 ms each) for 'cross' "
                         "and 'encoder', decoder tokens for 'decoder'",
        refused_ops={"patch_heads": "patch_heads is not offered for speech models", "positions": SEQ2SEQ_POSITIONS})


def check_interventions(items: list, table: InterventionTable) -> list[tuple[Intervention, str | None]]:
    """Each request intervention checked against `table`, as (engine intervention, kind); 422 naming the field at
    the first that does not fit."""
    checked = []
    for i, item in enumerate(items):
        where = ("interventions", i)
        op = OPS[item.op]  # what the op declares: scoped or not, what `tokens` names, a patch source
        if item.op in table.refused_ops:
            raise field_error((*where, "op"), table.refused_ops[item.op])
        if not op.scoped and (item.layers is not None or item.heads is not None):
            raise field_error((*where, "layers" if item.layers is not None else "heads"), op.unscoped_why)
        if item.kind is not None and item.kind not in table.kinds:
            raise field_error((*where, "kind"), f"model {table.model} has one kind of attention; kind must be null")
        tokens = getattr(item, "tokens", None)
        if tokens is not None and item.kind is None and table.tokens_need_kind:
            raise field_error((*where, "kind"), table.tokens_need_kind.format(op=item.op))
        kinds = list(table.kinds) if item.kind is None else [item.kind]
        bounds = [table.kinds[kind] for kind in kinds]
        scope = ""
        if table.name_the_kinds:
            scope = f" (the smallest over kinds {'/'.join(kinds)})" if len(kinds) > 1 else f" ({kinds[0]} attention)"
        check_indices(item.layers, min(b.layers for b in bounds), (*where, "layers"), f"layer{scope}")
        check_indices(item.heads, min(b.heads for b in bounds), (*where, "heads"), f"head{scope}")
        if tokens is not None:
            queries = op.tokens_index == "rows"  # query rows (perturb_queries) or keys
            size = min(b.queries if queries else b.keys for b in bounds)
            name = bounds[0].query_name if queries else bounds[0].key_name  # one name per family and side
            check_indices(tokens, size, (*where, "tokens"), f"{name}{scope}")
        if table.patch_sources and op.patch_source:
            check_patch_source(item.source, bounds[0].keys, (*where, "source"), item.op)
        checked.append((to_engine(item), item.kind))
    return checked


def engine_interventions(req: Any, adapter: Any, n_tokens: int) -> tuple[Intervention, ...]:
    """A plain model's interventions, checked against the model and the input."""
    table = plain_table(adapter.info, n_tokens, getattr(adapter, "positions_kind", None))
    return tuple(iv for iv, _ in check_interventions(req.interventions, table))


def seq2seq_interventions(req: Any, adapter: Any, n_source: int, n_target: int) -> tuple:
    """An encoder–decoder's interventions, checked per kind, then (kind, layers) translated into the engine's
    global layers."""
    checked = check_interventions(req.interventions, seq2seq_table(adapter.info, n_source, n_target))
    return adapter.engine_interventions([KindScopedIntervention(iv, kind) for iv, kind in checked])


def whisper_interventions(req: Any, adapter: Any, n_target: int) -> tuple:
    """Whisper's interventions, checked per kind (keys: encoder positions or decoder tokens), then translated into
    the engine's global layers."""
    checked = check_interventions(req.interventions, whisper_table(adapter.info, n_target))
    return adapter.engine_interventions([KindScopedIntervention(iv, kind) for iv, kind in checked])
