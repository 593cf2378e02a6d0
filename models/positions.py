"""The `positions` op's checks on a real model: its tokens permuted, with positions off and on (docs/science.md
"Positions off"). The op itself (its request item, check, recording and the hooks that act on the embeddings) is one
file, models/ops/positions.py; its names are kept here for the modules that import them from here.
"""
from __future__ import annotations

import copy
from typing import Any

import torch

from models.interventions import Intervention
from models.ops.positions import MODES, attach, current_positions, permutation

__all__ = ["MODES", "attach", "current_positions", "permutation", "permuted_input", "permutation_check"]


def permuted_input(encoded: Any, order: list[int]) -> Any:
    """The same encoded text with its tokens in `order` (new token i is old token order[i]): every (1, T) input
    permuted along T, a cache key of its own."""
    moved = copy.copy(encoded)
    moved.key = (*encoded.key, "permuted", tuple(order))
    moved.tokens = [encoded.tokens[i] for i in order]
    moved.inputs = {k: v[:, order] if isinstance(v, torch.Tensor) and v.dim() == 2 else v for k, v in encoded.inputs.items()}
    return moved


def permutation_check(adapter: Any, encoded: Any, seed: int) -> dict[str, Any]:
    """max |P(πx) − Π P(x) Πᵀ| over every layer and head of an encoder, with positions off and on: the tokens are
    permuted by `seed`, the first and last ([CLS], [SEP]) kept in place. Four forwards. adapter: an encoder's
    (models/adapters/bert.py); encoded: one text of at least 4 tokens."""
    n_tokens = len(encoded.tokens)
    order = [0, *(permutation(n_tokens - 2, seed) + 1).tolist(), n_tokens - 1]
    moved = permuted_input(encoded, order)
    index = torch.tensor(order)
    errors = {}
    for name, interventions in (("off", (Intervention("positions", mode="off"),)), ("on", ())):
        maps = adapter.run(encoded, interventions).attention.double()  # (L, H, T, T)
        maps_moved = adapter.run(moved, interventions).attention.double()
        errors[name] = float((maps_moved - maps[:, :, index][:, :, :, index]).abs().max())
    return {"order": order, "permuted_tokens": moved.tokens, "max_abs_positions_off": errors["off"],
            "max_abs_positions_on": errors["on"]}
