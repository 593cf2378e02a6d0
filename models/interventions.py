"""Interventions on attention, as pure functions of tensors (SPEC §2–4).

One head at one layer: queries q (T_q × d), keys k (T_k × d), values v (T_k × d_v).
Raw scores S = q kᵀ (unscaled); P = softmax(β S + M) row-wise, M ∈ {0, −∞}.
Everything here works on a whole layer at once, vectorised over heads: (B, H, T, d).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

OPS = ("temperature", "mask_keys", "causal", "ablate_heads", "perturb_keys", "perturb_queries")


@dataclass(frozen=True)
class Intervention:
    """One item of a request's intervention list; `layers`/`heads` None means all."""

    op: str
    layers: tuple[int, ...] | None = None
    heads: tuple[int, ...] | None = None
    beta: float | None = None  # temperature
    tokens: tuple[int, ...] | None = None  # mask_keys (required), perturb_* (None = all tokens)
    noise_std: float = 0.0  # perturb_*: σ of ε ~ N(0, σ² I_d)
    scale: float = 1.0  # perturb_*: α in k̂ = α k + ε
    seed: int = 0  # perturb_*: seeds the generator of ε

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"unknown intervention op {self.op!r}; expected one of {OPS}")
        if self.op == "temperature" and not (self.beta is not None and math.isfinite(self.beta) and self.beta > 0):
            raise ValueError(f"temperature needs a finite beta > 0, got {self.beta!r}")
        if self.op == "mask_keys" and self.tokens is None:
            raise ValueError("mask_keys needs a list of tokens")

    def applies_to_layer(self, layer: int) -> bool:
        return self.layers is None or layer in self.layers

    def head_list(self, n_heads: int) -> list[int]:
        return list(range(n_heads)) if self.heads is None else list(self.heads)

    def with_seed_offset(self, offset: int) -> "Intervention":
        """The same intervention with its noise seed moved by `offset` (for samples > 1)."""
        if self.op not in ("perturb_keys", "perturb_queries") or offset == 0:
            return self
        return Intervention(**{**self.__dict__, "seed": self.seed + offset})


def noise_for(seed: int, layer: int, head: int, n_tokens: int, dim: int, std: float) -> torch.Tensor:
    """ε for one (layer, head): drawn on the CPU from a generator seeded by (seed, layer, head).

    Same request → same ε on every device and every run; different heads get independent draws.
    """
    generator = torch.Generator().manual_seed(hash((seed, layer, head)) & 0x7FFF_FFFF_FFFF_FFFF)
    return torch.randn(n_tokens, dim, generator=generator, dtype=torch.float32) * std  # (n, d)


def perturb_vectors(x: torch.Tensor, iv: Intervention, layer: int) -> torch.Tensor:
    """x̂_j = α x_j + ε for the scoped heads and tokens. x: (B, H, T, d) → new tensor (B, H, T, d)."""
    _, n_heads, n_tokens, dim = x.shape
    tokens = list(range(n_tokens)) if iv.tokens is None else list(iv.tokens)
    if any(t < 0 or t >= n_tokens for t in tokens):
        raise ValueError(f"{iv.op}: token index out of range 0..{n_tokens - 1}: {tokens}")
    if not tokens:
        return x
    x = x.clone()
    idx = torch.tensor(tokens, device=x.device)
    for head in iv.head_list(n_heads):
        eps = noise_for(iv.seed, layer, head, len(tokens), dim, iv.noise_std).to(x.device, x.dtype)  # (n, d)
        x[:, head, idx, :] = iv.scale * x[:, head, idx, :] + eps
    return x


@dataclass
class LayerPlan:
    """What the interventions ask of one layer, gathered once before the scores are formed."""

    beta: torch.Tensor  # (H,) inverse temperature per head
    key_mask: torch.Tensor  # (H, T_k) bool, True = masked key
    causal: torch.Tensor  # (H,) bool
    ablate: torch.Tensor  # (H,) bool
    key_perturbations: list[Intervention] = field(default_factory=list)
    query_perturbations: list[Intervention] = field(default_factory=list)


