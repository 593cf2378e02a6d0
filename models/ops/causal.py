"""causal: M[i, j] = −∞ for j > i on the scoped heads (docs/science.md §3)."""
from __future__ import annotations

from typing import Any, Literal

from models.ops.base import LayerPlan, Op, ScopedItem


class Causal(ScopedItem):
    """M[i, j] = −∞ for j > i (see /guide#s3)."""

    op: Literal["causal"]


class CausalOp(Op):
    name = "causal"
    schema = Causal

    def plan(self, iv: Any, plan: LayerPlan, heads: list[int], n_keys: int) -> None:
        plan.causal[heads] = True


OP = CausalOp()
