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


def test_the_readme_example_is_seeded_and_says_what_varies_with_the_draw(lm, probe):
    """Issue 38 §7: the README's "why?" example names its draw (seed 0, the probe above) and says what changes with
    another: L17 H8 may tie L16 H0 on the key side. On the seeded draw, from i = 60, L16 H0 leads; on seed 3 the two
    are within 10 % of each other."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    why = readme[readme.index("**Why a head attends.**"):readme.index("**Which kind is each head")]
    assert "manual_seed(0)" in why and "L17 H8" in why and "tie" in why

    def key_side(tokens_probe, query=60):
        found = qk_attribution(lm, tokens_probe, *INDUCTION, query, query - REPEAT + 1, expand=0)
        return dict(zip(found.key_parts, found.matrix.sum(dim=0).tolist()))

    seeded = key_side(probe)
    ranked = sorted(seeded, key=lambda name: -abs(seeded[name]))
    assert ranked[0] == "L16.H0", ranked[:5]
    tokens = torch.randint(1000, 40000, (REPEAT,), generator=torch.Generator().manual_seed(3)).tolist()
    other = key_side(torch.tensor([[lm.tokenizer.bos_token_id] + tokens + tokens]))
    assert abs(other["L16.H0"] - other["L17.H8"]) < 0.1 * other["L16.H0"], (other["L16.H0"], other["L17.H8"])
