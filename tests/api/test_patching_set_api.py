"""POST /api/text/patching over a set of prompt pairs (`pairs` or `template` + `fillers`) on a tiny random decoder:
the set's numbers against the single-pair answers, the job's events, and the 4xx naming the field."""
from __future__ import annotations

import numpy as np
import pytest

from tests.api.helpers import sse_events, tiny_models_client

PAIRS = [{"clean": "the cat sat on the mat", "corrupt": "the dog ran on the rug"},
         {"clean": "a red car was big", "corrupt": "a blue tree was small", "answer": "it", "wrong": "street"}]
SET = {"model": "tiny-llama", "answer": "tired", "wrong": "house", "pairs": PAIRS, "top_k": 3}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with tiny_models_client(tmp_path_factory, {"tiny-llama": "llama"}, default_models=["tiny-llama"],
                            patching_batch_tokens=24, patching_max_pairs=4) as c:
        yield c


def _loc(response) -> list:
    return response.json()["detail"][0]["loc"]


def _array(value) -> np.ndarray:
    return np.array(value, dtype=float)


def test_a_set_is_the_mean_of_its_single_pair_scans(client):
    r = client.post("/api/text/patching", json=SET)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["set"] is True and body["n_pairs"] == 2 and body["pairs_used"] == [0, 1]
    singles = []
    for pair in PAIRS:
        single = {"model": "tiny-llama", "answer": pair.get("answer", "tired"), "wrong": pair.get("wrong", "house"),
                  "clean": pair["clean"], "corrupt": pair["corrupt"]}
        answer = client.post("/api/text/patching", json=single)
        assert answer.status_code == 200, answer.text
        singles.append(answer.json())
    per_pair = _array(body["effect_per_pair"])  # (P, L, H)
    assert per_pair.shape == (2, 2, 4)
    for k, single in enumerate(singles):
        assert np.array_equal(per_pair[k], _array(single["effect"]))  # the same code per pair: exactly
        assert np.array_equal(_array(body["estimates"]["head_output"]["per_pair"][k]), _array(single["attribution"]))
        assert body["pairs"][k]["ld_clean"] == single["ld_clean"]
    assert np.allclose(_array(body["effect"]), per_pair.mean(axis=0), atol=1e-7)
    assert np.allclose(_array(body["effect_std"]), per_pair.std(axis=0, ddof=1), atol=1e-6)
    for name in ("head_output", "atp", "atp_star"):
        numbers = body["agreement"][name]
        assert -1 <= numbers["spearman"] <= 1 and 0 <= numbers["top_k_overlap"] <= 1 and numbers["k"] == 3
        assert _array(body["estimates"][name]["mean"]).shape == (2, 4)
    assert body["pairs"][1]["answer"] == "it" and body["pairs"][0]["answer"] == "tired"


def test_a_template_with_fillers_is_the_same_set(client):
    template = {"text": "the {animal} {verb} on the {thing}",
                "fillers": [{"clean": {"animal": "cat", "verb": "sat", "thing": "mat"},
                             "corrupt": {"animal": "dog", "verb": "ran", "thing": "rug"}},
                            {"clean": {"animal": "dog", "verb": "sat", "thing": "mat"},
                             "corrupt": {"animal": "cat", "verb": "ran", "thing": "rug"}}]}
    from_template = client.post("/api/text/patching", json={**SET, "pairs": None, "template": template})
    assert from_template.status_code == 200, from_template.text
    pairs = [{"clean": "the cat sat on the mat", "corrupt": "the dog ran on the rug"},
             {"clean": "the dog sat on the mat", "corrupt": "the cat ran on the rug"}]
    from_pairs = client.post("/api/text/patching", json={**SET, "pairs": pairs}).json()
    assert from_template.json()["effect"] == from_pairs["effect"]


