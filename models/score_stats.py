"""The scale's statistics on a real head, and the attention's parameter count (docs/science.md "Why the scale is
1/√d" and "Counting the attention's parameters").

For one (layer, head) of a run: the raw scores s_ij = q_i · k_j (unscaled, after RoPE where the model has it) over
every pair the model's own mask allows (all pairs for an encoder; j ≤ i for a decoder; within the window for a
sliding-window layer); their histogram, mean and variance; the theory for independent Gaussian entries fitted with
the head's own q and k; and the rows' softmax entropy at scale 1, at 1/√d and at the model's own β₀.

The theory. For q, k ∈ R^d with independent entries q_m ~ N(μ_q, σ_q²), k_m ~ N(μ_k, σ_k²), all independent:
  E[qᵀk] = d μ_q μ_k,   Var(qᵀk) = d (σ_q² σ_k² + μ_q² σ_k² + μ_k² σ_q²)
(each term q_m k_m has mean μ_q μ_k and variance E[q_m²] E[k_m²] − μ_q² μ_k²; the d terms are independent). With
μ_q = μ_k = μ and σ_q = σ_k = σ this is the textbook's E = dμ², Var = d(σ⁴ + 2μ²σ²). μ_q, σ_q are the mean and
standard deviation of all T·d entries of the head's queries (likewise keys); the pooled form fits one μ, σ to the
queries' and keys' entries together. Real heads break the independence (the same q_i meets every k_j, entries of
one vector are correlated), which is why the measured variance differs from the theory.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import nn

from models.anatomy import attention_modules

DEFAULT_BINS = 40


def allowed_pairs(n_tokens: int, causal: bool, window: int | None = None) -> torch.Tensor:
    """The pairs (i, j) the model's own mask allows: (T, T) bool."""
    allowed = torch.ones(n_tokens, n_tokens, dtype=torch.bool)
    if causal:
        allowed = allowed.tril()
        if window is not None:  # a sliding-window layer: i − j < window
            allowed &= ~allowed.tril(-window)
    return allowed


def gaussian_theory(dim: int, mean_q: float, std_q: float, mean_k: float, std_k: float) -> dict[str, float]:
    """E and Var of qᵀk for independent N(μ_q, σ_q²) and N(μ_k, σ_k²) entries of dimension d (module docstring)."""
    var_q, var_k = std_q**2, std_k**2
    variance = dim * (var_q * var_k + mean_q**2 * var_k + mean_k**2 * var_q)
    return {"mean": dim * mean_q * mean_k, "variance": variance, "std": math.sqrt(variance)}


def mean_row_entropy(scores: torch.Tensor, allowed: torch.Tensor, scale: float) -> float:
    """Mean over query rows of −Σ_j p_ij ln p_ij, p_i = softmax over the allowed j of scale·s_ij (nats)."""
    logits = (scores * scale).masked_fill(~allowed, float("-inf"))  # (T, T)
    log_p = torch.log_softmax(logits, dim=-1)
    probs = log_p.exp()
    return float((-(torch.where(allowed, probs * log_p, torch.zeros_like(probs))).sum(dim=-1)).mean())


