"""POST /api/text/patching, /lens, /faithfulness and the value-weighted maps and patch_heads op of
/api/text/attention, on tiny random models added the way an operator adds them; 4xx naming the field."""
from __future__ import annotations

import json

import numpy as np
import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from app.settings import Settings
from tests.tiny_models import build_text_model

CLEAN, CORRUPT = "the cat sat on the mat", "the dog ran on the rug"
PATCH = {"model": "tiny-llama", "clean": CLEAN, "corrupt": CORRUPT, "answer": "tired", "wrong": "house"}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    settings = Settings(
        # patching_batch_tokens: 3 copies of the 8-token prompts per batch, so a scan has several batches
        default_models=["tiny-llama"], max_response_numbers=200_000, patching_batch_tokens=24,
        extra_models={
            "tiny-llama": str(build_text_model("llama", tmp_path_factory.mktemp("llama"))),
            "tiny-bert": str(build_text_model("bert", tmp_path_factory.mktemp("bert"))),
            "tiny-bart": str(build_text_model("bart", tmp_path_factory.mktemp("bart"))),
        },
    )
    with TestClient(create_app(settings)) as c:
        c.app.state.runtime.warm_up()
        yield c


def _events(response) -> list[dict]:
    return [json.loads(line[len("data: "):]) for line in response.text.split("\n") if line.startswith("data: ")]


def _loc(response) -> list:
    return response.json()["detail"][0]["loc"]


def test_head_scan_shapes_and_a_patch_applied_as_an_intervention(client):
    r = client.post("/api/text/patching", json=PATCH)
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body["effect"]) == 2 and len(body["effect"][0]) == 4  # [L][H]
    assert len(body["attribution"]) == 2 and -1 <= body["rank_correlation"] <= 1
    assert body["ld_clean"] != body["ld_corrupt"] and len(body["clean_tokens"]) == len(body["corrupt_tokens"])
    # the cell with the largest effect, applied to the corrupted prompt through /api/text/attention
    flat = np.array(body["effect"])
    layer, head = np.unravel_index(np.abs(flat).argmax(), flat.shape)
    patch = {"op": "patch_heads", "source": body["clean_run_id"], "layers": [int(layer)], "heads": [int(head)]}
    r = client.post("/api/text/attention", json={"model": "tiny-llama", "text": CORRUPT, "interventions": [patch],
                                                 "compare": True, "layers": [0], "heads": [0]})
    assert r.status_code == 200, r.text
    assert r.json()["effect"]["output"]["kl"] > 0


