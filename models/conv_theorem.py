"""The attention-as-convolution theorem (docs/science.md §7, Cordonnier, Loukas & Jaggi, ICLR 2020), numerically.

A multi-head self-attention layer with K^2 Gaussian heads, head h centred on the kernel shift
d * s_h (s_h in Delta_K = {-floor(K/2) .. floor((K-1)/2)}^2), with W^(h) = W_v^(h) W_out^(h) set to the
kernel slice W[:, :, s_h] and b_out = b, computes

    MHSA(Z)_p = sum_h sum_k softmax_k(-alpha ||(k - p) - d s_h||^2) Z_k W_(s_h) + b
              -> sum_s Z_(p + d s) W_s + b = Conv(Z)_p     as alpha -> inf (error ~ e^-alpha).

Where p + d s leaves the image the head cannot attend there: padding the token grid with zero tokens
(width d*floor(K/2)) makes the layer equal the zero-padded ("same") convolution everywhere; without
padding only pixels whose whole receptive field is inside the image match.

Everything is float64 with the row maximum subtracted before exp, so alpha up to 1e6 is exact to
round-off. The Gaussian pattern factorises over rows and columns (the token grid is a rectangle), so
each head is applied as two small matrix products instead of one (T, T) matrix: a 64x64 image with
dilation 8 stays cheap. Pure functions, no HTTP.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

STRIDE_NOTE = (
    "Stride is not expressible: attention gives exactly one output per query pixel, so a strided "
    "convolution is the stride-1 convolution followed by subsampling, and attention alone does not subsample."
)


def kernel_shifts(kernel_size: int) -> list[tuple[int, int]]:
    """Delta_K in the order of the kernel's (i, j) indices: s = (i - floor(K/2), j - floor(K/2))."""
    half = kernel_size // 2
    return [(i - half, j - half) for i in range(kernel_size) for j in range(kernel_size)]


