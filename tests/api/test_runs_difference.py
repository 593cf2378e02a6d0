"""Windows of kept runs (issue 20's gaps, docs/api.md "Runs, windows and long inputs"): the difference window P̂ − P
of two runs (`minus`, with a long compare's `base_run_id`) and the entropy of each window row over ALL its keys
(`row_entropy`), checked against the full maps of the same tiny Llama (GQA) run short, with masks and β."""
from __future__ import annotations

import numpy as np
import pytest
from tests.api.helpers import TINY_ATLAS, tiny_lm_client
from tests.api.helpers import TINY_TEXT as TEXT
from tests.float32 import assert_close_f32, attention_terms
from tests.tiny_models import build_text_model

# a key mask on two heads and a temperature on another: P̂ − P has cells of both signs in layer 1
INTERVENTIONS = [{"op": "mask_keys", "tokens": [2, 5], "layers": [1], "heads": [0, 3]},
                 {"op": "temperature", "beta": 0.5, "layers": [1], "heads": [2]}]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return str(build_text_model("llama", tmp_path_factory.mktemp("llama-diff")))


@pytest.fixture(scope="module")
def long_client(llama):
    with tiny_lm_client(llama, **TINY_ATLAS, max_window_cells=1000) as c:
        yield c


@pytest.fixture(scope="module")
def short_client(llama):
    with tiny_lm_client(llama) as c:
        yield c


def _attention(client, text=TEXT, **body):
    response = client.post("/api/text/attention", json={"model": "lm", "text": text, **body})
    assert response.status_code == 200, response.text
    return response.json()


