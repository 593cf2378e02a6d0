"""`lab.circuit(…)` of the notebook client against a live server of its own (`Lab.start()`), on a tiny random GQA
Llama: the result's edges are the server's JSON answer to the same request (sent here with urllib, not through the
client), `.circuit(budget)` at the request's budget is the server's in_graph set, `.edge(name)` is the edge
endpoint's answer, `.to_json` keeps every edge, and errors carry the server's detail."""
from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from attnlab import Lab, LabError
from tests.tiny_models import build_text_model

ROOT = Path(__file__).resolve().parents[2]
LOG = ROOT / "artifacts" / "notebook-circuit-server.log"
PAIRS = [{"clean": "the cat sat on the mat", "corrupt": "the dog ran on the rug", "answer": "tired", "wrong": "house"}]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    folder = tmp_path_factory.mktemp("circuit-models")
    models = {"lm": str(build_text_model("llama", folder / "llama"))}
    LOG.parent.mkdir(exist_ok=True)
    with Lab.start(settings={"default_models": ["lm"], "extra_models": models}, log=LOG) as started:
        yield started


def raw(lab: Lab, path: str, body: dict) -> dict:
    call = urllib.request.Request(lab.url + path, data=json.dumps(body).encode(),
                                  headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(call, timeout=300) as answer:
        return json.loads(answer.read())


def test_circuit_is_the_servers_answer(lab, tmp_path):
    result = lab.circuit(PAIRS, model="lm", top=None, budget=0.2, budgets=[0, 0.2, 1])
    server = raw(lab, "/api/text/circuit", {"model": "lm", "pairs": PAIRS, "top": None, "budget": 0.2,
                                            "budgets": [0, 0.2, 1]})
    assert result.edges == {name: item["score"] for name, item in server["edges"].items()}
    assert len(result.edges) == result.n_edges == 110
    assert result.faithfulness == server["faithfulness"] and result.cpr == server["cpr"]
    kept = result.circuit(0.2)
    assert set(kept) == {name for name, item in server["edges"].items() if item["in_graph"]}
    assert result.circuit(0) == {} and len(result.circuit(1)) == 110
    name = next(iter(kept))
    why = result.edge(name)
    assert why == raw(lab, "/api/text/circuit/edge", {"model": "lm", "pair": PAIRS[0], "edge": name, "query": None})
    saved = json.loads(result.to_json(tmp_path / "circuit.json").read_text())
    assert {k: v["score"] for k, v in saved["edges"].items()} == result.edges


def test_a_task_and_exact_scores(lab):
    result = lab.circuit(task={"name": "induction", "n": 2, "seed": 1}, model="lm", method="exact", n_exact=5,
                         budgets=[0, 1])
    assert len(result.edges) == 5 and result.data["exact"]["n"] == 5
    with pytest.raises(ValueError, match="lists 5"):
        result.circuit(0.5)


def test_errors_carry_the_servers_detail(lab):
    with pytest.raises(LabError, match="same token count"):
        lab.circuit([{**PAIRS[0], "corrupt": "the dog"}], model="lm")
