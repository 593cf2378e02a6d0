"""POST /api/text/qk_attribution (docs/api.md "Why a head attends") on tiny random decoders: the score equals β × the
run's own `scores` from a window with include_scores (with and without interventions), the matrix and its marginals
add up, bad fields are 422s naming them, and a post-norm BERT is a 422 naming `model` that says why."""
from __future__ import annotations

import pytest

from tests.api.helpers import tiny_models_client

TEXT = "the cat sat on the mat because it was tired and the dog ran"


@pytest.fixture(scope="module")
def why_client(tmp_path_factory, tiny_bert):
    with tiny_models_client(tmp_path_factory, {"tiny-llama": "llama", "tiny-gemma2": "gemma2"},
                            default_models=["tiny-llama"], extra_text_models={"bert": str(tiny_bert)},
                            max_response_numbers=200_000) as client:
        yield client


def _window_score(client, model, text, interventions, layer, head, query, key) -> float:
    run = client.post("/api/text/attention", json={"model": model, "text": text, "layers": [layer], "heads": [head],
                                                   "interventions": interventions})
    assert run.status_code == 200, run.text
    window = client.post(f"/api/runs/{run.json()['run_id']}/window", json={
        "layer": layer, "head": head, "rows": [query, query + 1], "cols": [key, key + 1], "include_scores": True})
    assert window.status_code == 200, window.text
    return window.json()["scores"][0][0]


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-gemma2"])
@pytest.mark.parametrize("interventions", [
    [],
    [{"op": "temperature", "beta": 0.5, "layers": [1]}, {"op": "mask_keys", "tokens": [1, 3], "layers": [0]},
     {"op": "perturb_keys", "layers": [1], "heads": [2], "tokens": [4], "scale": 1.3, "noise_std": 0.2, "seed": 7}],
])
def test_score_is_beta_times_the_windows_scores_and_the_matrix_adds_up(why_client, model, interventions):
    layer, head, query, key = 1, 2, 10, 4
    body = {"model": model, "text": TEXT, "layer": layer, "head": head, "query": query, "key": key,
            "interventions": interventions}
    response = why_client.post("/api/text/qk_attribution", json=body)
    assert response.status_code == 200, response.text
    found = response.json()
    scores = _window_score(why_client, model, TEXT, interventions, layer, head, query, key)
    assert found["score"] == pytest.approx(found["beta"] * scores, rel=1e-5)
    assert found["sum"] == pytest.approx(found["score"], rel=1e-4)
    matrix = found["matrix"]
    assert len(matrix) == len(found["query_parts"]) and len(matrix[0]) == len(found["key_parts"])
    assert found["query_totals"] == pytest.approx([sum(row) for row in matrix])
    assert found["key_totals"] == pytest.approx([sum(col) for col in zip(*matrix)])
    assert abs(found["top"][0]["value"]) == pytest.approx(max(abs(v) for row in matrix for v in row))
    assert found["tokens"][query] and found["expanded"]
    for entry in found["expanded"]:
        assert all(s["token"] == found["tokens"][s["position"]] for s in entry["sources"])
    if interventions:
        assert found["beta"] == pytest.approx(0.5) and "perturbation" in found["key_parts"]


@pytest.mark.parametrize("body, field", [
    ({"layer": 2}, "layer"), ({"head": 4}, "head"), ({"query": 99}, "query"), ({"key": 11}, "key"),
    ({"expand": 17}, "expand"), ({"model": "nope"}, "model"), ({"text": ""}, "text"), ({"chat": True}, "chat"),
    ({"interventions": [{"op": "mask_keys", "tokens": [50]}]}, "interventions"),
])
def test_bad_fields_are_422_naming_them(why_client, body, field):
    response = why_client.post("/api/text/qk_attribution", json={
        "model": "tiny-llama", "text": TEXT, "layer": 1, "head": 0, "query": 10, "key": 4, **body})
    assert response.status_code == 422, response.text
    assert field in response.json()["detail"][0]["loc"]


def test_post_norm_bert_is_422_naming_model_and_saying_why(why_client):
    response = why_client.post("/api/text/qk_attribution", json={
        "model": "bert", "text": TEXT, "layer": 1, "head": 0, "query": 5, "key": 2})
    assert response.status_code == 422, response.text
    detail = response.json()["detail"][0]
    assert detail["loc"] == ["body", "model"] and "post-norm" in detail["msg"]


def test_ids_stand_in_for_text(why_client):
    """`ids` instead of `text` (docs/api.md: a continuation's ids, which its text may not tokenize back to): no `text`
    needed; the same split as the text those ids are. Neither one is a 422 naming both fields."""
    where = {"model": "tiny-llama", "layer": 1, "head": 2, "query": 10, "key": 4}
    by_text = why_client.post("/api/text/qk_attribution", json={**where, "text": TEXT})
    assert by_text.status_code == 200, by_text.text
    ids = why_client.app.state.runtime.adapter("tiny-llama").prompt_ids(TEXT)
    by_ids = why_client.post("/api/text/qk_attribution", json={**where, "ids": ids})
    assert by_ids.status_code == 200, by_ids.text
    assert by_ids.json()["tokens"] == by_text.json()["tokens"]
    assert by_ids.json()["score"] == pytest.approx(by_text.json()["score"], rel=1e-6)
    neither = why_client.post("/api/text/qk_attribution", json=where)
    assert neither.status_code == 422, neither.text
    assert "text" in neither.text and "ids" in neither.text
