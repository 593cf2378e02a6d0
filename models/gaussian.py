"""Gaussian relative positional attention (docs/science.md §7-8), one readable file in the nanoGPT style.

Every head h of every layer has a learned center mu_h in R^2 (a shift in grid cells, (row, col)) and a
learned width alpha_h > 0. Its score for query pixel q and key pixel k is

    A_h[q, k] = -alpha_h * ||(k - q) - mu_h||^2

which does not look at the content at all: the attention pattern P = softmax_k(A) is one (H, T, T)
tensor shared by every image of the batch (no Q K^T: O(T^2 + T d^2) instead of O(T^2 d + T d^2), see
`layer_cost`). More: the score is a sum of a row term and a column term and the grid is a rectangle, so
P_h = P_row_h (x) P_col_h, and the forward pass applies it as two small (14 x 14) products per head
instead of one (196 x 196) one (`GaussianAttention.forward`; `dense=True` keeps the reference path).

Input: a 28x28 Fashion-MNIST image is reduced by 2x2 space-to-depth to a 14x14 grid of 4-value tokens
(Cordonnier, Loukas & Jaggi, ICLR 2020 did the same to CIFAR-10: 32x32x3 -> 16x16x12).
This module knows nothing about HTTP.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

MODELS_DIR = Path(__file__).resolve().parent
# Trained runs shipped with the repository: id -> folder (relative to models/). A request names an id,
# never a path.
GAUSSIAN_REGISTRY: dict[str, str] = {
    "gaussian-fashion": "trained/gaussian-fashion",
}
DEFAULT_GAUSSIAN_MODEL = "gaussian-fashion"


# ----------------------------------------------------------------------------------------------------
# configuration

@dataclass
class GaussianConfig:
    image_size: int = 28        # input images are image_size x image_size
    in_channels: int = 1        # 1 for Fashion-MNIST, 3 for CIFAR-10
    patch: int = 2              # space-to-depth factor: a patch x patch block becomes one token
    n_layers: int = 3
    n_heads: int = 9            # 9 heads = enough to express a 3x3 convolution (theorem, docs/science.md §7)
    hidden: int = 36            # d: width of the residual stream
    head_dim: int = 0           # 0 -> hidden // n_heads (as BERT and Cordonnier's code do)
    ffn_hidden: int = 72        # width of the feed-forward block
    n_classes: int = 10
    gelu: str = "exact"         # "exact": x*Phi(x)  |  "tanh": the tanh approximation
    position_embedding: bool = False  # add a learned absolute embedding per token (the heads stay content-free)
    dropout: float = 0.0
    center_init_std: float = 0.5  # centers start near 0 so that their motion during training shows
    alpha_init: float = 1.0
    ln_eps: float = 1e-5
    pixel_mean: float = 0.2860  # Fashion-MNIST training-set statistics (inputs scaled to [0, 1])
    pixel_std: float = 0.3530

    def __post_init__(self) -> None:
        if self.image_size % self.patch:
            raise ValueError(f"image_size {self.image_size} is not a multiple of patch {self.patch}")
        if self.gelu not in ("exact", "tanh"):
            raise ValueError(f"gelu must be 'exact' or 'tanh', got {self.gelu!r}")
        if self.head_dim <= 0:
            self.head_dim = self.hidden // self.n_heads
        if self.head_dim <= 0:
            raise ValueError(f"hidden {self.hidden} is smaller than n_heads {self.n_heads}")

    @property
    def grid(self) -> tuple[int, int]:
        side = self.image_size // self.patch
        return side, side

    @property
    def n_tokens(self) -> int:
        rows, cols = self.grid
        return rows * cols

    @property
    def token_dim(self) -> int:
        return self.in_channels * self.patch * self.patch

    @classmethod
    def cordonnier(cls, **overrides) -> "GaussianConfig":
        """Cordonnier et al.'s setting: 6 layers, 9 heads, hidden 400, CIFAR-10 reduced 2x2 to 16x16."""
        base = dict(image_size=32, in_channels=3, n_layers=6, n_heads=9, hidden=400, ffn_hidden=512,
                    pixel_mean=0.4734, pixel_std=0.2516)
        base.update(overrides)
        return cls(**base)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "GaussianConfig":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


# ----------------------------------------------------------------------------------------------------
# building blocks

def gelu(x: torch.Tensor, kind: str = "exact") -> torch.Tensor:
    """GELU: exact x*Phi(x), or the tanh approximation 0.5x(1 + tanh(sqrt(2/pi)(x + 0.044715x^3)))."""
    return F.gelu(x, approximate="tanh" if kind == "tanh" else "none")


