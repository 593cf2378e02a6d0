"""perturb_keys: k̂_j = α k_j + ε, ε ~ N(0, σ² I_d), on the scoped heads' keys (docs/science.md §4). The noise
itself is models/interventions.py `perturb_vectors`; perturb_queries (models/ops/perturb_queries.py) shares the fields."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from models.ops.base import IndexList, LayerPlan, Op, ScopedItem


class Perturb(ScopedItem):
    tokens: IndexList | None = Field(None, description="tokens to perturb (null = all)")
    noise_std: float = Field(0.0, ge=0, le=1e4, description="σ of ε ~ N(0, σ² I_d)")
    scale: float = Field(1.0, ge=-1e4, le=1e4, description="α in x̂ = α x + ε")
    seed: int = Field(0, ge=0, le=2**31 - 1, description="seeds the generator of ε")


class PerturbKeys(Perturb):
    """k̂_j = α k_j + ε (see /guide#s4): only column j of the scores changes."""

    op: Literal["perturb_keys"]


class PerturbKeysOp(Op):
    name = "perturb_keys"
    schema = PerturbKeys
    fields = ("tokens", "noise_std", "scale", "seed")
    reseeded = True

    def plan(self, iv: Any, plan: LayerPlan, heads: list[int], n_keys: int) -> None:
        plan.key_perturbations.append(iv)


OP = PerturbKeysOp()
