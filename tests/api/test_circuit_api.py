"""POST /api/text/circuit and /api/text/circuit/edge on a tiny random GQA Llama (tests/tiny_models.py): the edge
names and counts, the faithfulness ends, the exact scores against the edge endpoint's, the job's events, and the
4xx naming the field (docs/api.md "Circuits through attention")."""
from __future__ import annotations

import pytest

from tests.api.helpers import sse_events, tiny_models_client

PAIRS = [{"clean": "the cat sat on the mat", "corrupt": "the dog ran on the rug", "answer": "tired", "wrong": "house"},
         {"clean": "a red car was big", "corrupt": "a blue tree was small", "answer": "it", "wrong": "street"}]
BODY = {"model": "tiny-llama", "pairs": PAIRS}
N_EDGES = 110  # 2 layers × 4 heads: 12·(1 + 6) + (5 + 10) + 11


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with tiny_models_client(tmp_path_factory, {"tiny-llama": "llama", "tiny-bert": "bert"},
                            default_models=["tiny-llama"]) as c:
        yield c


def _loc(response) -> list:
    return response.json()["detail"][0]["loc"]


def test_eap_names_every_edge_and_the_curve_ends_at_0_and_1(client):
    r = client.post("/api/text/circuit", json={**BODY, "top": None, "budgets": [0, 0.1, 0.5, 1]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["n_edges"] == body["edges_returned"] == len(body["edges"]) == N_EDGES
    assert {"input->a0.h0<q>", "a0.h3->a1.h1<k>", "a0.h0->m0", "m1->logits", "input->logits"} <= set(body["edges"])
    assert body["nodes"][:2] == ["input", "a0.h0"] and body["nodes"][-1] == "logits" and len(body["nodes"]) == 12
    curve = body["faithfulness"]
    assert [p["budget"] for p in curve] == [0, 0.1, 0.5, 1]
    assert abs(curve[0]["value"]) < 1e-4 and abs(curve[-1]["value"] - 1) < 1e-4 and curve[-1]["n_edges"] == N_EDGES
    assert body["metric"]["clean"] != body["metric"]["corrupt"] and body["pairs"] == 2
    scores = [abs(e["score"]) for e in body["edges"].values()]
    assert scores == sorted(scores, reverse=True)
    assert sum(e["in_graph"] for e in body["edges"].values()) == body["in_graph"]


def test_top_lists_the_largest_edges(client):
    everything = client.post("/api/text/circuit", json={**BODY, "top": None, "budgets": [0, 1]}).json()["edges"]
    top = client.post("/api/text/circuit", json={**BODY, "top": 5, "budgets": [0, 1]}).json()["edges"]
    assert list(top) == list(everything)[:5]


def test_exact_scores_agree_with_the_edge_endpoint(client):
    edges = ["a0.h1->a1.h2<k>", "input->a0.h3<q>", "m0->a1.h0<v>", "a1.h0->logits"]
    one = [PAIRS[0]]
    r = client.post("/api/text/circuit", json={"model": "tiny-llama", "pairs": one, "method": "exact",
                                               "edges": edges, "budgets": [0, 1]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert list(body["edges"]) == edges and body["exact"]["n"] == 4
    for edge in edges:
        why = client.post("/api/text/circuit/edge", json={"model": "tiny-llama", "pair": PAIRS[0], "edge": edge})
        assert why.status_code == 200, why.text
        assert abs(why.json()["score"] - body["edges"][edge]["score"]) < 1e-5
    why = client.post("/api/text/circuit/edge", json={"model": "tiny-llama", "pair": PAIRS[0], "edge": edges[0]}).json()
    assert len(why["row_before"]) == len(why["row_after"]) == len(why["tokens"]) and why["part"] == "L0.H1"
    assert why["qk"]["key_parts"] and why["part_share"]["key"] is not None
    writes = client.post("/api/text/circuit/edge", json={"model": "tiny-llama", "pair": PAIRS[0],
                                                         "edge": edges[2]}).json()["writes"]
    assert len(writes["before"]) == len(writes["after"]) == 10


def test_eap_ig_and_a_task_stream_as_a_job(client):
    r = client.post("/api/text/circuit", json={"model": "tiny-llama", "task": {"name": "induction", "n": 2, "seed": 3},
                                               "method": "eap_ig", "ig_steps": 3, "budgets": [0, 1], "top": 3},
                    headers={"Accept": "text/event-stream"})
    assert r.status_code == 200, r.text
    events = sse_events(r)
    assert any("progress" in e for e in events)
    done = events[-1]
    assert done.get("done") is True and done["ig_steps"] == 3 and len(done["prompts"]) == 2
    assert done["task"] == {"name": "induction", "n": 2, "seed": 3}


@pytest.mark.parametrize("body,loc", [
    ({**BODY, "pairs": [{**PAIRS[0], "corrupt": "the dog ran"}]}, ["body", "pairs", 0, "corrupt"]),
    ({**BODY, "pairs": [{**PAIRS[0], "answer": "tired house"}]}, ["body", "pairs", 0, "answer"]),
    ({**BODY, "pairs": [{**PAIRS[0], "wrong": "tired"}]}, ["body", "pairs", 0, "wrong"]),
    ({**BODY, "task": {"name": "capital"}}, ["body", "pairs"]),
    ({"model": "tiny-llama"}, ["body", "pairs"]),
    ({"model": "tiny-llama", "task": {"name": "ioi", "n": 2}}, ["body", "task", "name"]),
    ({**BODY, "method": "exact", "edges": ["a1.h0->a0.h1<q>"]}, ["body", "edges", 0]),
    ({**BODY, "method": "exact", "edges": ["a0.h9->m1"]}, ["body", "edges", 0]),
    ({**BODY, "budgets": [1.5]}, ["body", "budgets", 0]),
    ({**BODY, "interventions": [{"op": "temperature", "beta": 2}]}, ["body", "interventions"]),
    ({**BODY, "model": "tiny-bert"}, ["body", "model"]),
    ({**BODY, "pairs": [PAIRS[0], {**PAIRS[1], "clean": "a" * 20_001}]}, ["body", "pairs", 1, "clean"]),  # max_text_chars
])
def test_bad_requests_name_the_field(client, body, loc):
    r = client.post("/api/text/circuit", json=body)
    assert r.status_code == 422, r.text
    assert _loc(r)[:len(loc)] == loc, r.json()


def test_an_encoder_is_refused_naming_its_family(client):
    r = client.post("/api/text/circuit", json={**BODY, "model": "tiny-bert"})
    assert r.status_code == 422 and "Bert" in r.json()["detail"][0]["msg"], r.text


@pytest.mark.parametrize("body,loc", [
    ({"edge": "m1->a0.h0<q>"}, ["body", "edge"]),
    ({"edge": "a0.h0->a1.h0"}, ["body", "edge"]),
    ({"edge": "a0.h0->m0", "query": 99}, ["body", "query"]),
    ({"edge": "a0.h0->m0", "pair": {**PAIRS[0], "corrupt": "the dog"}}, ["body", "pair", "corrupt"]),
    ({"edge": "a0.h0->m0", "pair": {**PAIRS[0], "corrupt": "a" * 20_001}}, ["body", "pair", "corrupt"]),
])
def test_bad_edge_requests_name_the_field(client, body, loc):
    r = client.post("/api/text/circuit/edge", json={"model": "tiny-llama", "pair": PAIRS[0], **body})
    assert r.status_code == 422, r.text
    assert _loc(r)[:len(loc)] == loc, r.json()