def plan_layer(
    interventions: tuple[Intervention, ...], layer: int, n_heads: int, n_keys: int, native_beta: float
) -> LayerPlan:
    plan = LayerPlan(
        beta=torch.full((n_heads,), float(native_beta)),
        key_mask=torch.zeros(n_heads, n_keys, dtype=torch.bool),
        causal=torch.zeros(n_heads, dtype=torch.bool),
        ablate=torch.zeros(n_heads, dtype=torch.bool),
    )
    for iv in interventions:
        if not iv.applies_to_layer(layer):
            continue
        heads = iv.head_list(n_heads)
        if any(h < 0 or h >= n_heads for h in heads):
            raise ValueError(f"{iv.op}: head index out of range 0..{n_heads - 1}: {heads}")
        if iv.op == "temperature":
            plan.beta[heads] = float(iv.beta)  # later items override earlier ones
        elif iv.op == "mask_keys":
            tokens = list(iv.tokens or ())
            if any(t < 0 or t >= n_keys for t in tokens):
                raise ValueError(f"mask_keys: token index out of range 0..{n_keys - 1}: {tokens}")
            for h in heads:
                plan.key_mask[h, tokens] = True
        elif iv.op == "causal":
            plan.causal[heads] = True
        elif iv.op == "ablate_heads":
            plan.ablate[heads] = True
        elif iv.op == "perturb_keys":
            plan.key_perturbations.append(iv)
        elif iv.op == "perturb_queries":
            plan.query_perturbations.append(iv)
    return plan


