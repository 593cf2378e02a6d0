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
"""
from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch

from models.interventions import Intervention


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


_current: contextvars.ContextVar[HeadRun | None] = contextvars.ContextVar("attnlab_head_run", default=None)


@contextlib.contextmanager
def head_run(run: HeadRun) -> Iterator[HeadRun]:
    token = _current.set(run)
    try:
        yield run
    finally:
        _current.reset(token)


def current_sources() -> Mapping[str, list[torch.Tensor]]:
    """The source runs available to patch_heads in this context (empty outside `head_run`)."""
    run = _current.get()
    return {} if run is None else run.sources


def head_output_ops(
    output: torch.Tensor, layer: int, interventions: tuple[Intervention, ...],
    sources: Mapping[str, list[torch.Tensor]], query_offset: int = 0,
) -> torch.Tensor:
    """The interventions' head-output ops at one layer, in request order. output: (B, H, T_q, d_v) → same shape.

    Row r of `output` is token position query_offset + r (a decoding step sees only its new queries); a source
    run covers positions 0 … T_source − 1, and positions past it are left alone.
    """
    for iv in interventions:
        if not iv.applies_to_layer(layer):
            continue
        if iv.op == "patch_heads":
            if iv.source not in sources:
                raise KeyError(f"patch_heads: no kept run {iv.source!r}")
            source = sources[iv.source][layer].to(output.device, output.dtype)  # (H, T_s, d_v)
            rows = max(0, min(output.shape[2], source.shape[1] - query_offset))
            if rows == 0:
                continue
            heads = iv.head_list(output.shape[1])
            output = output.clone()
            output[:, heads, :rows] = source[heads, query_offset:query_offset + rows].unsqueeze(0)
        elif iv.op == "ablate_heads" and iv.mode == "mean":
            heads = iv.head_list(output.shape[1])
            output = output.clone()
            output[:, heads] = output[:, heads].mean(dim=2, keepdim=True).expand_as(output[:, heads])
    return output


def at_layer(
    output: torch.Tensor, value: torch.Tensor, layer: int, interventions: tuple[Intervention, ...], query_offset: int = 0
) -> torch.Tensor:
    """Called by the attention function with H (B, H, T_q, d_v) and V (B, H, T_k, d_v); returns the H to project."""
    run = _current.get()
    if run is None:
        if not any(iv.op == "patch_heads" or (iv.op == "ablate_heads" and iv.mode == "mean") for iv in interventions):
            return output  # the usual case: one scan of a short tuple
        return head_output_ops(output, layer, interventions, {}, query_offset)
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
