"""Query–key attribution on the real smollm2-135m (docs/science.md "Query–key attribution"): on 40 seeded random tokens
repeated once after BOS, the induction head L18 H6 attends from a second-repeat token i to j = i − 40 + 1 (the token
after i's earlier copy). Why: the key side of that score is carried by the previous-token head L16 H0, and expanding
that head's part at j points at j − 1 — the token equal to the query's (Olsson et al. 2022)."""
from __future__ import annotations

import pytest
import torch

from models.adapters.base import Encoded
from models.qk_attribution import qk_attribution
from tests.integration.helpers import smollm2_adapter

REPEAT = 40
INDUCTION, PREVIOUS_TOKEN = (18, 6), (16, 0)


@pytest.fixture(scope="module")
def lm():
    return smollm2_adapter()


@pytest.fixture(scope="module")
def probe(lm) -> torch.Tensor:
    """BOS, then 40 seeded random tokens twice: (1, 81)."""
    tokens = torch.randint(1000, 40000, (REPEAT,), generator=torch.Generator().manual_seed(0)).tolist()
    return torch.tensor([[lm.tokenizer.bos_token_id] + tokens + tokens])


def test_the_probe_has_the_induction_and_previous_token_heads(lm, probe):
    """What the attribution below relies on, measured on the same run: L18 H6 attends i → i − 39, L16 H0 i → i − 1."""
    encoded = Encoded(key=("probe",), tokens=[lm.token_text(int(t)) for t in probe[0]],
                      inputs={"input_ids": probe, "attention_mask": torch.ones_like(probe)},
                      extra={"position": probe.shape[1] - 1})
    probs = lm.run(encoded).attention  # (L, H, T, T)
    second = range(REPEAT + 2, 2 * REPEAT + 1)
    induction = torch.stack([probs[INDUCTION][i, i - REPEAT + 1] for i in second]).mean()
    previous = torch.stack([probs[PREVIOUS_TOKEN][i, i - 1] for i in range(1, 2 * REPEAT + 1)]).mean()
    assert float(induction) > 0.8 and float(previous) > 0.8, (float(induction), float(previous))


@pytest.mark.parametrize("query", [60, 70])
def test_induction_key_side_is_the_previous_token_head_pointing_at_the_token_before(lm, probe, query):
    key = query - REPEAT + 1
    found = qk_attribution(lm, probe, *INDUCTION, query, key, expand=3)
    assert abs(float(found.matrix.sum()) - found.score) <= 1e-4 * abs(found.score)
    assert found.attention > 0.5 and found.score > 0  # the head does attend there
    key_totals = dict(zip(found.key_parts, found.matrix.sum(dim=0).tolist()))
    strongest = max(key_totals, key=lambda name: abs(key_totals[name]))
    assert strongest == "L16.H0", sorted(key_totals.items(), key=lambda kv: -abs(kv[1]))[:5]
    assert key_totals["L16.H0"] > 0.8 * found.score
    expanded = next(e for e in found.expanded if e["key_part"] == "L16.H0")
    top = expanded["sources"][0]
    assert top["position"] == key - 1, expanded["sources"][:3]
    assert top["value"] > 0.8 * expanded["total"]
    assert probe[0, key - 1] == probe[0, query]  # the token before j is the query's own token
