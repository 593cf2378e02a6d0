"""The intervention ops, one file each (models/ops/base.py says what an `Op` carries), registered here: one line per op.

The order is the request schema's (app/schemas.py builds its discriminated union from OPS, in this order).
"""
from __future__ import annotations

from models.ops import ablate_heads, causal, mask_keys, patch_heads, patch_residual, perturb_keys, perturb_queries
from models.ops import positions, temperature
from models.ops.base import LayerPlan, Op, registry

OPS: dict[str, Op] = registry(
    temperature.OP,
    mask_keys.OP,
    causal.OP,
    ablate_heads.OP,
    perturb_keys.OP,
    perturb_queries.OP,
    patch_heads.OP,
    patch_residual.OP,
    positions.OP,
)

__all__ = ["OPS", "LayerPlan", "Op"]
