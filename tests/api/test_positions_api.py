"""The `positions` intervention through POST /api/text/attention (tiny random BERT): its checks and its effect."""
from __future__ import annotations

import numpy as np
import pytest

SENTENCE = "the cat sat on the mat because it was tired ."


def post(client, interventions, **body):
    return client.post("/api/text/attention", json={"model": "tiny", "text": SENTENCE, "interventions": interventions,
                                                    **body})


@pytest.mark.parametrize("item,field", [
    ({"op": "positions", "mode": "sideways"}, "mode"),
    ({"op": "positions", "mode": "off", "seed": -1}, "seed"),
    ({"op": "positions", "mode": "off", "seed": 1.5}, "seed"),
    ({"op": "positions", "mode": "off", "layers": [0]}, "layers"),
    ({"op": "positions", "mode": "off", "heads": [1]}, "heads"),
    ({"op": "positions", "mode": "off", "kind": "cross"}, "kind"),
])
def test_bad_positions_item_is_422_naming_the_field(client, item, field):
    response = post(client, [item])
    assert response.status_code == 422, response.text
    assert field in response.text


def test_positions_off_changes_the_maps_and_reports_the_effect(client):
    base = post(client, []).json()
    off = post(client, [{"op": "positions", "mode": "off"}], compare=True)
    assert off.status_code == 200, off.text
    body = off.json()
    assert np.abs(np.array(body["attention"]) - np.array(base["attention"])).max() > 1e-3
    assert body["effect"] is not None and max(max(row) for row in body["effect"]["attention_tv"]) > 0
    shuffled = post(client, [{"op": "positions", "mode": "shuffle", "seed": 3}]).json()
    assert np.abs(np.array(shuffled["attention"]) - np.array(body["attention"])).max() > 1e-4


def test_permutation_check_agrees_with_positions_off_only(client):
    response = client.post("/api/text/permutation_check", json={"model": "tiny", "text": SENTENCE, "seed": 4})
    assert response.status_code == 200, response.text
    body = response.json()
    n = len(body["tokens"])
    assert body["order"][0] == 0 and body["order"][-1] == n - 1 and sorted(body["order"]) == list(range(n))
    assert body["order"] != list(range(n))
    assert body["permuted_tokens"] == [body["tokens"][i] for i in body["order"]]
    assert body["max_abs_positions_off"] <= 1e-5
    assert body["max_abs_positions_on"] > 1e-3  # tiny BERT's near-uniform maps still move 100× the bound


@pytest.mark.parametrize("body,field", [
    ({"text": "cat"}, "text"),  # [CLS] cat [SEP]: nothing to permute
    ({"text": SENTENCE, "seed": -1}, "seed"),
    ({"text": SENTENCE, "model": "nope"}, "model"),
])
def test_permutation_check_bad_input_is_422(client, body, field):
    response = client.post("/api/text/permutation_check", json={"model": "tiny", **body})
    assert response.status_code == 422, response.text
    assert field in response.text
