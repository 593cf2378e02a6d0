"""patch_heads: the scoped heads' outputs (before W_O) replaced by a kept run's, position by position
(models/head_ops.py calls `head_outputs` at every layer it applies to)."""
from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field

from models.ops.base import RUN_ID_FORM, Op, ScopedItem


class PatchHeads(ScopedItem):
    """The scoped heads' outputs (before W_O) replaced by a kept run's, position by position (same token count):
    `source` is the `clean_run_id` of POST /api/text/patching."""

    op: Literal["patch_heads"]
    source: str = Field(pattern=RUN_ID_FORM, description="run id of the source run (clean_run_id)")


class PatchHeadsOp(Op):
    name = "patch_heads"
    schema = PatchHeads
    fields = ("source",)
    patch_source = "heads"

    def validate(self, iv: Any) -> None:
        if not iv.source:
            raise ValueError(f"{self.name} needs a source run id")

    def touches_outputs(self, iv: Any) -> bool:
        return True

    def head_outputs(self, iv: Any, output: torch.Tensor, layer: int, sources: Any, query_offset: int) -> torch.Tensor:
        """A source run covers positions 0 … T_source − 1; positions past it are left alone."""
        if iv.source not in sources:
            raise KeyError(f"patch_heads: no kept run {iv.source!r}")
        source = sources[iv.source][layer].to(output.device, output.dtype)  # (H, T_s, d_v)
        rows = max(0, min(output.shape[2], source.shape[1] - query_offset))
        if rows == 0:
            return output
        heads = iv.head_list(output.shape[1])
        output = output.clone()
        output[:, heads, :rows] = source[heads, query_offset:query_offset + rows].unsqueeze(0)
        return output


OP = PatchHeadsOp()
