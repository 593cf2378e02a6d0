"""The plain and encoder–decoder views share their checks and their sample loop (issue 20 §2; app/pipeline/job.py
ComparedJob.runs): with `compare` and several samples both answer the mean effect over the re-seeded samples with
its spread, one sample's effect is that run's, and both refuse an oversized response the same way."""
from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from app.settings import Settings
from tests.tiny_models import build_text_model

TEXT = "the cat sat on the mat because it was tired"
NOISE = [{"op": "perturb_keys", "noise_std": 2.0, "seed": 3}]
TARGET = {"tiny-bert": {}, "tiny-bart": {"target": "the dog ran"}}  # a fixed target: a known response size


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    settings = Settings(default_models=[], max_response_numbers=1_000, extra_models={
        "tiny-bert": str(build_text_model("bert", tmp_path_factory.mktemp("bert"))),
        "tiny-bart": str(build_text_model("bart", tmp_path_factory.mktemp("bart")))})
    with TestClient(create_app(settings)) as c:
        yield c


@pytest.mark.parametrize("model", ["tiny-bert", "tiny-bart"])
def test_samples_give_the_mean_effect_with_its_spread(client, model):
    body = {"model": model, "text": TEXT, "layers": [0], "heads": [0], "compare": True, "interventions": NOISE, **TARGET[model]}
    one = client.post("/api/text/attention", json=body)
    three = client.post("/api/text/attention", json={**body, "samples": 3})
    assert one.status_code == 200 and three.status_code == 200, (one.text[:200], three.text[:200])
    one, three = one.json()["effect"], three.json()["effect"]
    assert "samples" not in one and three["samples"] == 3
    assert "hidden_cosine_std" in three and len(three["hidden_cosine_std"]) == len(one["hidden_cosine"])
    assert any(s > 0 for s in three["hidden_cosine_std"])  # the samples' noise differs: a spread, not one run thrice
    assert three["hidden_cosine"] != one["hidden_cosine"]  # a mean over three runs, not the first run's


@pytest.mark.parametrize("model", ["tiny-bert", "tiny-bart"])
def test_an_oversized_response_is_refused_before_it_runs(client, model):
    r = client.post("/api/text/attention", json={"model": model, "text": TEXT, **TARGET[model]})  # every layer and head
    assert r.status_code == 413 and "max_response_numbers=1,000" in r.json()["detail"], r.text[:300]
