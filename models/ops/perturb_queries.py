"""perturb_queries: q̂_i = α q_i + ε, ε ~ N(0, σ² I_d), on the scoped heads' query rows (docs/science.md §4)."""
from __future__ import annotations

from typing import Any, Literal

from models.ops.base import LayerPlan, replaced
from models.ops.perturb_keys import Perturb, PerturbKeysOp


class PerturbQueries(Perturb):
    """q̂_i = α q_i + ε (see /guide#s4): only row i of the scores changes at that layer."""

    op: Literal["perturb_queries"]


class PerturbQueriesOp(PerturbKeysOp):
    name = "perturb_queries"
    schema = PerturbQueries
    tokens_index = "rows"

    def plan(self, iv: Any, plan: LayerPlan, heads: list[int], n_keys: int) -> None:
        plan.query_perturbations.append(iv)

    def for_whisper(self, iv: Any, query_scale: float) -> Any:
        # ε on Whisper's pre-scaled q/√d is ε/√d: α q + ε, then scaled, is α (q/√d) + ε/√d
        return replaced(iv, noise_std=iv.noise_std * query_scale)


OP = PerturbQueriesOp()
