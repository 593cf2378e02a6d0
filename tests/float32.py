"""How far apart two float32 computations of the same numbers may be.

Two float32 computations that sum the same terms in another order (another kernel, another thread count, blocks
instead of one matmul) differ by rounding alone: for a sum of n terms of size s, about eps32·√n·s for rounding errors
that behave like independent random signs, at most eps32·n·s (Higham, *Accuracy and Stability of Numerical
Algorithms*, 2nd ed., §2.8 and §4.2). A constant such as 1e-6 is crossed by a thread count on one machine and is loose
on another; this bound scales with the number of terms and with the values' size, so it stays tight and honest.
"""
from __future__ import annotations

import math

import numpy as np
import torch

EPS32 = float(torch.finfo(torch.float32).eps)  # 2⁻²³ ≈ 1.19e-7, float32's unit roundoff × 2


def f32_bound(n_terms: int, scale: float, c: float = 8.0) -> float:
    """c · eps32 · √n · scale: the rounding difference allowed between two float32 sums of n terms of size `scale`."""
    return c * EPS32 * math.sqrt(max(1, n_terms)) * scale


def assert_close_f32(actual, expected, n_terms: int, *, scale: float | None = None, c: float = 8.0) -> float:
    """Assert max |actual − expected| ≤ f32_bound(n_terms, scale, c); `scale` defaults to max |expected| (at least
    the smallest normal float32). n_terms: the most terms any one float32 reduction of the computation sums (for
    attention probabilities: the head size of q·k plus the keys of the softmax). Answers the largest difference."""
    actual, expected = _float64(actual), _float64(expected)
    assert actual.shape == expected.shape, (tuple(actual.shape), tuple(expected.shape))
    if scale is None:
        scale = max(float(expected.abs().max()) if expected.numel() else 0.0, float(torch.finfo(torch.float32).tiny))
    bound = f32_bound(n_terms, scale, c)
    worst = float((actual - expected).abs().max()) if actual.numel() else 0.0
    assert worst <= bound, f"max |Δ| {worst:.3e} > {bound:.3e} (= {c:g}·eps32·√{n_terms}·{scale:.3g})"
    return worst


def _float64(values) -> torch.Tensor:
    """A float64 copy of a tensor (detached: a reference built from weights may need grad), an array (a decoded
    buffer may be read-only) or a list of numbers."""
    if isinstance(values, torch.Tensor):
        return values.detach().to(torch.float64)
    return torch.from_numpy(np.array(values, dtype=np.float64))


def attention_terms(config, n_keys: int) -> int:
    """The most terms a float32 sum takes in computing one attention probability: q·k over the head size, then the
    softmax's normaliser over the keys (config: a transformers model config)."""
    config = getattr(config, "text_config", None) or config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return head_dim + n_keys