def same_conv(images: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, dilation: int = 1) -> torch.Tensor:
    """Zero-padded ("same") convolution: (C_in, n, m) -> (C_out, n, m). Pads d*floor(K/2) before and
    d*floor((K-1)/2) after, so even K works too (for odd K this is conv2d(padding=d*(K//2)))."""
    K = weight.shape[-1]
    before, after = dilation * (K // 2), dilation * ((K - 1) // 2)
    padded = F.pad(images[None], (before, after, before, after))                # (1, C_in, n+.., m+..)
    return F.conv2d(padded, weight, bias, dilation=dilation)[0]                 # (C_out, n, m)


def _axis_probs(length: int, centers: torch.Tensor, alpha: float) -> torch.Tensor:
    """softmax over key positions k of -alpha (k - q - center_h)^2 for every head h and query q."""
    pos = torch.arange(length, dtype=torch.float64)
    shift = pos[None, :] - pos[:, None]                                        # (L, L) [q, k]: k - q
    scores = -alpha * (shift[None] - centers[:, None, None]) ** 2              # (H, L, L)
    return torch.softmax(scores, dim=-1)                                       # (H, L, L), max subtracted inside


def mhsa_from_kernel(images: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, alpha: float,
                     dilation: int = 1, padding: str = "zeros") -> torch.Tensor:
    """The theorem's K^2-head attention layer built from a (C_out, C_in, K, K) kernel, applied to
    (C_in, n, m) images -> (C_out, n, m). padding "zeros": the token grid gets a border of zero tokens of
    width d*floor(K/2); "none": the tokens are the image pixels only."""
    if padding not in ("zeros", "none"):
        raise ValueError(f"padding must be 'zeros' or 'none', got {padding!r}")
    K = weight.shape[-1]
    n, m = images.shape[-2:]
    width = dilation * (K // 2) if padding == "zeros" else 0
    tokens = F.pad(images, (width, width, width, width)).double()               # (C_in, n+2w, m+2w)
    # Head (i, j) has pattern P_row[i] x P_col[j] (its center is d*(i - K//2, j - K//2)), so
    #   out = sum_i P_row[i] (rows) [ sum_j (P_col[j] (cols) Z) W_ij ]
    # needs K column passes, K^2 channel mixes and K row passes instead of K^2 of each.
    offsets = dilation * (torch.arange(K, dtype=torch.float64) - K // 2)        # (K,)
    P_row = _axis_probs(tokens.shape[1], offsets, alpha)                        # (K, R, R)
    P_col = _axis_probs(tokens.shape[2], offsets, alpha)                        # (K, Q, Q)
    col_avg = torch.einsum("jql,cpl->jcpq", P_col, tokens)                     # (K_j, C_in, R, Q)
    # W_ij = W_v^(h) W_out^(h) for head h = (i, j): the kernel slice W[:, :, i, j]
    mixed = torch.einsum("ocij,jcpq->iopq", weight.double(), col_avg)          # (K_i, C_out, R, Q)
    out = torch.einsum("irp,iopq->orq", P_row, mixed)                          # (C_out, R, Q)
    out = out[:, width:width + n, width:width + m]                             # (C_out, n, m) real pixels
    return out + bias.double()[:, None, None]                                  # (C_out, n, m)


def interior_mask(size: tuple[int, int], kernel_size: int, dilation: int) -> torch.Tensor:
    """True where the whole receptive field p + d*s (s in Delta_K) lies inside the image."""
    n, m = size
    before, after = dilation * (kernel_size // 2), dilation * ((kernel_size - 1) // 2)
    mask = torch.zeros(n, m, dtype=torch.bool)
    mask[before:n - after, before:m - after] = True
    return mask


def default_alpha_grid() -> list[float]:
    """17 widths from 0.1 to 1000 (spans 1..100), four per decade."""
    return np.logspace(-1, 3, 17).tolist()


@dataclass
class Equivalence:
    max_abs_error: float            # over all output pixels
    interior_max_abs_error: float   # over pixels whose receptive field is inside the image (nan if none)
    conv: torch.Tensor              # (C_out, n, m) the zero-padded convolution
    mhsa: torch.Tensor              # (C_out, n, m) the attention layer
    error_by_alpha: list[tuple[float, float]]  # [(alpha, max_abs_error)] at the other settings


def random_problem(kernel_size: int, channels_in: int, channels_out: int, image_size: int, seed: int):
    """A seeded random image (C_in, n, n), kernel (C_out, C_in, K, K) and bias (C_out,), float64."""
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(channels_in, image_size, image_size, generator=g, dtype=torch.float64)
    scale = 1.0 / np.sqrt(channels_in * kernel_size * kernel_size)
    weight = torch.randn(channels_out, channels_in, kernel_size, kernel_size, generator=g, dtype=torch.float64) * scale
    bias = torch.randn(channels_out, generator=g, dtype=torch.float64) * 0.1
    return images, weight, bias


def compare(images: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, alpha: float, dilation: int = 1,
            padding: str = "zeros", alpha_grid: list[float] | None = None) -> Equivalence:
    """The theorem's layer vs the zero-padded convolution: errors at `alpha` and over an alpha grid."""
    K = weight.shape[-1]
    n, m = images.shape[-2:]
    if dilation < 1:
        raise ValueError(f"dilation must be >= 1, got {dilation}")
    if dilation * (K // 2) >= min(n, m):
        raise ValueError(f"dilation*floor(K/2) = {dilation * (K // 2)} does not fit in a {n}x{m} image")
    images, weight, bias = images.double(), weight.double(), bias.double()
    conv = same_conv(images, weight, bias, dilation)                           # (C_out, n, m)
    mask = interior_mask((n, m), K, dilation)                                  # (n, m)

    def errors(a: float) -> tuple[torch.Tensor, float, float]:
        mhsa = mhsa_from_kernel(images, weight, bias, a, dilation, padding)    # (C_out, n, m)
        diff = (mhsa - conv).abs()                                             # (C_out, n, m)
        interior = float(diff[:, mask].max()) if mask.any() else float("nan")
        return mhsa, float(diff.max()), interior

    mhsa, max_err, interior_err = errors(alpha)
    grid = alpha_grid if alpha_grid is not None else default_alpha_grid()
    by_alpha = [(float(a), errors(float(a))[1]) for a in grid]
    return Equivalence(max_err, interior_err, conv, mhsa, by_alpha)


def conv_equivalence(kernel_size: int = 3, dilation: int = 1, padding: str = "zeros", alpha: float = 100.0,
                     image_size: int = 16, channels_in: int = 3, channels_out: int = 4, seed: int = 0) -> Equivalence:
    """The API's experiment: a seeded random kernel, image and bias, compared at `alpha` and over alphas."""
    images, weight, bias = random_problem(kernel_size, channels_in, channels_out, image_size, seed)
    return compare(images, weight, bias, alpha, dilation, padding)