def test_a_streamed_set_is_a_job_with_progress_then_the_same_answer(client):
    plain = client.post("/api/text/patching", json=SET).json()
    r = client.post("/api/text/patching", json=SET, headers={"Accept": "text/event-stream"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r)  # checks the accepted event (eta_s, queue_position, runs)
    progress = [e for e in events if "progress" in e]
    steps = [e["progress"] for e in progress]
    total = 2 * (2 * 4 + 1)  # per pair: its 8 heads and the estimates
    assert steps == sorted(steps) and len(steps) >= 4 and steps[-1] == total and progress[0]["total"] == total
    assert events[-1]["done"] is True
    assert events[-1]["effect"] == plain["effect"] and events[-1]["agreement"] == plain["agreement"]


def test_the_estimates_alone(client):
    r = client.post("/api/text/patching", json={**SET, "method": "attribution"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert "agreement" not in body and "effect_per_pair" not in body
    assert body["effect"] == body["estimates"]["atp_star"]["mean"]


@pytest.mark.parametrize("change, status, loc", [
    ({"pairs": [PAIRS[0], {"clean": "the cat sat", "corrupt": "the dog ran on the rug"}]}, 422,
     ["body", "pairs", 1, "corrupt"]),
    ({"answer": None}, 422, ["body", "pairs", 0, "answer"]),
    ({"pairs": [{**PAIRS[0], "wrong": "cat dog"}]}, 422, ["body", "pairs", 0, "wrong"]),
    ({"pairs": [{**PAIRS[0], "clean": "   "}]}, 422, ["body", "pairs", 0, "clean"]),
    ({"pairs": [PAIRS[0]] * 5}, 413, None),
    ({"scan": "residual"}, 422, ["body", "scan"]),
    ({"clean": "the cat"}, 422, ["body", "clean"]),
    ({"pairs": []}, 422, ["body", "pairs"]),
    ({"template": {"text": "the {animal} sat", "fillers": [{"clean": {"animal": "cat"}, "corrupt": {}}]}}, 422,
     ["body", "template"]),
    ({"pairs": None, "template": {"text": "the {animal} sat", "fillers": [{"clean": {"animal": "cat"},
                                                                            "corrupt": {"beast": "dog"}}]}}, 422,
     ["body", "template", "fillers", 0, "corrupt"]),
    ({"pairs": None, "template": {"text": "the cat sat", "fillers": [{"clean": {}, "corrupt": {}}]}}, 422,
     ["body", "template", "text"]),
    ({"pairs": None, "template": {"text": "the {cat sat", "fillers": [{"clean": {}, "corrupt": {}}]}}, 422,
     ["body", "template", "text"]),
    ({"pairs": None, "template": {"text": "the {cat:d} sat", "fillers": [{"clean": {"cat": "a"},
                                                                         "corrupt": {"cat": "b"}}]}}, 422,
     ["body", "template", "text"]),
])
def test_a_bad_set_is_refused_naming_the_field(client, change, status, loc):
    r = client.post("/api/text/patching", json={**SET, **change})
    assert r.status_code == status, r.text
    if loc is None:
        detail = r.json()["detail"]
        assert detail.startswith("pairs:") and "patching_max_pairs" in detail and "limit is 4" in detail
    else:
        assert _loc(r)[:len(loc)] == loc, r.json()


def test_a_single_pair_still_needs_its_prompts(client):
    r = client.post("/api/text/patching", json={"model": "tiny-llama", "clean": "the cat", "answer": "tired",
                                                "wrong": "house"})
    assert r.status_code == 422 and _loc(r) == ["body", "corrupt"]


def test_a_set_over_the_time_limit_is_refused_before_it_runs_naming_its_field(client, monkeypatch):
    """The cost check counts every pair: 413 naming `pairs` (or `template`) before any forward."""
    import app.costs

    per_mac = []
    monkeypatch.setattr(app.costs, "estimated_seconds", lambda adapter, settings, macs: per_mac.append(macs) or 1e7)
    r = client.post("/api/text/patching", json=SET)
    assert r.status_code == 413 and r.json()["detail"].startswith("pairs: a head scan of 2 pairs"), r.text
    one = client.post("/api/text/patching", json={**SET, "pairs": PAIRS[:1]})
    assert one.status_code == 413
    assert 1.5 * per_mac[1] < per_mac[0] < 2 * per_mac[1]  # the first pair and a shorter second against the first alone
