"""Head patching over a set of (clean, corrupted) prompt pairs, and how well attribution ranks the heads
(docs/science.md "Patching over a set").

Each pair is scanned exactly as a single pair is (models/patching.baseline and head_scan, the same code), so the
set's mean effect of a head is the mean of the single-pair scans; its spread is their standard deviation.

Beside the exact scan, three first-order estimates of every head's effect, all from the pair's clean run, a
recorded corrupted run and one backward of LD on the corrupted run (g = ∂LD/∂z at the corrupted run, z = A v the
head's output before W_O, A its attention, v its values, S the scores that enter the softmax):

- `head_output`: g · (z_clean − z_corrupt), attribution patching on the head's output (Nanda 2023; Syed, Rager &
  Conmy 2023), the single-pair scan's `attribution`. The head itself is recomputed exactly; only what comes after
  it is linear.
- `atp`: attribution patching on the head's queries, keys and values: the change of the scores goes through the
  softmax's Jacobian at the corrupted run, ΔA ≈ A ⊙ (ΔS − Σ_j A ΔS), then g_A · ΔA + g_v · Δv with
  g_A = g vᵀ and g_v = Aᵀ g. Where the corrupted softmax saturates (a row near one-hot) the Jacobian is near 0
  and the estimate misses a head whose attention moves.
- `atp_star`: AtP*'s correction for that (Kramár, Lieberum, Shah & Nanda 2024, "AtP*: An efficient and scalable
  method for localizing LLM behaviour to components", the QK fix): the softmax is recomputed with the patched
  queries and keys — with the whole head patched that is the clean run's attention — so ΔA = A_clean − A_corrupt
  exactly, then g_A · ΔA + g_v · Δv. It differs from `head_output` by the cross term g · (ΔA Δv) only.
AtP*'s second part (GradDrop, for cancelling paths) is not done here.

Every estimate is divided by LD_clean − LD_corrupt, as the exact effect is.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from models.atlas import PendingRecord, _row_logits  # the scores the softmax took, masked cells −∞
from models.head_ops import HeadRun, current_sources, head_run
from models.hooks import RunScope, run_scope
from models.interventions import Intervention
from models.patching import Baseline, Pair, _attribution, _corrupt_gradients, baseline, head_scan, rank_correlation

Progress = Callable[[int, int], None]
Guard = Callable[[int], contextlib.AbstractContextManager]  # guard(tokens in the forward): held around a forward

ESTIMATES = ("head_output", "atp", "atp_star")


@dataclass
class LayerState:
    """One layer of one run, batch item 0: what the estimates need."""

    outputs: torch.Tensor  # (H, T, d_v) z, the heads' outputs before W_O
    values: torch.Tensor  # (H, T, d_v) v, one K/V head per query head
    scores: torch.Tensor  # (H, T, T) the softmax's input (β, extras and masks applied; masked cells −∞), float64
    probs: torch.Tensor  # (H, T, T) A = softmax(scores), masked rows 0, float64


def recorded_states(adapter, input_ids: torch.Tensor, interventions: tuple[Intervention, ...] = ()
                    ) -> tuple[list[LayerState], torch.Tensor]:
    """One recorded forward (no gradients) of one prompt (1, T): every layer's LayerState and the last logits (V,)."""
    outputs: dict[int, torch.Tensor] = {}
    values: dict[int, torch.Tensor] = {}
    scope = RunScope(layer_of=adapter.layer_of, interventions=interventions, record=True)
    with torch.inference_mode(), head_run(HeadRun(sources=current_sources(), record=outputs, values=values)), \
            run_scope(scope):
        ids = input_ids.to(adapter.device)
        out = adapter.model(input_ids=ids, attention_mask=torch.ones_like(ids), logits_to_keep=1, return_dict=True)
        states = []
        for layer in range(len(adapter.layer_of)):
            record = scope.records[layer]
            record = record.build() if isinstance(record, PendingRecord) else record
            n_heads, n_tokens = record.n_heads, record.queries.shape[1]
            scores, _, cols = _row_logits(record, list(range(n_heads)), 0, n_tokens, None)  # (H, T, c)
            scores = torch.nn.functional.pad(scores.double(), (0, n_tokens - cols), value=float("-inf"))  # (H, T, T)
            probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0)  # a row with every key masked: 0
            states.append(LayerState(outputs[layer][0].detach(), values[layer][0].detach(), scores, probs))
    return states, out.logits[0, -1].float()


def head_estimates(clean: LayerState, corrupt: LayerState, grad: torch.Tensor) -> dict[str, torch.Tensor]:
    """ΔLD estimates of patching each head of one layer whole, through its attention: `atp` (the softmax linear at
    the corrupted run) and `atp_star` (the softmax recomputed). grad: ∂LD/∂z at the corrupted run (H, T, d_v).
    → {name: (H,) float64}."""
    g = grad.double().to(corrupt.probs.device)  # (H, T, d_v)
    v_corrupt, v_clean = corrupt.values.double(), clean.values.double().to(g.device)  # (H, T, d_v)
    a_corrupt, a_clean = corrupt.probs, clean.probs.to(g.device)  # (H, T, T)
    grad_probs = g @ v_corrupt.transpose(-1, -2)  # (H, T, T) ∂LD/∂A
    grad_values = a_corrupt.transpose(-1, -2) @ g  # (H, T, d_v) ∂LD/∂v
    value_part = (grad_values * (v_clean - v_corrupt)).sum(dim=(-1, -2))  # (H,)
    s_clean, s_corrupt = clean.scores.to(g.device), corrupt.scores
    both = torch.isfinite(s_clean) & torch.isfinite(s_corrupt)
    delta_scores = torch.where(both, s_clean - s_corrupt, torch.zeros_like(s_corrupt))  # (H, T, T)
    # the softmax's Jacobian at the corrupted run applied to ΔS, row by row
    linear_probs = a_corrupt * (delta_scores - (a_corrupt * delta_scores).sum(dim=-1, keepdim=True))  # (H, T, T)
    return {
        "atp": (grad_probs * linear_probs).sum(dim=(-1, -2)) + value_part,
        "atp_star": (grad_probs * (a_clean - a_corrupt)).sum(dim=(-1, -2)) + value_part,
    }


