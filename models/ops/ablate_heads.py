"""ablate_heads: the scoped heads' outputs zeroed ("zero", in the layer's plan) or averaged over the positions
("mean", on the head outputs: models/head_ops.py) before W_O (docs/science.md §3)."""
from __future__ import annotations

from typing import Any, Literal

import torch

from models.ops.base import LayerPlan, Op, ScopedItem

MODES = ("zero", "mean")


class AblateHeads(ScopedItem):
    """The scoped heads output zeros before W_O (see /guide#s3), or with mode "mean" their output averaged over the
    positions."""

    op: Literal["ablate_heads"]
    mode: Literal["zero", "mean"] = "zero"


class AblateHeadsOp(Op):
    name = "ablate_heads"
    schema = AblateHeads
    fields = ("mode",)

    def validate(self, iv: Any) -> None:
        if iv.mode not in MODES:
            raise ValueError(f"ablate_heads mode must be one of {MODES}, got {iv.mode!r}")

    def plan(self, iv: Any, plan: LayerPlan, heads: list[int], n_keys: int) -> None:
        if iv.mode == "zero":  # mean ablation: on the head outputs
            plan.ablate[heads] = True

    def touches_outputs(self, iv: Any) -> bool:
        return iv.mode == "mean"

    def head_outputs(self, iv: Any, output: torch.Tensor, layer: int, sources: Any, query_offset: int) -> torch.Tensor:
        heads = iv.head_list(output.shape[1])
        output = output.clone()
        output[:, heads] = output[:, heads].mean(dim=2, keepdim=True).expand_as(output[:, heads])
        return output

    def continuation_refusal(self, item: Any) -> tuple[str, str] | None:
        # a continuation feeds one new token per step (KV cache): a head's mean over the positions is not at hand
        if item.mode != "mean":
            return None
        return "mode", ("mean ablation is offered on /api/text/attention and /api/text/lens, not for continuations "
                        "(each decoding step sees one new position)")


OP = AblateHeadsOp()
