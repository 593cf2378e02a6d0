"""Interventions on attention, as pure functions of tensors (docs/science.md §2–4).

One head at one layer: queries q (T_q × d), keys k (T_k × d), values v (T_k × d_v).
Raw scores S = q kᵀ (unscaled); P = softmax(β S + M) row-wise, M ∈ {0, −∞}.
Everything here works on a whole layer at once, vectorised over heads: (B, H, T, d).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from models.ops import OPS as OP_REGISTRY
from models.ops import LayerPlan
from models.recording import WITH_SCORES, AttentionRecorder

# the ops' names, in the registry's order (models/ops/__init__.py); what each op does is its Op's
OPS = tuple(OP_REGISTRY)


@dataclass(frozen=True)
class Intervention:
    """One item of a request's intervention list; `layers`/`heads` None means all. Which fields an op reads, and
    what it does, is its Op's (models/ops/)."""

    op: str
    layers: tuple[int, ...] | None = None
    heads: tuple[int, ...] | None = None
    beta: float | None = None  # temperature
    tokens: tuple[int, ...] | None = None  # mask_keys (required), perturb_*, patch_residual (None = all tokens)
    noise_std: float = 0.0  # perturb_*: σ of ε ~ N(0, σ² I_d)
    scale: float = 1.0  # perturb_*: α in k̂ = α k + ε
    seed: int = 0  # perturb_*: seeds the generator of ε; positions: seeds the shuffle's permutation
    mode: str = "zero"  # ablate_heads: "zero" (in the plan) or "mean" (on head outputs); positions: "off" | "shuffle"
    # patch_heads / patch_residual: the kept run whose head outputs / residual stream replace these (models/head_ops.py)
    source: str | None = None

    def __post_init__(self) -> None:
        if self.op not in OP_REGISTRY:
            raise ValueError(f"unknown intervention op {self.op!r}; expected one of {OPS}")
        OP_REGISTRY[self.op].validate(self)

    def applies_to_layer(self, layer: int) -> bool:
        if not OP_REGISTRY[self.op].scoped:  # acts before any layer (positions: on the embeddings)
            return False
        return self.layers is None or layer in self.layers

    def head_list(self, n_heads: int) -> list[int]:
        return list(range(n_heads)) if self.heads is None else list(self.heads)

    def with_seed_offset(self, offset: int) -> "Intervention":
        """The same intervention with its noise seed moved by `offset` (for samples > 1)."""
        if not OP_REGISTRY[self.op].reseeded or offset == 0:
            return self
        return Intervention(**{**self.__dict__, "seed": self.seed + offset})


# ε is drawn in blocks of NOISE_BLOCK positions, each from a generator seeded by (seed, layer, head, block):
# the ε of token position t is then the same whatever the sequence length, so a token keeps its ε as a
# continuation grows (KV cache or not, docs/science.md §9), and only the blocks that hold perturbed tokens are drawn.
NOISE_BLOCK = 64