def score_stats(queries: torch.Tensor, keys: torch.Tensor, allowed: torch.Tensor, native_beta: float,
                bins: int = DEFAULT_BINS) -> dict[str, Any]:
    """The statistics of one head. queries, keys: (T, d) as the attention function received them (after RoPE);
    allowed: (T, T) bool; native_beta: the model's own β₀."""
    q, k = queries.detach().double().cpu(), keys.detach().double().cpu()
    dim = q.shape[-1]
    scores = q @ k.T  # (T, T) raw q·k
    values = scores[allowed].numpy()  # (n_pairs,)
    counts, edges = np.histogram(values, bins=bins)
    q_np, k_np = q.numpy(), k.numpy()
    pooled = np.concatenate([q_np.ravel(), k_np.ravel()])
    fitted = {"mean_q": float(q_np.mean()), "std_q": float(q_np.std()), "mean_k": float(k_np.mean()),
              "std_k": float(k_np.std())}
    pooled_fit = {"mean": float(pooled.mean()), "std": float(pooled.std())}
    row_max = scores.masked_fill(~allowed, float("-inf")).amax(dim=-1)  # (T,)
    row_min = scores.masked_fill(~allowed, float("inf")).amin(dim=-1)
    return {
        "head_dim": dim, "pairs": int(values.size),
        "histogram": {"edges": edges.tolist(), "counts": counts.tolist()},
        "mean": float(values.mean()), "variance": float(values.var()), "std": float(values.std()),
        "theory": {
            "form": "independent entries: E = d μ_q μ_k, Var = d(σ_q²σ_k² + μ_q²σ_k² + μ_k²σ_q²)",
            "fit": fitted, **gaussian_theory(dim, fitted["mean_q"], fitted["std_q"], fitted["mean_k"], fitted["std_k"]),
            "pooled": {"form": "one μ, σ for q and k: E = dμ², Var = d(σ⁴ + 2μ²σ²)", "fit": pooled_fit,
                       **gaussian_theory(dim, pooled_fit["mean"], pooled_fit["std"], pooled_fit["mean"],
                                         pooled_fit["std"])},
        },
        "entropy": {
            "unit": "nats",
            "scale_1": mean_row_entropy(scores, allowed, 1.0),
            "scale_inv_sqrt_d": mean_row_entropy(scores, allowed, dim**-0.5),
            "native": mean_row_entropy(scores, allowed, native_beta),
            "uniform": float(torch.log(allowed.sum(dim=-1).double()).mean()),  # the most a row can have
        },
        "native_beta": native_beta,
        # how far apart a row's scores lie: the softmax saturates when scale × spread ≫ 1
        "mean_row_spread": float((row_max - row_min).mean()),
    }


def _linear_shape(module: nn.Module) -> tuple[int, ...] | None:
    weight = getattr(module, "weight", None)
    return tuple(weight.shape) if isinstance(weight, torch.Tensor) else None


def _attention_tensors(module: nn.Module, parent: nn.Module | None) -> dict[str, tuple[int, ...]]:
    """Every parameter of one attention module (q/k/v and, where it holds it, the output projection and q/k norms),
    plus BERT/ViT's output projection kept beside it (`output.dense` of the parent): name → shape."""
    tensors = {name: tuple(p.shape) for name, p in module.named_parameters()}
    if not any(name.split(".")[0] in ("o_proj", "out_proj", "c_proj", "o", "dense") for name in tensors):
        dense = getattr(getattr(parent, "output", None), "dense", None)
        for name, p in (dense.named_parameters() if dense is not None else ()):
            tensors[f"output.dense.{name}"] = tuple(p.shape)
    return tensors


def attention_counting(model: nn.Module, layer_of: dict[int, int], d_model: int, n_heads: int, kv_heads: int,
                       head_dim: int) -> dict[str, Any]:
    """The textbook's count of one layer's attention parameters (4D² weights: 3D² for W_Q, W_K, W_V and D² for W_O;
    4D biases), beside the model's real tensors of layer 0 and the total over its layers."""
    parents = {id(child): module for module in model.modules() for child in module.children()}
    modules = attention_modules(model, layer_of)
    per_layer = [_attention_tensors(m, parents.get(id(m))) for m in modules]
    first = per_layer[0]
    sizes = [sum(math.prod(shape) for shape in layer.values()) for layer in per_layer]
    weights = sum(math.prod(s) for name, s in first.items() if len(s) == 2)
    biases = sum(math.prod(s) for name, s in first.items() if len(s) == 1 and name.endswith("bias"))
    return {
        "d_model": d_model, "heads": n_heads, "kv_heads": kv_heads, "head_dim": head_dim, "layers": len(modules),
        "textbook": {"weights": 4 * d_model**2, "biases": 4 * d_model, "qkv_weights": 3 * d_model**2,
                     "output_weights": d_model**2},
        "layer0": {"tensors": [{"name": n, "shape": list(s)} for n, s in first.items()], "weights": weights,
                   "biases": biases, "other": sizes[0] - weights - biases},
        "total_parameters": sum(sizes),
    }


def map_counting(n_tokens: int, n_layers: int, n_heads: int, allowed: int) -> dict[str, int]:
    """Attention weights of one input: N² per head (of which `allowed` may be non-zero), per layer and in all."""
    return {"tokens": n_tokens, "per_head": n_tokens**2, "allowed_per_head": allowed,
            "per_layer": n_heads * n_tokens**2, "total": n_layers * n_heads * n_tokens**2}