def _window(client, run, **body):
    response = client.post(f"/api/runs/{run}/window", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def _entropy(p: np.ndarray) -> np.ndarray:
    p = p.astype(np.float64)
    return -(p * np.log(np.where(p > 0, p, 1.0))).sum(axis=-1)


def test_difference_window_is_the_difference_of_the_two_runs(long_client, short_client):
    long = _attention(long_client, interventions=INTERVENTIONS, compare=True)
    run, base = long["run_id"], long["base_run_id"]
    assert base and base != run and long["attention"] is None
    short = _attention(short_client, interventions=INTERVENTIONS, compare=True, include_base=True)
    full_diff = np.array(short["attention"]) - np.array(short["base_attention"])  # (L, H, T, T)
    n = len(long["tokens"])
    # windows rebuilt from q̂, k̂ against the full maps: q·k over the head size and the softmax over the keys, twice
    terms = 2 * attention_terms(long_client.app.state.runtime.adapter("lm").model.config, n)
    for head in range(4):
        box = {"layer": 1, "head": head, "rows": [3, n], "cols": [0, 14]}
        diff = np.array(_window(long_client, run, minus=base, **box)["attention"])
        after = np.array(_window(long_client, run, **box)["attention"])
        before = np.array(_window(long_client, base, **box)["attention"])
        assert np.array_equal(diff.astype(np.float32), after.astype(np.float32) - before.astype(np.float32))  # float32
        assert_close_f32(diff, full_diff[1, head, 3:n, 0:14], terms, scale=1.0)
    masked = np.array(_window(long_client, run, minus=base, layer=1, head=0, rows=[3, n], cols=[0, 14])["attention"])
    assert masked.min() < -1e-3 and masked.max() > 1e-3  # the masked keys lose, the others gain
    untouched = np.array(_window(long_client, run, minus=base, layer=0, head=0, rows=[3, n], cols=[0, 14])["attention"])
    assert np.all(untouched == 0)  # layer 0 has no intervention: P̂ = P, the same computation
    # a short run's windows are slices of its kept P: the difference too (the base run is kept, by its own id)
    short_base = _attention(short_client)["run_id"]
    diff = _window(short_client, short["run_id"], minus=short_base, layer=1, head=3, rows=[0, 9], cols=[0, n])
    kept_diff = np.array(short["attention"], dtype=np.float32) - np.array(short["base_attention"], dtype=np.float32)
    assert np.array_equal(np.array(diff["attention"], dtype=np.float32), kept_diff[1, 3, :9])  # of the kept maps


def test_overview_of_the_difference_from_the_base_overview(long_client, short_client):
    """A long compare answers the base run's overview on the same blocks: overview − base_overview is the block mean of
    P̂ − P (a block's mean is linear in P), checked against the full maps of the same model run short."""
    heads = [0, 1, 2, 3]
    long = _attention(long_client, interventions=INTERVENTIONS, compare=True, layers=[1], heads=heads)
    plain = _attention(long_client, layers=[1], heads=heads)  # the same tokens without interventions: the base run
    assert np.array_equal(np.array(long["base_overview"]), np.array(plain["overview"]["maps"]))  # the same base run
    short = _attention(short_client, interventions=INTERVENTIONS, compare=True, include_base=True)
    full_diff = np.array(short["attention"])[1] - np.array(short["base_attention"])[1]  # (H, T, T)
    rows, cols = long["overview"]["edges"], long["overview"]["col_edges"]
    expected = np.array([[[full_diff[h, r0:r1, c0:c1].mean() for c0, c1 in zip(cols, cols[1:])]
                          for r0, r1 in zip(rows, rows[1:])] for h in heads])  # (h, B, B)
    got = np.array(long["overview"]["maps"])[0] - np.array(long["base_overview"])[0]
    # block means of differences of float32 P (twice attention_terms) over at most T² cells, against float64
    n = full_diff.shape[-1]
    terms = 2 * attention_terms(long_client.app.state.runtime.adapter("lm").model.config, n) + n * n
    assert_close_f32(got, expected, terms, scale=1.0)
    assert np.abs(expected).max() > 1e-3
    # value-weighted: the base run's value-weighted overview is not formed, so none is sent
    weighted = _attention(long_client, interventions=INTERVENTIONS, compare=True, layers=[1], heads=[0],
                          weighting="value_norm")
    assert weighted["base_run_id"] and weighted["base_overview"] is None


def test_difference_window_refusals(long_client):
    run = _attention(long_client, interventions=INTERVENTIONS)["run_id"]
    other_tokens = _attention(long_client, text=TEXT + " again and again")["run_id"]
    box = {"layer": 1, "head": 0, "rows": [0, 4], "cols": [0, 4]}
    refused = long_client.post(f"/api/runs/{run}/window", json={**box, "minus": other_tokens})
    assert refused.status_code == 422 and "minus" in str(refused.json()["detail"]), refused.text
    gone = long_client.post(f"/api/runs/{run}/window", json={**box, "minus": "0" * 32})
    assert gone.status_code == 404 and "is unknown" in gone.json()["detail"]
    too_big = long_client.post(f"/api/runs/{run}/window", json={**box, "rows": [0, 38], "cols": [0, 38],
                                                                  "minus": other_tokens})
    assert too_big.status_code == 413 and "max_window_cells" in too_big.json()["detail"]


@pytest.mark.parametrize("beta", [None, 0.7])
def test_row_entropy_is_the_entropy_of_each_full_row(long_client, short_client, beta):
    """Each window row's entropy over every key (not the window's columns), at the run's β or the view β, with the
    run's key masks: equal to −Σ P log P of the full map's rows (≤ 1e-5)."""
    run = _attention(long_client, interventions=INTERVENTIONS)["run_id"]
    # the same run short, P in full; at a view β the same head re-run with that temperature
    ivs = INTERVENTIONS if beta is None else [INTERVENTIONS[0], {"op": "temperature", "beta": beta, "layers": [1],
                                                                 "heads": [0]}]
    full = np.array(_attention(short_client, interventions=ivs)["attention"])  # (L, H, T, T)
    n = full.shape[-1]
    window = _window(long_client, run, layer=1, head=0, rows=[1, n], cols=[4, 12], beta=beta)  # blocks of 4 rows
    expected = _entropy(full[1, 0, 1:n])
    assert len(window["row_entropy"]) == n - 1
    assert np.abs(np.array(window["row_entropy"]) - expected).max() <= 1e-5
    # not the entropy of the window's columns alone
    assert np.abs(np.array(window["row_entropy"]) - _entropy(full[1, 0, 1:n, 4:12])).max() > 1e-2


def test_row_entropy_of_value_weighted_windows_and_of_both_runs(long_client):
    long = _attention(long_client, interventions=INTERVENTIONS, compare=True)
    run, base, n = long["run_id"], long["base_run_id"], len(long["tokens"])
    box = {"layer": 1, "head": 3, "rows": [10, 14], "cols": [0, 6]}
    weighted = _window(long_client, run, weighting="value_norm", **box)
    rows = long_client.post(f"/api/runs/{run}/row", json={"row": 12, "layers": [1], "heads": [3],
                                                          "weighting": "value_norm"}).json()["attention"][0][0]
    assert abs(weighted["row_entropy"][2] - _entropy(np.array(rows))) <= 1e-5
    diff = _window(long_client, run, minus=base, **box)
    assert diff["row_entropy"] == _window(long_client, run, **box)["row_entropy"]
    assert diff["minus_row_entropy"] == _window(long_client, base, **box)["row_entropy"]
    assert n > 14


def test_difference_window_of_runs_with_other_tokens_is_refused(long_client, short_client):
    """`minus` needs the same tokens, not only as many (issue 56): two texts of the same length that differ from one
    token on are a 422 naming `minus` and where they first differ; texts of different lengths name both counts."""
    for client in (long_client, short_client):
        first = _attention(client, text="the cat sat on the mat")
        same_length = _attention(client, text="the cat sat on the dog")
        longer = _attention(client, text="the cat sat on the mat again")
        assert len(first["tokens"]) == len(same_length["tokens"]) < len(longer["tokens"])
        differ = next(i for i, (a, b) in enumerate(zip(first["tokens"], same_length["tokens"])) if a != b)
        n = len(first["tokens"])
        box = {"layer": 0, "head": 0, "rows": [0, 2], "cols": [0, 2]}
        refused = client.post(f"/api/runs/{first['run_id']}/window", json={**box, "minus": same_length["run_id"]})
        assert refused.status_code == 422, refused.text
        detail = str(refused.json()["detail"])
        assert "minus" in detail and f"position {differ}" in detail, detail
        refused = client.post(f"/api/runs/{first['run_id']}/window", json={**box, "minus": longer["run_id"]})
        assert refused.status_code == 422, refused.text
        detail = str(refused.json()["detail"])
        assert "minus" in detail and str(n) in detail and str(len(longer["tokens"])) in detail, detail
        # the same tokens (a run against itself) is still answered: a zero difference
        same = _window(client, first["run_id"], minus=first["run_id"], **box)
        assert np.all(np.array(same["attention"]) == 0)
