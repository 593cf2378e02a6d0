"""Attention while a decoder writes (docs/science.md §9): the row of the query that produced each new token, for the
asked layers and heads, taken from the decoding forward itself (through the KV cache, one query per step).

At step s of a continuation of a P-token prompt the row has P + s keys and its query is position P + s − 1 (step 0's
row is the prompt's last position). It is the P the model used, interventions included: masked keys are exactly 0,
β and ablations apply. With `top_k` a row is sent as its k largest probabilities and the row's exact log-sum-exp of
the logits z (the scaled scores with masks at −∞), so any other key's probability is exp(z_j − lse), z_j from a
window of the kept run.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from models.atlas import LayerRecord, PendingRecord, full_rows, row_logits
from models.interventions import Intervention, LogitExtras


@dataclass(frozen=True)
class RowRequest:
    """Which rows a continuation sends: layers and heads (None = all), and top_k (None = whole rows)."""

    layers: tuple[int, ...] | None = None
    heads: tuple[int, ...] | None = None
    top_k: int | None = None

    def check(self, n_layers: int, n_heads: int) -> None:
        """ValueError naming the field for an index out of range or a top_k under 1."""
        for name, values, n in (("layers", self.layers, n_layers), ("heads", self.heads, n_heads)):
            bad = [v for v in values or () if not 0 <= v < n]
            if bad:
                raise ValueError(f"attention.{name}: {bad} out of range 0..{n - 1}")
            if values is not None and len(set(values)) != len(values):
                raise ValueError(f"attention.{name}: an index is named twice")
            if values is not None and not values:
                raise ValueError(f"attention.{name}: empty (null means all)")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"attention.top_k: must be at least 1, got {self.top_k}")


@dataclass
class StepRows:
    """Set on a decoding forward's RunScope: collects the last query's row of each asked layer. `request` None asks
    for nothing (a plain stream: only a long prompt's blockwise records are dropped as each layer ends)."""

    request: RowRequest | None
    n_layers: int
    n_heads: int
    rows: dict[int, torch.Tensor] = field(default_factory=dict)  # layer → (h, T_k) float32
    lse: dict[int, torch.Tensor] = field(default_factory=dict)  # layer → (h,) float32, with top_k

    @property
    def layers(self) -> list[int]:
        if self.request is None:
            return []
        return list(range(self.n_layers)) if self.request.layers is None else list(self.request.layers)

    @property
    def heads(self) -> list[int]:
        return list(range(self.n_heads)) if self.request is None or self.request.heads is None else list(self.request.heads)

    @property
    def needs_lse(self) -> bool:
        return self.request is not None and self.request.top_k is not None

    def wants(self, layer: int) -> bool:
        return self.request is not None and (self.request.layers is None or layer in self.request.layers)

    def take_probs(self, layer: int, probs: torch.Tensor, queries_keys: list, allowed: torch.Tensor | None,
                   extras: LogitExtras, native_beta: float, interventions: tuple[Intervention, ...],
                   query_offset: int) -> None:
        """From a layer's forward: P (B, H, T_q, T_k) as the model used it; with top_k the lse of its last row, from
        the q̂ k̂ᵀ the forward recorded (queries_keys: [q̂ (B, H, T_q, d), k̂ (B, H, T_k, d)])."""
        heads = self.heads
        self.rows[layer] = probs[0, heads, -1].float()  # (h, T_k)
        if not self.needs_lse:
            return
        query, key = queries_keys
        last = query.shape[2] - 1
        if extras.empty and not any(iv.applies_to_layer(layer) for iv in interventions):
            # the common case, without a record: lse = z_j* − log p_j* at the row's most attended key j*, z = β₀ q̂·k̂
            top_prob, top_key = self.rows[layer].max(dim=-1)  # (h,)
            picked = key[0, heads, top_key].float()  # (h, d): head i's key at its own j*
            z = (query[0, heads, last].float() * native_beta * picked).sum(dim=-1)  # (h,)
            self.lse[layer] = z - torch.log(top_prob)
            return

        def cut(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[:1, ..., last:, :]  # batch item 0, the last query row

        record = PendingRecord(
            queries=query[0, :, last:], keys=key[0], allowed=None if allowed is None else allowed[0][..., last:, :],
            extras=LogitExtras(bias=cut(extras.bias), softcap=extras.softcap, mask_bias=cut(extras.mask_bias)),
            native_beta=native_beta, interventions=interventions, layer=layer, query_offset=query_offset + last,
        ).build()
        self.lse[layer] = _lse(record, heads, 0)

    def take_record(self, layer: int, record: LayerRecord) -> None:
        """From a blockwise (long prompt) layer: its last row rebuilt from the layer's record, as a window is."""
        row = record.queries.shape[1] - 1
        self.rows[layer] = full_rows(record, self.heads, row, row + 1)[:, 0]  # (h, T_k)
        if self.needs_lse:
            self.lse[layer] = _lse(record, self.heads, row)

    def result(self) -> dict | None:
        """What one step sends: {"rows": (l, h, T_k)} or, with top_k, {"indices", "values": (l, h, k), "lse": (l, h)};
        None when nothing was asked."""
        layers = self.layers
        if not layers:
            return None
        rows = torch.stack([self.rows[l] for l in layers])  # (l, h, T_k)
        if not self.needs_lse:
            return {"rows": rows}
        top = torch.topk(rows, min(self.request.top_k, rows.shape[-1]), dim=-1)
        return {"indices": top.indices, "values": top.values, "lse": torch.stack([self.lse[l] for l in layers])}


@torch.inference_mode()
def _lse(record: LayerRecord, heads: list[int], row: int) -> torch.Tensor:
    """log Σ_j exp z_j of one row over all its keys (masked keys at −∞): (h,). A row with every key masked: −∞."""
    z, _, _ = row_logits(record, heads, row, row + 1)  # (h, 1, c)
    return torch.logsumexp(z[:, 0], dim=-1)
