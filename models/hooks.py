"""Plugging the intervened attention into transformers without forking it.

transformers 5 dispatches every BERT/ViT/DINOv2 attention call through `AttentionInterface`; we
register one function under the name "attnlab" and load models with `attn_implementation="attnlab"`.
The function reads the current run from a context variable — set per call by `run_scope` — so two
concurrent requests (threads) never see each other's interventions, and no state is left on modules.
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from models.interventions import Intervention, intervened_attention

ATTN_IMPLEMENTATION = "attnlab"


@dataclass
class RunScope:
    """Everything one forward pass needs from, and gives back to, the attention function."""

    layer_of: dict[int, int]  # id(attention module) → layer index, built once at load
    interventions: tuple[Intervention, ...] = ()
    record_scores: bool = False
    attention: dict[int, torch.Tensor] = field(default_factory=dict)  # layer → P (B, H, T, T)
    scores: dict[int, torch.Tensor] = field(default_factory=dict)  # layer → Ŝ (B, H, T, T)
    entropy: dict[int, torch.Tensor] = field(default_factory=dict)  # layer → mean row entropy (B, H)
    warnings: list[str] = field(default_factory=list)
    # One (L, B, H, T, T) buffer for P (and one for Ŝ), allocated at the first layer and filled in
    # place, so the run's maps are ready at the end without stacking (a copy of L·H·T² floats).
    probs_buffer: torch.Tensor | None = None
    scores_buffer: torch.Tensor | None = None

    def buffers_for(self, layer: int, maps_shape: tuple[int, ...], like: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Where layer `layer` writes P and Ŝ; maps_shape: (B, H, T_q, T_k), like: a tensor of the dtype and device."""
        shape = (len(self.layer_of), *maps_shape)
        if self.probs_buffer is None:
            self.probs_buffer = like.new_empty(shape)
            if self.record_scores:
                self.scores_buffer = like.new_empty(shape)
        elif self.probs_buffer.shape != shape:  # layers of different shapes: each keeps its own tensor
            return None, None
        return self.probs_buffer[layer], (self.scores_buffer[layer] if self.scores_buffer is not None else None)

    def stacked(self, which: str) -> torch.Tensor:
        """P ('attention') or Ŝ ('scores') of the first batch item for every layer: (L, H, T, T)."""
        buffer = self.probs_buffer if which == "attention" else self.scores_buffer
        maps = getattr(self, which)
        if buffer is not None and all(maps[l].data_ptr() == buffer[l].data_ptr() for l in maps):
            return buffer[:, 0]
        return torch.stack([maps[l][0] for l in range(len(maps))])


_current_run: contextvars.ContextVar[RunScope | None] = contextvars.ContextVar("attnlab_run", default=None)


@contextlib.contextmanager
def run_scope(scope: RunScope):
    token = _current_run.set(scope)
    try:
        yield scope
    finally:
        _current_run.reset(token)


def _allowed_from_mask(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """The model's own mask as bool 'may attend' (sdpa masks are bool; eager ones additive floats)."""
    if attention_mask is None:
        return None
    if attention_mask.dtype == torch.bool:
        return attention_mask
    return attention_mask > torch.finfo(attention_mask.dtype).min / 2


def attnlab_attention(
    module: nn.Module,
    query: torch.Tensor,  # (B, H, T_q, d)
    key: torch.Tensor,  # (B, H, T_k, d)
    value: torch.Tensor,  # (B, H, T_k, d_v)
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,  # models run in eval mode: no dropout
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    native_beta = scaling if scaling is not None else query.shape[-1] ** -0.5
    scope = _current_run.get()
    allowed = _allowed_from_mask(attention_mask)
    if scope is None:  # called outside a run (e.g. training): plain attention, nothing recorded
        output, probs, _, _ = intervened_attention(query, key, value, allowed, layer=-1, native_beta=native_beta)
        return output.transpose(1, 2).contiguous(), probs
    layer = scope.layer_of[id(module)]
    n_batch, n_heads, n_queries = query.shape[:3]
    probs_out, scores_out = scope.buffers_for(layer, (n_batch, n_heads, n_queries, key.shape[2]), query)
    entropy = query.new_empty(n_batch, n_heads)  # (B, H)
    output, probs, scores, dead_rows = intervened_attention(
        query, key, value, allowed, layer=layer, native_beta=native_beta, interventions=scope.interventions,
        need_scores=scope.record_scores, probs_out=probs_out, scores_out=scores_out, entropy_out=entropy,
    )
    scope.attention[layer] = probs.detach()
    scope.entropy[layer] = entropy
    if scope.record_scores:
        scope.scores[layer] = scores.detach()
    if bool(dead_rows.any()):
        heads = sorted({int(h) for h in dead_rows.nonzero()[:, 1]})
        scope.warnings.append(
            f"layer {layer}: {int(dead_rows.sum())} query rows in heads {heads} have every key masked; "
            "their attention and output are 0"
        )
    return output.transpose(1, 2).contiguous(), probs  # (B, T_q, H, d_v), (B, H, T_q, T_k)


def register() -> str:
    """Register the attention and mask functions with transformers (idempotent); returns the name."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, attnlab_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)  # bool masks; without it padding is dropped
    return ATTN_IMPLEMENTATION


def map_attention_modules(model: nn.Module, class_suffix: str = "SelfAttention") -> dict[int, int]:
    """id(module) → layer index for every self-attention module, in forward order.

    ViT/DINOv2 attention modules carry no layer index, so we number them once at load.
    """
    modules = [m for m in model.modules() if type(m).__name__.endswith(class_suffix)]
    if not modules:
        raise ValueError(f"no attention modules whose class ends with {class_suffix!r} in {type(model).__name__}")
    return {id(m): i for i, m in enumerate(modules)}
