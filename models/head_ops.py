"""Operations on each head's output H = P V, before the heads are concatenated and projected by W_O
(docs/science.md "Beyond attention weights").

The attention function calls `at_layer` once per layer, right after H is formed; everything else it needs for
one run (the kept source runs of `patch_heads`, what to record, the batched patches of a scan) comes from a
context variable set by `head_run`, so nothing is left on modules and concurrent runs never see each other's.

- `patch_heads` (an intervention with a `source` run id): the scoped heads' outputs are replaced by the source
  run's, position by position.
- `ablate_heads` with mode "mean": the scoped heads' outputs are replaced by their mean over the positions
  (mode "zero", the default, is applied inside the attention function as before).
- A scan patches one (layer, head) per batch item: the corrupted prompt repeated B times, item b patching the
  heads `batch_heads[b]` names (models/patching.py).
- `patch_residual` (an intervention with a `source` run id): the residual stream after the scoped layers (a layer
  block's output) at the scoped positions (`tokens`, null = all) is replaced by the source run's. Forward hooks on
  the layer blocks, registered by `head_run` only while a request that names such a source runs.
- Value norms: with `value_grams` set, a recorded run keeps n_j^h = ‖v_j W_O^h‖ (H, T_k) on each layer's record
  (models/atlas.py), so windows, rows and overviews of a kept run can be value-weighted without re-running it.
"""
from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch

from models.atlas import PendingRecord, value_norms_from_gram
from models.interventions import Intervention
from models.ops import OPS
from models.run_context import current_run


@dataclass
class HeadRun:
    """What one forward asks of the head outputs besides the interventions.

    sources: run id → the source run's head outputs, one (H, T, d_v) tensor per layer (patch_heads);
    record: when set, layer → H (B, H, T, d_v) as the layer computed it (after the ops), and `values` layer → V
    (B, H, T_k, d_v) (value-weighted attention needs them);
    batch_heads: (B, L, H) bool, item b's heads to patch from `batch_source` (a scan); batch_source: one (H, T, d_v)
    tensor per layer;
    track_grad: add a zero leaf δ_l (B, H, T, d_v) requiring grad to each layer's output, so that ∂f/∂δ_l is the
    total derivative of any later f with respect to H_l (attribution patching, gradient × attention).
    """

    sources: Mapping[str, list[torch.Tensor]] = field(default_factory=dict)
    record: dict[int, torch.Tensor] | None = None
    values: dict[int, torch.Tensor] | None = None
    batch_heads: torch.Tensor | None = None
    batch_source: list[torch.Tensor] | None = None
    track_grad: bool = False
    deltas: dict[int, torch.Tensor] = field(default_factory=dict)
    # patch_residual: run id → the source run's residual stream after every layer (L, T, D); `blocks` the model's
    # layer blocks, hooked while `head_run` is active
    residual_sources: Mapping[str, torch.Tensor] = field(default_factory=dict)
    blocks: list[torch.nn.Module] | None = None
    # per layer G_h = W_O^h W_O^hᵀ (H, d_v, d_v) float64 (models/attribution.value_grams): set, a recorded forward
    # keeps ‖v_j W_O^h‖ = √(v_j G_h v_jᵀ) on each layer's record
    value_grams: list[torch.Tensor] | None = None


_current: contextvars.ContextVar[HeadRun | None] = contextvars.ContextVar("attnlab_head_run", default=None)


# The run whose residual sources are in reach: a nested head_run without any (a scan's batches, the norms' forward)
# keeps its outer one's, as the interventions of the forwards inside still name them.
_residual_run: contextvars.ContextVar[HeadRun | None] = contextvars.ContextVar("attnlab_residual_run", default=None)


@contextlib.contextmanager
def head_run(run: HeadRun) -> Iterator[HeadRun]:
    token = _current.set(run)
    residual_token, handles = None, []
    if run.residual_sources:
        residual_token = _residual_run.set(run)
        if run.blocks is not None:
            # hooks only while this context lives; they act only for forwards in it (a concurrent request's pass by)
            handles = [block.register_forward_hook(_residual_hook(run, layer)) for layer, block in enumerate(run.blocks)]
    try:
        yield run
    finally:
        for handle in handles:
            handle.remove()
        if residual_token is not None:
            _residual_run.reset(residual_token)
        _current.reset(token)


def _residual_hook(run: HeadRun, layer: int):
    def hook(_module, _args, output):
        if _residual_run.get() is not run:
            return None
        scope = current_run.get()  # the RunScope of models/hooks.py
        interventions = getattr(scope, "interventions", ())
        patches = [iv for iv in interventions if OPS[iv.op].patches_residual and iv.applies_to_layer(layer)]
        if not patches:
            return None
        hidden = output[0] if isinstance(output, tuple) else output  # (B, T_q, D)
        hidden = patch_residual(hidden, layer, patches, run.residual_sources, scope.query_offset)
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden
    return hook