def space_to_depth(images: torch.Tensor, patch: int) -> torch.Tensor:
    """(B, C, H, W) -> (B, (H/p)*(W/p), C*p*p): each p x p block becomes one token, row-major."""
    B, C, H, W = images.shape
    x = images.reshape(B, C, H // patch, patch, W // patch, patch)  # (B, C, R, p, Q, p)
    x = x.permute(0, 2, 4, 1, 3, 5)                                 # (B, R, Q, C, p, p)
    return x.reshape(B, (H // patch) * (W // patch), C * patch * patch)  # (B, T, C*p*p)


def relative_shifts(rows: int, cols: int) -> torch.Tensor:
    """shift[q, k] = position(k) - position(q) in (row, col) grid cells."""
    r, c = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    pos = torch.stack([r.reshape(-1), c.reshape(-1)], dim=-1).float()  # (T, 2)
    return pos[None, :, :] - pos[:, None, :]                           # (T, T, 2)


def gaussian_scores(shifts: torch.Tensor, centers: torch.Tensor, alphas: torch.Tensor) -> torch.Tensor:
    """A[h, q, k] = -alpha_h ||shift[q, k] - mu_h||^2 for shifts (T, T, 2), centers (H, 2), alphas (H,)."""
    diff = shifts[None, :, :, :] - centers[:, None, None, :]  # (H, T, T, 2)
    return -alphas[:, None, None] * diff.pow(2).sum(-1)       # (H, T, T)


def _inverse_softplus(y: float) -> float:
    return y + math.log(-math.expm1(-y))


class GaussianAttention(nn.Module):
    """Multi-head attention whose pattern depends only on relative position (content-independent)."""

    def __init__(self, cfg: GaussianConfig):
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        rows, cols = cfg.grid
        self.centers = nn.Parameter(torch.randn(cfg.n_heads, 2) * cfg.center_init_std)  # (H, 2)
        # alpha = softplus(raw) keeps the width positive without clipping
        self.alpha_raw = nn.Parameter(torch.full((cfg.n_heads,), _inverse_softplus(cfg.alpha_init)))  # (H,)
        self.value = nn.Linear(cfg.hidden, cfg.n_heads * cfg.head_dim)
        self.out = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.hidden)
        self.grid = (rows, cols)
        self.register_buffer("shifts", relative_shifts(rows, cols), persistent=False)  # (T, T, 2)

    def alphas(self) -> torch.Tensor:
        return F.softplus(self.alpha_raw)  # (H,)

    def axis_probs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The pattern factorises: ||s - mu||^2 = (s_r - mu_r)^2 + (s_c - mu_c)^2 and the grid is a
        rectangle, so softmax over keys = (softmax over key rows) x (softmax over key columns)."""
        rows, cols = self.grid
        alphas = self.alphas()                                                          # (H,)
        r = torch.arange(rows, dtype=self.centers.dtype, device=self.centers.device)
        c = torch.arange(cols, dtype=self.centers.dtype, device=self.centers.device)
        row_shift = r[None, :] - r[:, None]                                             # (R, R) kr - qr
        col_shift = c[None, :] - c[:, None]                                             # (Q, Q) kc - qc
        row_scores = -alphas[:, None, None] * (row_shift[None] - self.centers[:, 0, None, None]) ** 2  # (H, R, R)
        col_scores = -alphas[:, None, None] * (col_shift[None] - self.centers[:, 1, None, None]) ** 2  # (H, Q, Q)
        return row_scores.softmax(-1), col_scores.softmax(-1)                          # (H, R, R), (H, Q, Q)

    def probs(self) -> torch.Tensor:
        """The full attention pattern shared by the whole batch (the reference, dense form)."""
        scores = gaussian_scores(self.shifts, self.centers, self.alphas())  # (H, T, T)
        return scores.softmax(dim=-1)                                       # (H, T, T)

    def forward(self, x: torch.Tensor, dense: bool = False) -> torch.Tensor:
        B, T, _ = x.shape
        H, D = self.n_heads, self.head_dim
        rows, cols = self.grid
        v = self.value(x)                                              # (B, T, H*D)
        if dense:  # y[b, q] = sum_k P[h, q, k] v[b, k]: T^2 d multiply-adds per image
            P = self.probs()                                           # (H, T, T)
            v = v.view(B, T, H, D).permute(2, 1, 0, 3).reshape(H, T, B * D)  # (H, T, B*D)
            y = torch.bmm(P, v)                                        # (H, T, B*D)
            y = y.view(H, T, B, D).permute(2, 1, 0, 3).reshape(B, T, H * D)  # (B, T, H*D)
        else:  # same result, separable: attend along rows, then along columns: T (R + Q) d per image
            P_row, P_col = self.axis_probs()                           # (H, R, R), (H, Q, Q)
            v = v.view(B, rows, cols, H, D)                            # (B, R, Q, H, D)
            y = torch.einsum("hik,bkjhd->bijhd", P_row, v)             # (B, R, Q, H, D)
            y = torch.einsum("hjl,bilhd->bijhd", P_col, y)             # (B, R, Q, H, D)
            y = y.reshape(B, T, H * D)                                 # (B, T, H*D)
        return self.out(y)                                             # (B, T, C)


class FeedForward(nn.Module):
    def __init__(self, cfg: GaussianConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden, cfg.ffn_hidden)
        self.fc2 = nn.Linear(cfg.ffn_hidden, cfg.hidden)
        self.gelu_kind = cfg.gelu
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = gelu(self.fc1(x), self.gelu_kind)  # (B, T, F)
        return self.drop(self.fc2(h))          # (B, T, C)


class Block(nn.Module):
    """Post-LayerNorm block (as in BERT and Cordonnier et al.): x = LN(x + f(x))."""

    def __init__(self, cfg: GaussianConfig):
        super().__init__()
        self.attn = GaussianAttention(cfg)
        self.ln1 = nn.LayerNorm(cfg.hidden, eps=cfg.ln_eps)
        self.ffn = FeedForward(cfg)
        self.ln2 = nn.LayerNorm(cfg.hidden, eps=cfg.ln_eps)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln1(x + self.drop(self.attn(x)))  # (B, T, C)
        x = self.ln2(x + self.ffn(x))              # (B, T, C)
        return x


class GaussianEncoder(nn.Module):
    """Space-to-depth tokens -> n_layers Gaussian-attention blocks -> mean pool -> class logits."""

    def __init__(self, cfg: GaussianConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Linear(cfg.token_dim, cfg.hidden)
        # optional: lets the mean-pooled features depend on where a pattern is, not only on what it is
        self.position = nn.Parameter(torch.zeros(cfg.n_tokens, cfg.hidden)) if cfg.position_embedding else None  # (T, C)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.head = nn.Linear(cfg.hidden, cfg.n_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """images: (B, C, H, W) floats in [0, 1] (or (B, H, W) for one channel) -> logits (B, classes)."""
        if images.dim() == 3:
            images = images[:, None]                                       # (B, 1, H, W)
        x = (images - self.cfg.pixel_mean) / self.cfg.pixel_std            # (B, C, H, W)
        x = self.embed(space_to_depth(x, self.cfg.patch))                  # (B, T, C)
        if self.position is not None:
            x = x + self.position                                          # (B, T, C)
        for block in self.blocks:
            x = block(x)                                                   # (B, T, C)
        return self.head(x.mean(dim=1))                                    # (B, classes)

    # -- what the page shows ------------------------------------------------------------------------
    def centers_and_alphas(self) -> list[dict]:
        """[{"heads": [{"center": [dr, dc], "alpha": a}, ...]}, ...] one entry per layer."""
        out = []
        with torch.no_grad():
            for block in self.blocks:
                centers = block.attn.centers.double().tolist()
                alphas = block.attn.alphas().double().tolist()
                out.append({"heads": [{"center": c, "alpha": a} for c, a in zip(centers, alphas)]})
        return out


# ----------------------------------------------------------------------------------------------------
# functions the API and the page use (no model weights needed: the pattern depends on mu and alpha only)

def attention_over_grid(center: tuple[float, float], alpha: float, grid: tuple[int, int],
                        query: tuple[int, int]) -> np.ndarray:
    """Probabilities (rows, cols) with which a head of this center/width at `query` attends to each pixel.

    Computed in float64 with the maximum subtracted, so that alpha up to 1e6 stays finite: the limit
    alpha -> inf is one-hot on q + mu when that pixel exists (else on the nearest existing pixels).
    """
    rows, cols = grid
    r, c = np.meshgrid(np.arange(rows, dtype=np.float64), np.arange(cols, dtype=np.float64), indexing="ij")
    dr = (r - query[0]) - center[0]                   # (rows, cols)
    dc = (c - query[1]) - center[1]                   # (rows, cols)
    scores = -float(alpha) * (dr * dr + dc * dc)      # (rows, cols)
    scores -= scores.max()
    weights = np.exp(scores)                          # (rows, cols)
    return weights / weights.sum()


def gelu_curves(x_min: float = -4.0, x_max: float = 4.0, n: int = 161) -> dict:
    """GELU exact x*Phi(x) vs tanh approximation on a grid, and their largest difference."""
    x = torch.linspace(x_min, x_max, n, dtype=torch.float64)
    exact = gelu(x, "exact")
    approx = gelu(x, "tanh")
    return {"x": x.tolist(), "exact": exact.tolist(), "tanh": approx.tolist(),
            "max_abs_difference": float((exact - approx).abs().max())}


def layer_param_count(cfg: GaussianConfig) -> dict:
    """Parameters of one block of this model, and of a content (query/key) attention block of the same size."""
    C, H, D, Fh = cfg.hidden, cfg.n_heads, cfg.head_dim, cfg.ffn_hidden
    gaussian_attn = H * 2 + H + (C * H * D + H * D) + (H * D * C + C)  # centers, alphas, W_v, W_out
    content_attn = 2 * (C * H * D + H * D) + (C * H * D + H * D) + (H * D * C + C)  # W_q, W_k, W_v, W_out
    ffn = C * Fh + Fh + Fh * C + C
    layer_norms = 2 * 2 * C
    return {
        "attention_gaussian": gaussian_attn,
        "attention_content": content_attn,
        "ffn": ffn,
        "layer_norms": layer_norms,
        "layer_gaussian": gaussian_attn + ffn + layer_norms,
        "layer_content": content_attn + ffn + layer_norms,
    }


def layer_cost(cfg: GaussianConfig) -> dict:
    """Multiply-adds of one block for one image (T tokens, width d = n_heads*head_dim, FFN f).

    Content attention: Q, K, V, O projections 4*T*d*C, scores Q K^T T^2*d, P V T^2*d  -> O(T^2 d + T d^2).
    Gaussian attention: V, O projections 2*T*d*C, scores H*T^2 (once per batch), P V T^2*d
    -> O(T^2 + T d^2) for the pattern, with P V the remaining T^2 d term shared by both.
    """
    T, C, d, Fh, H = cfg.n_tokens, cfg.hidden, cfg.n_heads * cfg.head_dim, cfg.ffn_hidden, cfg.n_heads
    ffn = 2 * T * C * Fh
    content = {"projections": 4 * T * C * d, "scores": T * T * d, "weighted_values": T * T * d, "ffn": ffn}
    gaussian = {"projections": 2 * T * C * d, "scores": H * T * T, "weighted_values": T * T * d, "ffn": ffn}
    return {
        "tokens": T, "hidden": C, "heads": H, "head_dim": cfg.head_dim,
        "content": {**content, "total": sum(content.values())},
        "gaussian": {**gaussian, "total": sum(gaussian.values())},
        "formula_content": "O(T^2 d + T d^2)",
        "formula_gaussian": "O(T^2 + T d^2)",
    }


def param_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# ----------------------------------------------------------------------------------------------------
# trained runs: loading (lazily, once) and their history

def model_folder(model_id: str) -> Path:
    """Folder of a registered run; KeyError for an id that is not registered (never a path)."""
    return MODELS_DIR / GAUSSIAN_REGISTRY[model_id]


@lru_cache(maxsize=8)
def load_history(model_id: str) -> dict:
    """history.json: {"model", "dataset", "config", "epochs": [{"epoch", "accuracy", "layers": [...]}, ...]}."""
    with open(model_folder(model_id) / "history.json") as f:
        return json.load(f)


@lru_cache(maxsize=4)
def load_model(model_id: str) -> GaussianEncoder:
    from safetensors.torch import load_file

    folder = model_folder(model_id)
    with open(folder / "config.json") as f:
        cfg = GaussianConfig.from_dict(json.load(f))
    model = GaussianEncoder(cfg)
    model.load_state_dict(load_file(str(folder / "model.safetensors")))
    return model.eval()


def available_models() -> list[str]:
    """Registered ids whose files exist, the default first."""
    ids = sorted(GAUSSIAN_REGISTRY, key=lambda i: (i != DEFAULT_GAUSSIAN_MODEL, i))
    return [i for i in ids if (model_folder(i) / "history.json").exists()]