def noise_for(seed: int, layer: int, head: int, positions: list[int], dim: int, std: float) -> torch.Tensor:
    """ε for the given token positions of one (layer, head), drawn on the CPU: (len(positions), d).

    A function of (seed, layer, head, position) only: the same on every device, every run and every
    sequence length; different heads, layers and positions get independent draws.
    """
    blocks = sorted({p // NOISE_BLOCK for p in positions})
    drawn = {}
    for block in blocks:
        generator = torch.Generator().manual_seed(hash((seed, layer, head, block)) & 0x7FFF_FFFF_FFFF_FFFF)
        drawn[block] = torch.randn(NOISE_BLOCK, dim, generator=generator, dtype=torch.float32)  # (NOISE_BLOCK, d)
    rows = [drawn[p // NOISE_BLOCK][p % NOISE_BLOCK] for p in positions]
    return torch.stack(rows) * std if rows else torch.zeros(0, dim)  # (n, d)


def perturb_vectors(x: torch.Tensor, iv: Intervention, layer: int, offset: int = 0) -> torch.Tensor:
    """x̂_t = α x_t + ε_t for the scoped heads and token positions. x: (B, H, T, d) → new tensor (B, H, T, d).

    Row r of x is token position `offset + r` (a decoding step with a KV cache sees only its new queries);
    positions the request names that are outside this window are not in this call and are left alone.
    """
    _, n_heads, n_tokens, dim = x.shape
    positions = range(offset, offset + n_tokens) if iv.tokens is None else [t for t in iv.tokens if offset <= t < offset + n_tokens]
    if any(t < 0 for t in positions):
        raise ValueError(f"{iv.op}: negative token index in {list(positions)}")
    positions = list(positions)
    if not positions:
        return x
    x = x.clone()
    idx = torch.tensor([t - offset for t in positions], device=x.device)
    for head in iv.head_list(n_heads):
        eps = noise_for(iv.seed, layer, head, positions, dim, iv.noise_std).to(x.device, x.dtype)  # (n, d)
        x[:, head, idx, :] = iv.scale * x[:, head, idx, :] + eps
    return x


def plan_layer(
    interventions: tuple[Intervention, ...], layer: int, n_heads: int, n_keys: int, native_beta: float
) -> LayerPlan:
    """What the interventions ask of one layer (models/ops/base.py LayerPlan): each applying item's Op adds its part,
    in request order."""
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
        OP_REGISTRY[iv.op].plan(iv, plan, heads, n_keys)
    return plan


def masked_softmax(
    logits: torch.Tensor, blocked: torch.Tensor, out: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row softmax with −∞ at `blocked`; a row with every key blocked is all zeros (never NaN).

    logits: (..., T_q, T_k); blocked: bool, broadcastable; out: where to write P (optional).
    Returns (P, dead_rows (..., T_q) bool).
    """
    probs, dead_rows, _ = _masked_softmax(logits, blocked, out)
    return probs, dead_rows


def _masked_softmax(
    logits: torch.Tensor, blocked: torch.Tensor, out: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """masked_softmax, also returning the masked logits (−∞ at `blocked`, (..., T_q, T_k)): the entropy takes each
    row's largest logit from them instead of masking the logits a second time."""
    # (..., T_q): from the mask as given (often (1, 1, T_q, T_k)), then broadcast: not a pass over every head's keys
    dead_rows = blocked.all(dim=-1).expand(logits.shape[:-1])
    masked = logits.masked_fill(blocked, float("-inf"))  # (..., T_q, T_k)
    probs = torch.softmax(masked, dim=-1, out=out)
    if probs.requires_grad:  # gradients through P (attribution patching): softmax's backward needs its output intact
        return probs.masked_fill(dead_rows.unsqueeze(-1), 0.0), dead_rows, masked
    # a row with every key masked is NaN until zeroed; on a CPU asking whether there is one is cheaper than a pass
    # over P (on a GPU the answer would make the host wait for the device: it always zeroes)
    if probs.device.type != "cpu" or bool(dead_rows.any()):
        probs.masked_fill_(dead_rows.unsqueeze(-1), 0.0)
    return probs, dead_rows, masked


def mean_row_entropy(logits: torch.Tensor, probs: torch.Tensor, blocked: torch.Tensor | None = None,
                     masked_logits: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over query rows of −Σ_j P log P, without a log per entry (one log per row).

    For P = softmax(z) over the allowed keys, log p_ij = z_ij − lse_i, so H_i = lse_i − Σ_j p_ij z_ij;
    and lse_i = max_j z_ij − log max_j p_ij (the largest logit has the largest probability). Blocked
    keys have p = 0 and drop out of the sum; a row with every key blocked counts as 0.
    logits, probs: (..., T_q, T_k) → (...); masked_logits: the logits with −∞ at `blocked` when the softmax made
    them already.
    """
    if masked_logits is None:
        masked_logits = logits if blocked is None else logits.masked_fill(blocked, float("-inf"))
    top_logit = masked_logits.amax(dim=-1)  # (..., T_q)
    top_prob = probs.amax(dim=-1)  # (..., T_q)
    entropy = top_logit - torch.log(top_prob) - torch.linalg.vecdot(probs, logits)  # (..., T_q)
    if blocked is not None:  # rows with every key blocked: top_prob = 0
        entropy = torch.where(top_prob > 0, entropy, torch.zeros_like(entropy))
    return entropy.clamp_min_(0.0).mean(dim=-1)


@dataclass(frozen=True)
class LogitExtras:
    """What a model's own eager attention adds to the scaled scores before the softmax (docs/science.md §9).

    The native logits are z₀ = softcap(β₀ Ŝ + bias) + mask_bias, with softcap(z) = c·tanh(z / c); a
    temperature β scales them all: z = (β / β₀)·z₀, which is β Ŝ for a model without extras. So β → ∞ is
    still one-hot on the largest logit and β → 0 uniform, for every model.
    """

    bias: torch.Tensor | None = None  # broadcastable to (B, H, T_q, T_k): relative position bias (T5), ALiBi, …
    softcap: float | None = None  # logit soft-capping (Gemma 2)
    mask_bias: torch.Tensor | None = None  # the finite part of an additive float mask, added after the cap

    @property
    def empty(self) -> bool:
        return self.bias is None and self.softcap is None and self.mask_bias is None

    def native_logits(self, scaled_scores: torch.Tensor) -> torch.Tensor:
        """z₀ = softcap(β₀ Ŝ + bias) + mask_bias from β₀ Ŝ (any shape the extras broadcast to)."""
        logits = scaled_scores
        if self.bias is not None:
            logits = logits + self.bias
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        if self.mask_bias is not None:
            logits = logits + self.mask_bias
        return logits


NO_EXTRAS = LogitExtras()


def attention_logits(
    query: torch.Tensor, key: torch.Tensor, beta: torch.Tensor | float, native_beta: float, extras: LogitExtras
) -> torch.Tensor:
    """z = (β / β₀)·z₀ (see LogitExtras). query: (B, H, T_q, d), key: (B, H, T_k, d), β: float or (1, H, 1, 1).

    Without extras β scales the (T × d) queries rather than the (T × T) scores: one pass less, and P comes
    out bit-identical whether or not Ŝ is recorded (effects compare runs made either way).
    """
    if extras.empty:
        return torch.matmul(query * beta, key.transpose(-1, -2))  # (B, H, T_q, T_k) β Ŝ
    logits = extras.native_logits(torch.matmul(query * native_beta, key.transpose(-1, -2)))  # (B, H, T_q, T_k) z₀
    if isinstance(beta, torch.Tensor) or beta != native_beta:
        logits = logits * (beta / native_beta)
    return logits


@dataclass(frozen=True)
class LayerCall:
    """What one call of a layer's attention is asked, beside its tensors: which layer it is, its native β₀, the
    request's interventions, what the model's eager attention adds to the logits (`extras`), and `query_offset`, the
    token position of query row 0 (a decoding step with a KV cache sees only its new queries; keys always start at
    position 0)."""

    layer: int
    native_beta: float
    interventions: tuple[Intervention, ...] = ()
    extras: LogitExtras = NO_EXTRAS
    query_offset: int = 0


def intervened_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    allowed: torch.Tensor | None,
    call: LayerCall,
    recorder: AttentionRecorder = WITH_SCORES,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """One attention layer with the interventions applied.

    query: (B, H, T_q, d), key: (B, H, T_k, d), value: (B, H, T_k, d_v) — K and V already repeated to the H
    query heads for grouped-query models, so every scope names query heads;
    allowed: the model's own mask, bool broadcastable to (B, H, T_q, T_k), True = may attend (None = all);
    call: the layer, β₀, interventions, logit extras and query offset (LayerCall).
    Returns (head outputs H = P V (B, H, T_q, d_v), P (B, H, T_q, T_k), Ŝ (B, H, T_q, T_k), dead rows (B, H, T_q)).

    `recorder` (models/recording.py) says what is recorded besides: P into a given buffer, Ŝ (None is returned for it
    when the recorder keeps no scores), each head's mean row entropy, q̂ and k̂ after perturbation.
    """
    _, n_heads, n_queries, _ = query.shape
    n_keys = key.shape[2]
    layer, native_beta, extras, query_offset = call.layer, call.native_beta, call.extras, call.query_offset
    if not any(iv.applies_to_layer(layer) for iv in call.interventions):
        recorder.record_qk(query, key)
        return _plain_attention(query, key, value, allowed, native_beta, extras, recorder)
    plan = plan_layer(call.interventions, layer, n_heads, n_keys, native_beta)
    for iv in plan.key_perturbations:
        key = perturb_vectors(key, iv, layer)
    for iv in plan.query_perturbations:
        query = perturb_vectors(query, iv, layer, offset=query_offset)
    recorder.record_qk(query, key)

    device = query.device
    beta = plan.beta.to(device, query.dtype)[None, :, None, None]  # (1, H, 1, 1)
    logits = attention_logits(query, key, beta, native_beta, extras)  # (B, H, T_q, T_k)
    scores = recorder.record_scores(query, key)  # Ŝ, unscaled
    blocked = None  # bool, broadcastable to (B, H, T_q, T_k); None = nothing masked (the fast path)
    if bool(plan.key_mask.any()):
        blocked = plan.key_mask.to(device)[None, :, None, :]  # (1, H, 1, T_k)
    if bool(plan.causal.any()):
        # query row i is token position query_offset + i; key column j is position j
        future = torch.ones(n_queries, n_keys, dtype=torch.bool, device=device).triu(1 + query_offset)  # (T_q, T_k)
        causal = plan.causal.to(device)[None, :, None, None] & future  # (1, H, T_q, T_k)
        blocked = causal if blocked is None else blocked | causal
    if allowed is not None and not _all_true_on_cpu(allowed):
        blocked = ~allowed if blocked is None else blocked | ~allowed
    probs, dead_rows, blocked = _softmax_recorded(logits, blocked, recorder)
    output = torch.matmul(probs.to(value.dtype), value)  # (B, H, T_q, d_v)
    if bool(plan.ablate.any()):
        output = output.masked_fill(plan.ablate.to(device)[None, :, None, None], 0.0)
    return output, probs, scores, dead_rows


def _all_true_on_cpu(allowed: torch.Tensor) -> bool:
    """True when a CPU mask allows everything (then the softmax skips masking: one T × T pass less). On a GPU the
    mask is always applied instead: reading the answer back would make the CPU wait for the GPU at every layer."""
    return allowed.device.type == "cpu" and bool(allowed.all())


def _softmax_recorded(
    logits: torch.Tensor, blocked: torch.Tensor | None, recorder: AttentionRecorder
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """P = softmax(logits) with `blocked` keys at −∞, written into the recorder's pattern buffer; the mean row
    entropy into its entropy buffer. Returns (P, dead rows (B, H, T_q), blocked expanded to the logits' shape or
    None)."""
    masked = logits
    if blocked is None:
        probs = torch.softmax(logits, dim=-1, out=recorder.pattern)
        dead_rows = torch.zeros(probs.shape[:-1], dtype=torch.bool, device=probs.device)  # (B, H, T_q)
    else:
        probs, dead_rows, masked = _masked_softmax(logits, blocked, out=recorder.pattern)  # (B, H, T_q, T_k)
        blocked = blocked.expand_as(logits)
    if recorder.entropy is not None:
        recorder.entropy.copy_(mean_row_entropy(logits, probs, blocked, masked_logits=masked))
    return probs, dead_rows, blocked


def _plain_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, allowed: torch.Tensor | None, native_beta: float,
    extras: LogitExtras, recorder: AttentionRecorder,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """intervened_attention for a layer no intervention touches: the same arithmetic (so P is bit-identical
    to the general path at β₀), with none of the per-head plan tensors; at 32 tokens those small
    operations cost about as much as the attention itself."""
    logits = attention_logits(query, key, native_beta, native_beta, extras)  # (B, H, T_q, T_k)
    scores = recorder.record_scores(query, key)
    blocked = None if allowed is None or _all_true_on_cpu(allowed) else ~allowed
    probs, dead_rows, _ = _softmax_recorded(logits, blocked, recorder)
    return torch.matmul(probs.to(value.dtype), value), probs, scores, dead_rows


def row_entropy(probs: torch.Tensor) -> torch.Tensor:
    """−Σ_j P log P per row (0 log 0 = 0). probs: (..., T_k) → (...)."""
    return -(probs * torch.log(probs.clamp_min(1e-30))).sum(dim=-1)