def patch_residual(hidden: torch.Tensor, layer: int, patches: list[Intervention], sources: Mapping[str, torch.Tensor],
                   query_offset: int = 0) -> torch.Tensor:
    """The residual stream after `layer` with the patches' positions taken from their sources. hidden: (B, T_q, D),
    row r = token position query_offset + r; a source covers positions 0 … T_s − 1 (positions past it are left
    alone). → a new (B, T_q, D) tensor (or `hidden` itself when nothing applies)."""
    for iv in patches:
        if iv.source not in sources:
            raise KeyError(f"patch_residual: no kept run {iv.source!r}")
        source = sources[iv.source][layer]  # (T_s, D)
        wanted = range(source.shape[0]) if iv.tokens is None else iv.tokens
        positions = [t for t in wanted if query_offset <= t < query_offset + hidden.shape[1] and t < source.shape[0]]
        if not positions:
            continue
        rows = torch.tensor([t - query_offset for t in positions], device=hidden.device)
        hidden = hidden.clone()
        hidden[:, rows] = source[positions].to(hidden.device, hidden.dtype)
    return hidden


def keep_value_norms(value: torch.Tensor, layer: int, grams: list[torch.Tensor]) -> None:
    """Put ‖v_j W_O^h‖ (H, T_k) float32 on this layer's record of the recording run (batch of one), if any.
    value: (B, H, T_k, d_v), or (B, H_kv, T_k, d_v) one per K/V head (grouped-query attention: kept without the
    copies per query head)."""
    scope = current_run.get()
    if not getattr(scope, "record", False) or value.shape[0] != 1:
        return
    atlas = getattr(scope, "atlas", None)
    record = (atlas.records if atlas is not None else scope.records).get(layer)
    if isinstance(record, PendingRecord):  # a short run: the norms are formed when first asked for
        if record.norms_from is None and record.value_norms is None:
            record.norms_from = (value[0].detach(), grams[layer])
        return
    if record is None or record.value_norms is not None:
        return
    record.value_norms = value_norms_from_gram(value[0].detach(), grams[layer])  # (H, T_k)


def current_sources() -> Mapping[str, list[torch.Tensor]]:
    """The source runs available to patch_heads in this context (empty outside `head_run`)."""
    run = _current.get()
    return {} if run is None else run.sources


def current_residual_sources() -> Mapping[str, torch.Tensor]:
    """The source runs available to patch_residual in this context, run id → (L, T, D) (empty outside `head_run`)."""
    run = _residual_run.get()
    return {} if run is None else run.residual_sources


def head_output_ops(
    output: torch.Tensor, layer: int, interventions: tuple[Intervention, ...],
    sources: Mapping[str, list[torch.Tensor]], query_offset: int = 0,
) -> torch.Tensor:
    """The interventions' head-output ops at one layer, in request order. output: (B, H, T_q, d_v) → same shape.

    Row r of `output` is token position query_offset + r (a decoding step sees only its new queries); a source
    run covers positions 0 … T_source − 1, and positions past it are left alone.
    """
    for iv in interventions:
        op = OPS[iv.op]
        if iv.applies_to_layer(layer) and op.touches_outputs(iv):
            output = op.head_outputs(iv, output, layer, sources, query_offset)
    return output


def at_layer(
    output: torch.Tensor, value: torch.Tensor, layer: int, interventions: tuple[Intervention, ...], query_offset: int = 0,
    kv_value: torch.Tensor | None = None,
) -> torch.Tensor:
    """Called by the attention function with H (B, H, T_q, d_v) and V (B, H, T_k, d_v) (with grouped-query attention
    also `kv_value`, V per K/V head (B, H_kv, T_k, d_v), what the value norms keep); returns the H to project."""
    run = _current.get()
    if run is None:
        if not any(OPS[iv.op].touches_outputs(iv) for iv in interventions):
            return output  # the usual case: one scan of a short tuple
        return head_output_ops(output, layer, interventions, {}, query_offset)
    if run.value_grams is not None:
        keep_value_norms(value if kv_value is None else kv_value, layer, run.value_grams)
    output = head_output_ops(output, layer, interventions, run.sources, query_offset)
    if run.batch_heads is not None and bool(run.batch_heads[:, layer].any()):
        source = run.batch_source[layer].to(output.device, output.dtype)  # (H, T, d_v)
        chosen = run.batch_heads[:, layer].to(output.device)[:, :, None, None]  # (B, H, 1, 1)
        output = torch.where(chosen, source.unsqueeze(0), output)  # (B, H, T, d_v)
    if run.track_grad and torch.is_grad_enabled():
        delta = torch.zeros_like(output, requires_grad=True)  # (B, H, T, d_v), stays 0: the forward is unchanged
        run.deltas[layer] = delta
        output = output + delta
    if run.record is not None:
        run.record[layer] = output
    if run.values is not None:
        run.values[layer] = value
    return output
