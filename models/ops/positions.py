"""The `positions` op (one file: its request item, its check, its recording and the engine's hooks): a model's position information switched off or shuffled (docs/science.md
"Positions off").

Without positions, self-attention cannot tell token orders apart: it is permutation-equivariant, P(πx) = Π P(x) Πᵀ
(docs/science.md). The op acts where each family injects positions, never on the attention itself:

- learned absolute embeddings looked up by position (BERT/MiniLM's `position_embeddings`, GPT-2's `wpe`, CLIP/SigLIP's
  `position_embedding`): a forward hook on that embedding table's output. "off": every row zero; "shuffle": token t
  gets the row of position π(t).
- ViT/DeiT/DINOv2, whose embeddings module adds a (possibly bicubically interpolated, DINOv2) position tensor to
  [CLS, (dist,) patches]: a forward hook on the embeddings module. It forms the patch embeddings again from the same
  pixels (deterministic: the same numbers the module added its positions to) and puts them back without positions
  ("off"), the prefix tokens' (CLS, DeiT's dist) own position rows subtracted; or with the patches' position rows
  permuted among the patches ("shuffle": CLS keeps its own). Register tokens have no position and are left alone.
- rotary embeddings (Llama, Qwen2, Gemma, SmolLM2): a forward pre-hook on the rotary module gives it position ids all
  0 ("off": every query and key rotated as at position 0, i.e. not at all) or permuted ("shuffle"); the causal mask
  and the KV cache are untouched (they do not read position ids).

The hooks are registered once at load and hold no request state: each reads the current run's interventions from
models/run_context.py's context variable, so a concurrent request (another thread) never sees another's op and a
forward with no `positions` op passes through unchanged. Token-type (segment) embeddings are left alone.
"""
from __future__ import annotations

import inspect
from typing import Any, Literal

import torch
from pydantic import Field
from torch import nn

from models.ops.base import Op, ScopedItem
from models.run_context import current_run


class Positions(ScopedItem):
    """The model's position information switched off ("off": absolute position embeddings zeroed, RoPE at one
    position) or permuted among the tokens with `seed` ("shuffle"); acts on the input embeddings, so `layers` and
    `heads` must be null (see /guide)."""

    op: Literal["positions"]
    mode: Literal["off", "shuffle"] = Field("off", description="'off': no positions; 'shuffle': seeded permutation")
    seed: int = Field(0, ge=0, le=2**31 - 1, description="seeds the shuffle's permutation")


class PositionsOp(Op):
    """No part in a layer's plan: the hooks below act on the embeddings before any layer. Families whose positions
    are not hooked refuse it by name in their intervention table (app/interventions.py)."""

    name = "positions"
    schema = Positions
    fields = ("mode", "seed")
    scoped = False
    unscoped_why = "positions acts on the input embeddings, before any layer: layers and heads must be null"

    def validate(self, iv: Any) -> None:
        if iv.mode not in MODES or iv.layers is not None or iv.heads is not None:
            raise ValueError(f"positions needs a mode in {MODES} and no layers or heads, got {iv.mode!r}")


MODES = ("off", "shuffle")


def current_positions() -> Any:
    """The `positions` Intervention of the run in progress in this context (the last one listed), or None."""
    scope = current_run.get()
    found = [iv for iv in getattr(scope, "interventions", ()) if iv.op == "positions"]
    return found[-1] if found else None


def permutation(n: int, seed: int, device: torch.device | None = None) -> torch.Tensor:
    """The seeded permutation π of 0 … n−1 that "shuffle" uses (the same seed and n, the same π). (n,) int64"""
    return torch.randperm(n, generator=torch.Generator().manual_seed(int(seed))).to(device)


def _table_hook(_module: nn.Module, _args, output: torch.Tensor):
    """An embedding table looked up by position: (B|1, T, D) rows zeroed or permuted along T."""
    iv = current_positions()
    if iv is None:
        return None
    if iv.mode == "off":
        return torch.zeros_like(output)
    return output[:, permutation(output.shape[1], iv.seed, output.device)]


def _vit_hook(takes_interpolate: bool):
    def hook(module: nn.Module, args, kwargs, output: torch.Tensor):
        iv = current_positions()
        if iv is None:
            return None
        pixel_values = args[0] if args else kwargs["pixel_values"]
        extra = {}
        if takes_interpolate:
            extra["interpolate_pos_encoding"] = bool(args[2] if len(args) > 2 else kwargs.get("interpolate_pos_encoding", False))
        patches = module.patch_embeddings(pixel_values.to(output.dtype), **extra)  # (B, N, D), no positions
        n_patches = patches.shape[1]
        table = module.position_embeddings  # (1, n_prefix + N₀, D): the prefix rows are never interpolated
        n_prefix = table.shape[1] - module.patch_embeddings.num_patches
        new = output.clone()  # (B, T, D): [CLS, (dist,) (registers,) patches]
        if iv.mode == "off":
            new[:, :n_prefix] = output[:, :n_prefix] - table[:, :n_prefix].to(output.dtype)
            new[:, -n_patches:] = patches
        else:
            rows = output[:, -n_patches:] - patches  # (B, N, D): the (interpolated) patch positions as added
            new[:, -n_patches:] = patches + rows[:, permutation(n_patches, iv.seed, output.device)]
        return new
    return hook


def _rotary_pre_hook(module: nn.Module, args, kwargs):
    """position_ids, the rotary module's second argument, all 0 or permuted along T."""
    iv = current_positions()
    if iv is None:
        return None
    args, kwargs = list(args), dict(kwargs)
    in_args = len(args) > 1
    position_ids = args[1] if in_args else kwargs.get("position_ids")
    if position_ids is None:
        return None
    if iv.mode == "off":
        position_ids = torch.zeros_like(position_ids)
    else:
        position_ids = position_ids[..., permutation(position_ids.shape[-1], iv.seed, position_ids.device)]
    if in_args:
        args[1] = position_ids
    else:
        kwargs["position_ids"] = position_ids
    return tuple(args), kwargs


def attach(model: nn.Module) -> str | None:
    """Register the positions hooks on `model` once; returns what kind of positions it has ("absolute", "patch",
    "rotary") or None when none was found (then the op is refused for it)."""
    kinds = []
    for module in model.modules():
        name = type(module).__name__
        if name.endswith("RotaryEmbedding"):
            module.register_forward_pre_hook(_rotary_pre_hook, with_kwargs=True)
            kinds.append("rotary")
            continue
        table = getattr(module, "position_embeddings", None)
        if isinstance(table, nn.Parameter) and hasattr(module, "patch_embeddings"):
            takes = "interpolate_pos_encoding" in inspect.signature(module.patch_embeddings.forward).parameters
            module.register_forward_hook(_vit_hook(takes), with_kwargs=True)
            kinds.append("patch")
            continue
        for attribute in ("position_embeddings", "wpe", "position_embedding"):
            table = getattr(module, attribute, None)
            if isinstance(table, nn.Embedding):
                table.register_forward_hook(_table_hook)
                kinds.append("absolute")
    return kinds[0] if kinds and len(set(kinds)) == 1 else None


OP = PositionsOp()
