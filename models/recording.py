"""What one attention layer records, kept out of its maths: `AttentionRecorder` names the recording points of
models/interventions.intervened_attention (as TransformerLens names hook points), each off (None) or where the
recording goes. The maths function takes the maths (queries, keys, values, mask, β, interventions) and one recorder."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionRecorder:
    """The recordings of one attention layer, by name:

    - `pattern`: a buffer P is written into, (B, H, T_q, T_k) (a slice of a run's (L, …) buffer, so a run's maps need
      no copy at the end); None: P is a fresh tensor;
    - `scores`: Ŝ = q̂ k̂ᵀ (unscaled) is formed when `keep_scores`, into this buffer when one is given;
    - `entropy`: a (B, H) buffer that receives each head's mean row entropy while the logits are at hand;
    - `qk`: a list that receives (q̂, k̂), the queries and keys after perturbation: Ŝ of any head can be formed later
      from those T × d matrices instead of keeping every T × T one.
    """

    pattern: torch.Tensor | None = None
    scores: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    qk: list | None = None
    keep_scores: bool = False

    def record_qk(self, query: torch.Tensor, key: torch.Tensor) -> None:
        if self.qk is not None:
            self.qk.extend((query, key))

    def record_scores(self, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor | None:
        """Ŝ (B, H, T_q, T_k) when kept, else None (not formed)."""
        if not self.keep_scores:
            return None
        return torch.matmul(query, key.transpose(-1, -2), out=self.scores)


NOTHING = AttentionRecorder()  # plain attention: P returned, nothing else formed
WITH_SCORES = AttentionRecorder(keep_scores=True)  # Ŝ formed and returned beside P
