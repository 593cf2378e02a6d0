"""patch_residual: the residual stream after the scoped layers, at the positions `tokens`, replaced by a kept run's
(models/head_ops.py `patch_residual`, on a hook after each layer block)."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from models.ops.base import RUN_ID_FORM, IndexList, Op, ScopedItem


class PatchResidual(ScopedItem):
    """The residual stream after the scoped layers, at the positions `tokens` (null = all), replaced by a kept run's
    (same token count): `source` is the `clean_run_id` of POST /api/text/patching; `heads` must be null."""

    op: Literal["patch_residual"]
    source: str = Field(pattern=RUN_ID_FORM, description="run id of the source run (clean_run_id)")
    tokens: IndexList | None = Field(None, description="token positions to patch (null = all)")


class PatchResidualOp(Op):
    name = "patch_residual"
    schema = PatchResidual
    fields = ("tokens", "source")
    patch_source = "residual"
    patches_residual = True

    def validate(self, iv: Any) -> None:
        if not iv.source:
            raise ValueError(f"{self.name} needs a source run id")


OP = PatchResidualOp()