def masked_softmax(
    logits: torch.Tensor, blocked: torch.Tensor, out: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row softmax with −∞ at `blocked`; a row with every key blocked is all zeros (never NaN).

    logits: (..., T_q, T_k); blocked: bool, broadcastable; out: where to write P (optional).
    Returns (P, dead_rows (..., T_q) bool).
    """
    blocked = blocked.expand_as(logits)
    dead_rows = blocked.all(dim=-1)  # (..., T_q)
    probs = torch.softmax(logits.masked_fill(blocked, float("-inf")), dim=-1, out=out)
    probs.masked_fill_(dead_rows.unsqueeze(-1), 0.0)
    return probs, dead_rows


def mean_row_entropy(logits: torch.Tensor, probs: torch.Tensor, blocked: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over query rows of −Σ_j P log P, without a log per entry (one log per row).

    For P = softmax(z) over the allowed keys, log p_ij = z_ij − lse_i, so H_i = lse_i − Σ_j p_ij z_ij;
    and lse_i = max_j z_ij − log max_j p_ij (the largest logit has the largest probability). Blocked
    keys have p = 0 and drop out of the sum; a row with every key blocked counts as 0.
    logits, probs: (..., T_q, T_k) → (...)
    """
    top_logit = (logits if blocked is None else logits.masked_fill(blocked, float("-inf"))).amax(dim=-1)  # (..., T_q)
    top_prob = probs.amax(dim=-1)  # (..., T_q)
    entropy = top_logit - torch.log(top_prob) - torch.linalg.vecdot(probs, logits)  # (..., T_q)
    if blocked is not None:  # rows with every key blocked: top_prob = 0
        entropy = torch.where(top_prob > 0, entropy, torch.zeros_like(entropy))
    return entropy.clamp_min_(0.0).mean(dim=-1)


def intervened_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    allowed: torch.Tensor | None,
    *,
    layer: int,
    native_beta: float,
    interventions: tuple[Intervention, ...] = (),
    need_scores: bool = True,
    probs_out: torch.Tensor | None = None,
    scores_out: torch.Tensor | None = None,
    entropy_out: torch.Tensor | None = None,
    qk_out: list | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """One attention layer with the interventions applied.

    query: (B, H, T_q, d), key: (B, H, T_k, d), value: (B, H, T_k, d_v);
    allowed: the model's own mask, bool broadcastable to (B, H, T_q, T_k), True = may attend (None = all).
    Returns (head outputs H = P V (B, H, T_q, d_v), P (B, H, T_q, T_k), Ŝ (B, H, T_q, T_k), dead rows (B, H, T_q)).

    With `need_scores=False`, Ŝ is not formed (None is returned for it). For recording a run, P is written into
    `probs_out` and Ŝ into `scores_out` when given (slices of one (L, …) buffer, so a run's maps need
    no copy at the end), and `entropy_out` (B, H) receives the mean row entropy while the logits are
    at hand. `qk_out` (a list) receives (q̂, k̂), the queries and keys after perturbation: Ŝ = q̂ k̂ᵀ of
    any head can be formed later from those T × d matrices instead of keeping every T × T one.
    """
    _, n_heads, n_queries, _ = query.shape
    n_keys = key.shape[2]
    if not any(iv.applies_to_layer(layer) for iv in interventions):
        if qk_out is not None:
            qk_out.extend((query, key))
        return _plain_attention(query, key, value, allowed, native_beta, need_scores, probs_out, scores_out, entropy_out)
    plan = plan_layer(interventions, layer, n_heads, n_keys, native_beta)
    for iv in plan.key_perturbations:
        key = perturb_vectors(key, iv, layer)
    for iv in plan.query_perturbations:
        query = perturb_vectors(query, iv, layer)
    if qk_out is not None:
        qk_out.extend((query, key))

    device = query.device
    beta = plan.beta.to(device, query.dtype)[None, :, None, None]  # (1, H, 1, 1)
    # β scales the (T × d) queries rather than the (T × T) scores: one pass less, and P comes out
    # bit-identical whether or not Ŝ is recorded (effects compare runs made either way).
    logits = torch.matmul(query * beta, key.transpose(-1, -2))  # (B, H, T_q, T_k) β Ŝ
    scores = torch.matmul(query, key.transpose(-1, -2), out=scores_out) if need_scores else None  # Ŝ, unscaled
    blocked = None  # bool, broadcastable to (B, H, T_q, T_k); None = nothing masked (the fast path)
    if bool(plan.key_mask.any()):
        blocked = plan.key_mask.to(device)[None, :, None, :]  # (1, H, 1, T_k)
    if bool(plan.causal.any()):
        future = torch.ones(n_queries, n_keys, dtype=torch.bool, device=device).triu(1)  # (T_q, T_k)
        causal = plan.causal.to(device)[None, :, None, None] & future  # (1, H, T_q, T_k)
        blocked = causal if blocked is None else blocked | causal
    if allowed is not None and not bool(allowed.all()):
        blocked = ~allowed if blocked is None else blocked | ~allowed
    if blocked is None:
        probs = torch.softmax(logits, dim=-1, out=probs_out)
        dead_rows = torch.zeros(probs.shape[:-1], dtype=torch.bool, device=device)  # (B, H, T_q)
    else:
        probs, dead_rows = masked_softmax(logits, blocked, out=probs_out)  # (B, H, T_q, T_k)
        blocked = blocked.expand_as(logits)
    if entropy_out is not None:
        entropy_out.copy_(mean_row_entropy(logits, probs, blocked))
    output = torch.matmul(probs.to(value.dtype), value)  # (B, H, T_q, d_v)
    if bool(plan.ablate.any()):
        output = output.masked_fill(plan.ablate.to(device)[None, :, None, None], 0.0)
    return output, probs, scores, dead_rows


def _plain_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, allowed: torch.Tensor | None, native_beta: float,
    need_scores: bool, probs_out: torch.Tensor | None, scores_out: torch.Tensor | None, entropy_out: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """intervened_attention for a layer no intervention touches: the same arithmetic (so P is bit-identical
    to the general path at β₀), with none of the per-head plan tensors; at 32 tokens those small
    operations cost about as much as the attention itself."""
    logits = torch.matmul(query * native_beta, key.transpose(-1, -2))  # (B, H, T_q, T_k) β₀ Ŝ
    scores = torch.matmul(query, key.transpose(-1, -2), out=scores_out) if need_scores else None
    blocked = None if allowed is None or bool(allowed.all()) else ~allowed
    if blocked is None:
        probs = torch.softmax(logits, dim=-1, out=probs_out)
        dead_rows = torch.zeros(probs.shape[:-1], dtype=torch.bool, device=probs.device)  # (B, H, T_q)
    else:
        probs, dead_rows = masked_softmax(logits, blocked, out=probs_out)
        blocked = blocked.expand_as(logits)
    if entropy_out is not None:
        entropy_out.copy_(mean_row_entropy(logits, probs, blocked))
    return torch.matmul(probs.to(value.dtype), value), probs, scores, dead_rows


def softmax_jacobian(scores: torch.Tensor, beta: float = 1.0) -> torch.Tensor:
    """∂P/∂s for one row: β (diag(p) − p pᵀ). scores: (n,) → (n, n)."""
    p = torch.softmax(beta * scores, dim=-1)  # (n,)
    return beta * (torch.diag(p) - torch.outer(p, p))


def row_entropy(probs: torch.Tensor) -> torch.Tensor:
    """−Σ_j P log P per row (0 log 0 = 0). probs: (..., T_k) → (...)."""
    return -(probs * torch.log(probs.clamp_min(1e-30))).sum(dim=-1)
