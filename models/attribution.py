"""Attributions beyond the attention weights (docs/science.md "Value-weighted attention").

Value-weighted attention (Kobayashi, Kuribayashi, Yokoi & Inui 2020, "Attention is not only a weight"): what key j
actually adds to head h's output at query i is P[i, j] · v_j W_O^h, so its size ‖P[i, j] · v_j W_O^h‖ =
P[i, j] · ‖v_j W_O^h‖. A key with a large weight but a small transformed value (a "sink") adds little.
Rows are normalised to sum to 1 for display; a row whose keys are all masked stays 0.
"""
from __future__ import annotations

import threading
import weakref

import torch

from models.adapters.base import AttentionAdapter, Encoded
from models.anatomy import attention_modules, output_projections
from models.atlas import Atlas, LayerRecord, full_rows
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
    projections = output_projections(adapter.model, adapter.layer_of, *layer_head_shapes(adapter))
    with torch.inference_mode():
        norms = [value_norms(values[l][0].to(w.dtype), w).float().cpu() for l, w in enumerate(projections)]
    return torch.stack(norms)  # (L, H, T)


def layer_head_shapes(adapter: AttentionAdapter) -> tuple[list[int], list[int]]:
    """(heads, d_v) of every engine layer, in the engine's numbering. An encoder–decoder's kinds may differ in heads
    (BART's encoder_attention_heads vs decoder_attention_heads; T5's d_kv is not D / H), so each attention module's
    own numbers are read where it has them (num_heads/n_heads/num_attention_heads, head_dim/key_value_proj_dim/
    attention_head_size), else the model's per kind."""
    info = adapter.info
    kind_of = {g: kind for kind, layers in (getattr(adapter, "kind_layers", None) or {}).items() for g in layers}
    heads, dims = [], []
    for layer, module in enumerate(attention_modules(adapter.model, adapter.layer_of)):
        decoder_side = kind_of.get(layer, "encoder") != "encoder"
        default_heads = (getattr(info, "decoder_heads", None) or info.heads) if decoder_side else info.heads
        n_heads = next((int(v) for v in (getattr(module, name, None) for name in
                                          ("num_heads", "n_heads", "num_attention_heads")) if isinstance(v, int)),
                       default_heads)
        head_dim = next((int(v) for v in (getattr(module, name, None) for name in
                                           ("head_dim", "key_value_proj_dim", "attention_head_size")) if isinstance(v, int)),
                        info.head_dim)
        heads.append(n_heads)
        dims.append(head_dim)
    return heads, dims


# ---- value norms kept with a run (windows, rows and overviews of long inputs) --------------------------------------
_grams: "weakref.WeakKeyDictionary[torch.nn.Module, list[torch.Tensor] | None]" = weakref.WeakKeyDictionary()
_grams_lock = threading.Lock()


def value_grams(adapter: AttentionAdapter) -> list[torch.Tensor] | None:
    """G_h = W_O^h W_O^hᵀ of every layer, (H, d_v, d_v) float64 on the model's device, once per model; None when
    the model's output projections are not found (value weighting is then not offered).

    ‖v_j W_O^h‖² = v_j G_h v_jᵀ: a run keeps its norms for H·T·d_v² work a layer instead of H·T·d_v·D, in float64
    because v G vᵀ sums terms of both signs (a small norm would lose its digits in float32)."""
    model = adapter.model
    with _grams_lock:
        if model not in _grams:
            try:
                projections = output_projections(model, adapter.layer_of, *layer_head_shapes(adapter))
            except ValueError:
                _grams[model] = None
            else:
                with torch.inference_mode():
                    _grams[model] = [torch.matmul(w.double(), w.double().transpose(-1, -2)) for w in projections]
        return _grams[model]


def kept_value_norms(atlas: Atlas | None) -> torch.Tensor | None:
    """The norms a run kept on its records, (L, H, T_k) float32 on the host; None when any layer has none."""
    return None if atlas is None else layer_value_norms(atlas, sorted(atlas.records))


def layer_value_norms(atlas: Atlas | None, layers: list[int]) -> torch.Tensor | None:
    """The kept norms of the given engine layers (one kind of an encoder–decoder: its keys are the same tokens),
    (l, H, T_k) float32 on the host; None when any of them has none."""
    if atlas is None:
        return None
    norms = [atlas.records[g].value_norms if g in atlas.records else None for g in layers]
    if any(n is None for n in norms):
        return None
    return torch.stack([n.cpu() for n in norms])


def value_weighted_rows(record: LayerRecord, heads: list[int], r0: int, r1: int, beta: float | None = None,
                        probs: torch.Tensor | None = None) -> torch.Tensor:
    """Rows r0 … r1 − 1 of the value-weighted maps of the given heads: P[i, j]·n_j over every key, renormalised per
    row. probs: those rows of P when the run kept them (h, r, T_k); else rebuilt from q̂/k̂ (at `beta` if given).
    → (h, r, T_k) float32."""
    if record.value_norms is None:
        raise ValueError("this run kept no value norms")
    if probs is None:
        probs = full_rows(record, heads, r0, r1, beta)  # (h, r, T_k)
    norms = record.value_norms[heads].to(probs.device, probs.dtype)  # (h, T_k)
    return value_weighted(probs, norms)


@torch.inference_mode()
def value_weighted_overview(atlas: Atlas, block_rows: int = 128,
                            layers: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The overview of the value-weighted maps of a long run: Σ over each overview block's cells (L, H, nR, nC), on
    the same edges as P's (Atlas.overview divides by the cells), and received (L, H, T_k) = Σ_i VW[i, j] / T_q.
    P is rebuilt block by block of rows from q̂/k̂ (no T × T map held, no model re-run): about the attention's own
    arithmetic once more. `layers`: engine layers of one shape (one kind of an encoder–decoder; default all)."""
    layers = sorted(atlas.records) if layers is None else layers
    sums, received = [], []
    for layer in layers:
        row_edges, col_edges = atlas.row_edges(layer), atlas.col_edges(layer)  # a kind's own queries and keys
        row_width, col_width = row_edges[1] - row_edges[0], col_edges[1] - col_edges[0]
        block = max(row_width, block_rows // row_width * row_width)  # blocks start on overview rows
        record = atlas.record(layer)
        heads = list(range(record.n_heads))
        n_queries, n_keys = record.queries.shape[1], record.keys.shape[1]
        device = record.queries.device
        layer_sums = torch.zeros(len(heads), len(row_edges) - 1, len(col_edges) - 1, device=device)  # (H, nR, nC)
        layer_received = torch.zeros(len(heads), n_keys, device=device)  # (H, T_k)
        padded_cols = -(-n_keys // col_width) * col_width
        for r0 in range(0, n_queries, block):
            r1 = min(n_queries, r0 + block)
            weighted = value_weighted_rows(record, heads, r0, r1)  # (H, r, T_k)
            layer_received += weighted.sum(dim=1)
            overview_rows = torch.arange(r0, r1, device=device) // row_width - r0 // row_width  # (r,)
            by_rows = weighted.new_zeros(len(heads), int(overview_rows[-1]) + 1, n_keys).index_add_(1, overview_rows, weighted)
            pooled = torch.nn.functional.pad(by_rows, (0, padded_cols - n_keys)).view(
                len(heads), by_rows.shape[1], padded_cols // col_width, col_width).sum(dim=-1)  # (H, nr, nC)
            first = r0 // row_width
            layer_sums[:, first:first + pooled.shape[1]] += pooled
        sums.append(layer_sums.cpu())
        received.append((layer_received / n_queries).cpu())
    return torch.stack(sums), torch.stack(received)
