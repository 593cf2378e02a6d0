"""What one request may ask: the settings' limits on interventions and samples (every route, generate included), a
generate stream's whole-stream time limit, and the cost estimate: arithmetic on the model's shape, a 413 before work
that would time out, never for a request served from cached runs."""
from __future__ import annotations

import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from app.settings import Settings
from tests.api.helpers import make_settings


@pytest.mark.parametrize("limited_client", [{"max_interventions": 2, "max_samples": 3}], indirect=True)
def test_intervention_and_sample_limits_come_from_settings(limited_client):
    one = {"op": "temperature", "beta": 0.5}
    base = {"model": "tiny", "text": "the cat sat", "layers": [0], "heads": [0]}
    assert limited_client.post("/api/text/attention", json={**base, "interventions": [one] * 2}).status_code == 200
    r = limited_client.post("/api/text/attention", json={**base, "interventions": [one] * 3})
    assert r.status_code == 422 and "max_interventions" in r.text
    r = limited_client.post("/api/text/attention", json={**base, "samples": 4})
    assert r.status_code == 422 and "max_samples" in r.text


def _sse(response) -> list[dict]:
    import json

    return [json.loads(line[5:]) for line in response.text.splitlines() if line.startswith("data:")]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    from tests.tiny_models import build_text_model

    return build_text_model("llama", tmp_path_factory.mktemp("llama19"))


def lm_client(tiny_llama, **overrides) -> TestClient:
    values = dict(default_models=["tl"], extra_models={"tl": str(tiny_llama)}, max_new_tokens=12)
    values.update(overrides)
    client = TestClient(create_app(Settings(**values)))
    client.__enter__()
    client.app.state.runtime.warm_up()
    return client


PERTURB = {"op": "perturb_keys", "noise_std": 0.1, "seed": 1}


def test_generate_checks_max_interventions_like_every_route(tiny_llama):
    """§2: 65 interventions were accepted by /api/text/generate while /api/text/attention answered 422."""
    client = lm_client(tiny_llama)
    try:
        body = {"model": "tl", "text": "the cat sat on the mat", "max_new_tokens": 2, "interventions": [PERTURB] * 65}
        for path in ("/api/text/generate", "/api/text/attention"):
            r = client.post(path, json=body if path.endswith("generate") else
                            {k: v for k, v in body.items() if k != "max_new_tokens"})
            assert r.status_code == 422, (path, r.status_code, r.text[:200])
            assert "max_interventions" in r.text and r.json()["detail"][0]["loc"] == ["body", "interventions"]
        r = client.post("/api/text/generate", json={**body, "interventions": [PERTURB] * 64})
        assert r.status_code == 200 and _sse(r)[-1]["done"] is True
    finally:
        client.__exit__(None, None, None)


def test_generate_stream_ends_with_an_error_event_past_generate_timeout_s(tiny_llama):
    """§2: request_timeout_s applied per step only; a whole stream now stops at generate_timeout_s."""
    # any real step takes longer than 1 ms; a given throughput keeps the estimate under it, so that the stream is
    # accepted however busy the machine (a measured one on a loaded machine was refused with 413 before it started)
    client = lm_client(tiny_llama, generate_timeout_s=0.001, compute_gmacs_per_s=1e6)
    try:
        r = client.post("/api/text/generate", json={"model": "tl", "text": "the cat sat on the mat", "max_new_tokens": 12})
        assert r.status_code == 200
        events = _sse(r)
        assert events[-1].get("setting") == "generate_timeout_s" and "generate_timeout_s=0.001" in events[-1]["error"]
        assert not any(e.get("done") for e in events) and len(events) < 12
    finally:
        client.__exit__(None, None, None)
    client = lm_client(tiny_llama)  # the default budget lets the same stream finish
    try:
        r = client.post("/api/text/generate", json={"model": "tl", "text": "the cat sat on the mat", "max_new_tokens": 12})
        assert _sse(r)[-1]["done"] is True
    finally:
        client.__exit__(None, None, None)


