"""The cost estimate counts a long value-weighted first view's overview (app/costs.py value_overview_macs): rebuilt
from q̂/k̂ for every head, about the first run's own time again (0.83× at 2,048 tokens on smollm2-135m). Counted with
the request's runs when they are new, alone when every run is cached (a weighting switch after a long first view),
and not at all once the overview is cached. A tiny Llama with full_map_tokens 8, so that a sentence is long."""
from __future__ import annotations

import contextvars
from types import SimpleNamespace

import pytest
from fastapi import HTTPException
from app.admission import check_request_cost
from app.costs import forward_macs, model_shape, value_overview_macs
from app.pipeline import ExtraWork
from app.settings import Settings
from tests.api.helpers import TINY_ATLAS, tiny_lm_client
from tests.api.helpers import TINY_TEXT as TEXT
from tests.tiny_models import build_text_model
from tests.unit.test_cost_defaults import smollm2_like_adapter



@pytest.fixture(scope="module")
def client(tmp_path_factory):
    llama = str(build_text_model("llama", tmp_path_factory.mktemp("llama-cost")))
    with tiny_lm_client(llama, **TINY_ATLAS) as c:
        yield c


def _post(client, text: str, weighting: str):
    return client.post("/api/text/attention", json={"model": "lm", "text": text, "layers": [0], "heads": [0],
                                                    "weighting": weighting})


def test_the_overview_counts_with_the_runs_and_alone(client, monkeypatch):
    # the arithmetic on an idle machine: the CPU share now (/proc) would scale every estimate on a busy one
    monkeypatch.setattr("app.costs._share", lambda adapter: 1.0)
    adapter = client.app.state.runtime.adapter("lm")
    n = len(adapter.encode(TEXT, None).tokens)
    assert n > 8
    shape, settings = model_shape(adapter), Settings(default_models=[], request_timeout_s=1.0)
    forward, overview = forward_macs(shape, n, n), value_overview_macs(shape, n, n)
    assert overview == 5.0 * shape.layers * shape.heads * n * n * shape.head_dim
    measures = client.app.state.runtime.measures  # this app's (app/process.py): other apps' runs leave it alone
    throughput = measures.throughput

    def estimate(rate_macs: float, extra: bool) -> None:
        throughput.set_rate(adapter.info.id, rate_macs)  # no overhead, no measured slowdown
        check_request_cost(adapter, SimpleNamespace(settings=settings, measures=measures), n, 1, 0, extra=ExtraWork(
            "weighting", "the value-weighted overview (weighting value_norm)", overview, 1) if extra else None)

    # a throughput at which the run alone fits in 1 s and the run with the overview does not
    rate = forward + overview / 2
    try:
        contextvars.copy_context().run(estimate, rate, False)
        with pytest.raises(HTTPException) as refused:
            contextvars.copy_context().run(estimate, rate, True)
        assert refused.value.status_code == 413 and "value-weighted overview" in refused.value.detail
    finally:
        throughput.clear()

    # through the API: a long first view, then value weighting of the cached run at a throughput where the overview
    # alone takes 2 × request_timeout_s: refused naming `weighting` (before its work), the run itself still served
    assert _post(client, TEXT, "attention").status_code == 200
    timeout = client.app.state.runtime.settings.request_timeout_s
    try:
        throughput.set_rate(adapter.info.id, overview / (2 * timeout))  # and no recent runs to correct it by
        refused = _post(client, TEXT, "value_norm")
        assert refused.status_code == 413, refused.text
        assert refused.json()["detail"].startswith("weighting: the value-weighted overview")
        assert _post(client, TEXT, "attention").status_code == 200  # cached: nothing to estimate
        new = _post(client, TEXT + " again", "value_norm")  # a new run with its overview
        assert new.status_code == 413 and "and the value-weighted overview" in new.json()["detail"], new.text
    finally:
        throughput.clear()
    # at the default throughput the overview is made and cached; then the same slow estimate refuses nothing
    assert _post(client, TEXT, "value_norm").status_code == 200
    try:
        throughput.set_rate(adapter.info.id, overview / (2 * timeout))  # and no recent runs to correct it by
        assert _post(client, TEXT, "value_norm").status_code == 200
    finally:
        throughput.clear()


def test_a_value_weighted_first_view_at_max_tokens_is_admitted_by_the_default_estimate():
    """smollm2-135m at settings.max_tokens: the run and its value-weighted overview fit the default estimate (the
    ~3,000-token sample on the text page with plenty to spare); with compare (a second run) they do not."""
    settings, shape = Settings(), model_shape(smollm2_like_adapter("smollm2-shape-value-overview"))
    n = settings.max_tokens
    rate = settings.compute_gmacs_per_s * 1e9
    alone = (forward_macs(shape, n, n) + value_overview_macs(shape, n, n)) / rate
    assert alone < settings.request_timeout_s, alone
    assert (2 * forward_macs(shape, n, n) + value_overview_macs(shape, n, n)) / rate > settings.request_timeout_s