def pair_estimates(adapter, pair: Pair, base: Baseline, interventions: tuple[Intervention, ...] = (),
                   guard: Guard = lambda _tokens: contextlib.nullcontext()) -> dict[str, torch.Tensor]:
    """The three estimates of every head's effect for one pair, as effects (÷ (LD_clean − LD_corrupt)):
    {name: (L, H) float32}. Two recorded forwards and one forward with a backward (the corrupted run's)."""
    n_tokens = pair.clean.shape[1]
    with guard(n_tokens):
        clean_states, _ = recorded_states(adapter, pair.clean, interventions)
    with guard(n_tokens):
        corrupt_states, _ = recorded_states(adapter, pair.corrupt, interventions)
    with guard(n_tokens):
        corrupt_outputs, grads, _ = _corrupt_gradients(adapter, pair, interventions)
    estimates = {"head_output": _attribution(base, corrupt_outputs, grads)}  # exactly the single scan's attribution
    per_layer = [head_estimates(c, x, g) for c, x, g in zip(clean_states, corrupt_states, grads)]
    for name in ("atp", "atp_star"):
        delta = torch.stack([layer[name] for layer in per_layer]).float().cpu()  # (L, H) ΔLD
        estimates[name] = base.effect(delta + base.ld_corrupt)
    return estimates


@dataclass
class PairScan:
    ld_clean: float
    ld_corrupt: float
    effect: torch.Tensor | None  # (L, H) the exact scan; None when only the estimates were asked for
    estimates: dict[str, torch.Tensor]  # name → (L, H)
    base: Baseline | None = field(default=None, repr=False)

    @property
    def defined(self) -> bool:
        """False when LD_clean = LD_corrupt: every effect of this pair is undefined (NaN)."""
        return self.ld_clean != self.ld_corrupt


def set_scan(adapter, pairs: list[Pair], interventions: tuple[Intervention, ...] = (), batch_tokens: int = 2048,
             exact: bool = True, progress: Progress | None = None,
             guard: Guard = lambda _tokens: contextlib.nullcontext()) -> list[PairScan]:
    """Every pair scanned as one pair is (baseline, then head_scan in batches of batch_tokens // T copies), and its
    estimates. Progress counts the patched heads of every pair and one step per pair's estimates."""
    n_cells = len(adapter.layer_of) * adapter.info.heads
    steps_per_pair = (n_cells if exact else 0) + 1
    total = steps_per_pair * len(pairs)
    scans = []
    for k, pair in enumerate(pairs):
        n_tokens = pair.clean.shape[1]
        batch = max(1, batch_tokens // n_tokens)
        offset = k * steps_per_pair
        with guard(n_tokens):
            base = baseline(adapter, pair, interventions)
        effect = None
        if exact:
            step = None if progress is None else (lambda done, _total, offset=offset: progress(offset + done, total))
            effect = head_scan(adapter, pair, base, interventions, batch, step,
                               guard=lambda batch=batch, n_tokens=n_tokens: guard(n_tokens * batch))
        estimates = pair_estimates(adapter, pair, base, interventions, guard)
        scans.append(PairScan(base.ld_clean, base.ld_corrupt, effect, estimates, base))
        if progress is not None:
            progress(offset + steps_per_pair, total)
    return scans


def mean_and_spread(per_pair: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and sample standard deviation (n − 1) over the pairs, per cell: (L, H) each; the spread of one pair
    is 0."""
    stacked = torch.stack(per_pair)  # (P, L, H)
    mean = stacked.mean(dim=0)
    spread = stacked.std(dim=0, correction=1) if len(per_pair) > 1 else torch.zeros_like(mean)
    return mean, spread


def top_k_overlap(exact: torch.Tensor, estimate: torch.Tensor, k: int) -> float:
    """|top-k heads by |exact effect| ∩ top-k by |estimate|| / k (k capped at the number of heads)."""
    k = min(k, exact.numel())
    chosen = lambda t: set(t.flatten().abs().nan_to_num(0.0).topk(k).indices.tolist())  # noqa: E731
    return len(chosen(exact) & chosen(estimate)) / k if k else math.nan


def agreement(exact: torch.Tensor, estimate: torch.Tensor, k: int) -> dict[str, float]:
    """How well an estimate ranks the heads against the exact scan: Spearman's ρ (signed values) and the top-k
    overlap (by magnitude)."""
    return {"spearman": rank_correlation(exact.nan_to_num(0.0), estimate.nan_to_num(0.0)),
            "top_k_overlap": top_k_overlap(exact, estimate, k), "k": min(k, exact.numel())}
