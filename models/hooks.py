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
    # With record_scores: layer → (q̂, k̂), each (B, H, T, d), the queries and keys after perturbation;
    # Ŝ = q̂ k̂ᵀ is formed only for the heads a request asks for (T × d each instead of T × T).
    queries_keys: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    entropy: dict[int, torch.Tensor] = field(default_factory=dict)  # layer → mean row entropy (B, H)
    warnings: list[str] = field(default_factory=list)
    # One (L, B, H, T, T) buffer for P, allocated at the first layer and filled in place, so the run's
    # maps are ready at the end without stacking (a copy of L·H·T² floats).
    probs_buffer: torch.Tensor | None = None

    def buffer_for(self, layer: int, maps_shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor | None:
        """Where layer `layer` writes P; maps_shape: (B, H, T_q, T_k), like: a tensor of the dtype and device."""
        shape = (len(self.layer_of), *maps_shape)
        if self.probs_buffer is None:
            self.probs_buffer = like.new_empty(shape)
        elif self.probs_buffer.shape != shape:  # layers of different shapes: each keeps its own tensor
            return None
        return self.probs_buffer[layer]

    def stacked_attention(self) -> torch.Tensor:
        """P of the first batch item for every layer: (L, H, T, T)."""
        maps, buffer = self.attention, self.probs_buffer
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
    probs_out = scope.buffer_for(layer, (n_batch, n_heads, n_queries, key.shape[2]), query)
    entropy = query.new_empty(n_batch, n_heads)  # (B, H)
    queries_keys: list | None = [] if scope.record_scores else None
    output, probs, _, dead_rows = intervened_attention(
        query, key, value, allowed, layer=layer, native_beta=native_beta, interventions=scope.interventions,
        need_scores=False, probs_out=probs_out, entropy_out=entropy, qk_out=queries_keys,
    )
    scope.attention[layer] = probs.detach()
    scope.entropy[layer] = entropy
    if queries_keys is not None:
        scope.queries_keys[layer] = (queries_keys[0].detach(), queries_keys[1].detach())
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