def test_streamed_scan_reports_progress_then_the_same_result(client):
    plain = client.post("/api/text/patching", json={**PATCH, "scan": "residual"}).json()
    r = client.post("/api/text/patching", json={**PATCH, "scan": "residual"}, headers={"Accept": "text/event-stream"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = _events(r)
    progress = [e["progress"] for e in events if "progress" in e]
    assert progress == sorted(progress) and len(progress) >= 3 and progress[-1] == events[0]["total"]
    assert events[-1]["done"] is True
    assert np.allclose(np.array(events[-1]["effect"], dtype=float), np.array(plain["effect"], dtype=float), atol=1e-5)
    assert np.array(plain["effect"]).shape == (2, len(plain["clean_tokens"]))


def test_patching_refuses_what_it_cannot_do_naming_the_field(client):
    r = client.post("/api/text/patching", json={**PATCH, "corrupt": "the dog ran"})
    assert r.status_code == 422 and _loc(r) == ["body", "corrupt"]
    message = r.json()["detail"][0]["msg"]
    assert "has 8 tokens" in message and " 5" in message  # both counts ([CLS] … [SEP] around the words)
    r = client.post("/api/text/patching", json={**PATCH, "answer": "cat dog"})
    assert r.status_code == 422 and _loc(r) == ["body", "answer"] and "2 tokens" in r.json()["detail"][0]["msg"]
    r = client.post("/api/text/patching", json={**PATCH, "wrong": "tired"})
    assert r.status_code == 422 and _loc(r) == ["body", "wrong"]
    r = client.post("/api/text/patching", json={**PATCH, "model": "tiny-bert"})
    assert r.status_code == 422 and _loc(r) == ["body", "model"]
    r = client.post("/api/text/patching", json={**PATCH, "scan": "residual", "method": "attribution"})
    assert r.status_code == 422 and _loc(r) == ["body", "method"]


def test_patch_heads_source_must_be_kept_and_of_the_same_length(client):
    run_id = client.post("/api/text/patching", json={**PATCH, "method": "attribution"}).json()["clean_run_id"]
    unknown = {"op": "patch_heads", "source": "0" * 32}
    r = client.post("/api/text/attention", json={"model": "tiny-llama", "text": CORRUPT, "interventions": [unknown]})
    assert r.status_code == 422 and _loc(r) == ["body", "interventions", 0, "source"]
    shorter = {"op": "patch_heads", "source": run_id}
    r = client.post("/api/text/attention", json={"model": "tiny-llama", "text": "the dog", "interventions": [shorter]})
    assert r.status_code == 422 and "same token count" in r.json()["detail"][0]["msg"]
    r = client.post("/api/text/generate", json={"model": "tiny-llama", "text": CORRUPT, "interventions": [shorter]})
    assert r.status_code == 422 and _loc(r) == ["body", "interventions", 0, "source"]
    r = client.post("/api/text/attention", json={"model": "tiny-bart", "text": CORRUPT, "interventions": [shorter]})
    assert r.status_code == 422


def test_lens_last_row_is_the_next_token_output_and_compare_shows_before(client):
    attention = client.post("/api/text/attention", json={"model": "tiny-llama", "text": CLEAN, "layers": [0], "heads": [0]}).json()
    ablate = {"op": "ablate_heads", "layers": [1], "mode": "mean"}
    r = client.post("/api/text/lens", json={"model": "tiny-llama", "text": CLEAN, "top": 3, "interventions": [ablate],
                                            "compare": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body["top"]) == 2 and len(body["top"][0]) == len(attention["tokens"]) and len(body["top"][0][0]) == 3
    before_last = body["top_before"][-1][-1]
    assert [c["id"] for c in before_last] == [t["id"] for t in attention["output"]["top"][:3]]
    assert before_last[0]["prob"] == pytest.approx(attention["output"]["top"][0]["prob"], abs=1e-5)
    assert body["top"][0] == body["top_before"][0]  # layer 0 is upstream of the ablation
    assert body["top"][1] != body["top_before"][1]


def test_value_norm_weighting_rows_sum_to_one_and_differ_from_p(client):
    req = {"model": "tiny-bert", "text": "the cat sat on the mat", "layers": [1], "heads": [0, 2]}
    plain = np.array(client.post("/api/text/attention", json=req).json()["attention"])
    r = client.post("/api/text/attention", json={**req, "weighting": "value_norm"})
    assert r.status_code == 200 and r.json()["weighting"] == "value_norm"
    weighted = np.array(r.json()["attention"])
    assert weighted.shape == plain.shape and np.allclose(weighted.sum(-1), 1, atol=1e-5)
    assert not np.allclose(weighted, plain, atol=1e-3)
    r = client.post("/api/text/attention", json={"model": "tiny-bart", "text": "the cat", "weighting": "value_norm"})
    assert r.status_code == 422 and _loc(r) == ["body", "weighting"]


def test_faithfulness_endpoint(client):
    r = client.post("/api/text/faithfulness", json={"model": "tiny-llama", "text": CLEAN, "k": [1, 2]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body["methods"]) == {"attention", "value_norm", "rollout", "grad_attention"}
    assert all(len(m["kl"]) == 2 and len(m["p_drop"]) == 2 for m in body["methods"].values())
    r = client.post("/api/text/faithfulness", json={"model": "tiny-llama", "text": CLEAN, "position": 99})
    assert r.status_code == 422 and _loc(r) == ["body", "position"]
    r = client.post("/api/text/faithfulness", json={"model": "tiny-bert", "text": CLEAN, "methods": ["rollout"]})
    assert r.status_code == 200 and "change" not in r.json()["methods"]["rollout"]  # an MLM: kl and p_drop


def test_mean_ablation_is_refused_for_continuations(client):
    mean = {"op": "ablate_heads", "layers": [0], "mode": "mean"}
    r = client.post("/api/text/generate", json={"model": "tiny-llama", "text": CLEAN, "interventions": [mean]})
    assert r.status_code == 422 and _loc(r) == ["body", "interventions", 0, "mode"]
    r = client.post("/api/text/attention", json={"model": "tiny-llama", "text": CLEAN, "interventions": [mean],
                                                 "compare": True, "layers": [0], "heads": [0]})
    assert r.status_code == 200 and r.json()["effect"]["output"]["kl"] > 0


def test_faithfulness_of_one_head_and_its_bounds(client):
    r = client.post("/api/text/faithfulness", json={"model": "tiny-llama", "text": CLEAN, "k": [1], "layer": 1, "head": 3,
                                                    "methods": ["attention"]})
    assert r.status_code == 200, r.text
    r = client.post("/api/text/faithfulness", json={"model": "tiny-llama", "text": CLEAN, "layer": 2})
    assert r.status_code == 422 and _loc(r) == ["body", "layer"]
    r = client.post("/api/text/faithfulness", json={"model": "tiny-llama", "text": CLEAN, "head": 1})
    assert r.status_code == 422 and _loc(r) == ["body", "head"]