def test_cost_estimate_of_known_shapes():
    """§4: the estimate is arithmetic on the model's shape (app/costs.py)."""
    from app.costs import ModelShape, forward_macs, request_runs, stream_macs

    shape = ModelShape(params=1000, layers=2, heads=3, head_dim=4)
    assert forward_macs(shape, 10, 10) == 1000 * 10 + 2 * (2 * 3 * 10 * 10) * 4
    assert forward_macs(shape, 10, 10, interventions=5) == forward_macs(shape, 10, 10) + 4 * 5 * 2 * 3 * 10 * (10 + 4)
    assert forward_macs(shape, 1, 50) < forward_macs(shape, 50, 50) / 40  # a decoding step is one query
    assert request_runs(16, True) == 17 and request_runs(16, False) == 1 and request_runs(1, True) == 2
    assert stream_macs(shape, 10, 1, 0) == 2 * forward_macs(shape, 10, 10)  # the prompt, on both sides
    # the probe's LM case: 512 tokens, samples 16, on smollm2-135m's shape, at the default 8 GMAC/s, is minutes
    smollm = ModelShape(params=134_515_008, layers=30, heads=9, head_dim=64)
    assert 17 * forward_macs(smollm, 512, 512) / 8e9 > 60


def test_requests_that_would_time_out_are_refused_with_413_before_they_start(tiny_bert, tiny_llama):
    """§4: dinov2 at 448 px with samples 16 and the LM at 512 tokens with samples 16 ran a minute, then 503.
    With a throughput such that one run takes 1/5 of request_timeout_s, 17 runs are refused, 1 is served."""
    from app.costs import forward_macs, model_shape

    probe = TestClient(create_app(make_settings(tiny_bert)))
    with probe:
        probe.app.state.runtime.warm_up()
        adapter = probe.app.state.runtime.adapter("tiny")
        tokens = len(adapter.encode("the cat sat on the mat", None).tokens)
        one_run = forward_macs(model_shape(adapter), tokens, tokens, 1)
    rate_gmacs = one_run / 1e9 / (0.2 * 60)  # one run: 12 s of the 60 s request_timeout_s
    client = TestClient(create_app(make_settings(tiny_bert, compute_gmacs_per_s=rate_gmacs)))
    with client:
        client.app.state.runtime.warm_up()
        body = {"model": "tiny", "text": "the cat sat on the mat", "layers": [0], "heads": [0],
                "interventions": [PERTURB], "compare": True, "samples": 16}
        started = time.monotonic()
        r = client.post("/api/text/attention", json=body)
        assert r.status_code == 413, r.text
        assert "request_timeout_s=60" in r.json()["detail"] and "17 model runs" in r.json()["detail"]
        assert time.monotonic() - started < 5  # refused, not run
        assert client.post("/api/text/attention", json={**body, "compare": False, "samples": 1}).status_code == 200
    # a stream: estimated over generate_timeout_s → 413 naming it
    client = lm_client(tiny_llama, compute_gmacs_per_s=1e-9)
    try:
        r = client.post("/api/text/generate", json={"model": "tl", "text": "the cat sat on the mat", "max_new_tokens": 8})
        assert r.status_code == 413 and "generate_timeout_s" in r.json()["detail"], r.text
    finally:
        client.__exit__(None, None, None)


def test_a_request_served_from_cached_runs_is_never_refused_by_the_cost_estimate(tiny_bert):
    """After a slow first view, a head or mode change over the same cached runs got 413 (the estimate counted runs
    the cache already held). With a throughput at which one run takes far over request_timeout_s: the cached
    request is answered, a new input is refused."""
    client = TestClient(create_app(make_settings(tiny_bert)))
    with client:
        client.app.state.runtime.warm_up()
        body = {"model": "tiny", "text": "the cat sat on the mat", "layers": [0], "heads": [0],
                "interventions": [PERTURB], "compare": True}
        assert client.post("/api/text/attention", json=body).status_code == 200
        # one multiply-add per second, on this app's measures: every uncached run is hours
        client.app.state.runtime.measures.throughput.set_rate("tiny", 1.0)
        r = client.post("/api/text/attention", json={**body, "heads": [1]})
        assert r.status_code == 200, r.text
        r = client.post("/api/text/attention", json={**body, "text": "a dog ran"})
        assert r.status_code == 413 and "2 model runs" in r.json()["detail"], r.text
