"""Attributions beyond the attention weights (docs/science.md "Value-weighted attention").

Value-weighted attention (Kobayashi, Kuribayashi, Yokoi & Inui 2020, "Attention is not only a weight"): what key j
actually adds to head h's output at query i is P[i, j] · v_j W_O^h, so its size ‖P[i, j] · v_j W_O^h‖ =
P[i, j] · ‖v_j W_O^h‖. A key with a large weight but a small transformed value (a "sink") adds little.
Rows are normalised to sum to 1 for display; a row whose keys are all masked stays 0.
"""
from __future__ import annotations

import torch

from models.adapters.base import AttentionAdapter, Encoded
from models.anatomy import output_projections
from models.head_ops import HeadRun, current_sources, head_run
from models.interventions import Intervention


def value_norms(values: torch.Tensor, w_o: torch.Tensor) -> torch.Tensor:
    """‖v_j W_O^h‖ for every head and key. values: (H, T, d_v), w_o: (H, d_v, D) → (H, T)."""
    return torch.linalg.vector_norm(torch.matmul(values, w_o), dim=-1)  # (H, T, D) → (H, T)


def value_weighted(probs: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
    """P[i, j] · ‖v_j W_O^h‖, each row normalised to sum to 1 (0 rows stay 0).
    probs: (..., H, T_q, T_k), norms: (..., H, T_k) → (..., H, T_q, T_k)."""
    weighted = probs * norms.unsqueeze(-2)  # (..., H, T_q, T_k)
    total = weighted.sum(dim=-1, keepdim=True)  # (..., H, T_q, 1)
    return torch.where(total > 0, weighted / total.clamp_min(1e-30), torch.zeros_like(weighted))


def run_value_norms(adapter: AttentionAdapter, encoded: Encoded, interventions: tuple[Intervention, ...] = ()) -> torch.Tensor:
    """‖v_j W_O^h‖ of every layer, head and key for one input under the interventions: (L, H, T), float32 on the
    CPU. A forward of its own that records V (the same run as the one whose P is shown: same input and
    interventions, so the same V)."""
    values: dict[int, torch.Tensor] = {}
    inputs = dict(encoded.inputs)
    if adapter.info.output == "next_token":
        inputs["logits_to_keep"] = 1
    with head_run(HeadRun(values=values, sources=current_sources())):  # patch_heads sources stay visible
        adapter._forward(inputs, interventions, record_scores=False)
    info = adapter.info
    projections = output_projections(adapter.model, adapter.layer_of, info.heads, info.head_dim)
    with torch.inference_mode():
        norms = [value_norms(values[l][0].to(w.dtype), w).float().cpu() for l, w in enumerate(projections)]
    return torch.stack(norms)  # (L, H, T)
