"""mask_keys: M[:, j] = −∞ for the listed keys of the scoped heads (docs/science.md §3)."""
from __future__ import annotations

from typing import Any, Literal

from models.ops.base import IndexList, LayerPlan, Op, ScopedItem, replaced


class MaskKeys(ScopedItem):
    """M[:, j] = −∞ for the listed key tokens (see /guide#s3)."""

    op: Literal["mask_keys"]
    tokens: IndexList


class MaskKeysOp(Op):
    name = "mask_keys"
    schema = MaskKeys
    fields = ("tokens",)

    def validate(self, iv: Any) -> None:
        if iv.tokens is None:
            raise ValueError("mask_keys needs a list of tokens")

    def plan(self, iv: Any, plan: LayerPlan, heads: list[int], n_keys: int) -> None:
        tokens = list(iv.tokens or ())
        if any(t < 0 or t >= n_keys for t in tokens):
            raise ValueError(f"mask_keys: token index out of range 0..{n_keys - 1}: {tokens}")
        for h in heads:
            plan.key_mask[h, tokens] = True

    def for_keys_so_far(self, iv: Any, n_keys: int, decoder_layers: set[int]) -> Any:
        # decoder self-attention masks name target positions: keys past the current length wait for their step
        # (cross/encoder keys are always all there)
        if iv.layers is None or not set(iv.layers) <= decoder_layers:
            return iv
        tokens = tuple(t for t in iv.tokens if t < n_keys)
        return replaced(iv, tokens=tokens) if tokens else None


OP = MaskKeysOp()
