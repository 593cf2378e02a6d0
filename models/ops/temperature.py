"""temperature: the softmax's inverse temperature β of the scoped heads (docs/science.md §2); T = 1/β."""
from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field

from models.ops.base import LayerPlan, Op, ScopedItem, replaced


class Temperature(ScopedItem):
    """Set the softmax inverse temperature β (see /guide#s2); T = 1/β."""

    op: Literal["temperature"]
    beta: float = Field(gt=0, le=1e4, description="inverse temperature β, 0 < β ≤ 1e4")


class TemperatureOp(Op):
    name = "temperature"
    schema = Temperature
    fields = ("beta",)

    def validate(self, iv: Any) -> None:
        if not (iv.beta is not None and math.isfinite(iv.beta) and iv.beta > 0):
            raise ValueError(f"temperature needs a finite beta > 0, got {iv.beta!r}")

    def plan(self, iv: Any, plan: LayerPlan, heads: list[int], n_keys: int) -> None:
        plan.beta[heads] = float(iv.beta)  # later items override earlier ones

    def for_whisper(self, iv: Any, query_scale: float) -> Any:
        # the engine's β multiplies Whisper's pre-scaled q/√d, so β/β₀ passes on
        return replaced(iv, beta=iv.beta / query_scale)


OP = TemperatureOp()
