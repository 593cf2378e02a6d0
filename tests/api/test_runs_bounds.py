"""/api/runs/{id}/window and /row are bounded by what they COMPUTE (issue 27): softmax over a row needs every key, so
a row of a span's mass alone costs T_k numbers per layer × head, and a window r × T_k per pass over its rows. Over
max_computed_numbers: 413 naming the field that drives it; a repeated layer or head: 422 naming it; the work runs
under the runtime's model lock; and a normal request answers the same numbers as before. A tiny Llama (GQA, 2 layers
× 4 heads) on a 38-token sentence, long from 9 tokens on (TINY_ATLAS: row blocks of 4)."""
from __future__ import annotations

import numpy as np
import pytest

from models.atlas import full_row_entropy, full_rows, window
from models.attribution import value_weighted_rows
from tests.api.helpers import TINY_ATLAS, tiny_lm_client
from tests.api.helpers import TINY_TEXT as TEXT
from tests.float32 import assert_close_f32, attention_terms
from tests.tiny_models import build_text_model

CAP = 100  # max_computed_numbers of the capped client: 2 × 38 fits (one head's row, or a one-row window), 4 × 38 not


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return str(build_text_model("llama", tmp_path_factory.mktemp("llama")))


@pytest.fixture(scope="module")
def capped(llama):
    with tiny_lm_client(llama, **TINY_ATLAS, max_computed_numbers=CAP) as c:
        yield c


@pytest.fixture(scope="module")
def long_client(llama):
    with tiny_lm_client(llama, **TINY_ATLAS) as c:
        yield c


@pytest.fixture(scope="module")
def short_client(llama):
    with tiny_lm_client(llama) as c:
        yield c


def _run(client, **body) -> dict:
    response = client.post("/api/text/attention", json={"model": "lm", "text": TEXT, **body})
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.parametrize("field", ["layers", "heads"])
def test_a_repeated_layer_or_head_is_422_naming_it(long_client, field):
    run = _run(long_client)["run_id"]
    body = {"row": 5, "include_row": False, "span": [0, 3], field: [1, 0, 1]}
    response = long_client.post(f"/api/runs/{run}/row", json=body)
    assert response.status_code == 422, response.text
    error = response.json()["detail"][0]
    assert error["loc"][-1] == field and "more than once" in error["msg"], error
    # each once: answered
    body[field] = [1, 0]
    assert long_client.post(f"/api/runs/{run}/row", json=body).status_code == 200


def test_the_schema_says_each_at_most_once(long_client):
    schema = long_client.get("/openapi.json").json()["components"]["schemas"]["RowRequest"]["properties"]
    for field in ("layers", "heads"):
        assert schema[field]["anyOf"][0]["uniqueItems"] is True


@pytest.mark.parametrize("layers, heads, field", [([0, 1], [0, 1], "layers"), ([0], [0, 1, 2], "heads")])
def test_a_row_computed_over_the_cap_is_413_naming_the_field(capped, layers, heads, field):
    """A span's mass alone returns one number per head, yet every head's row is computed over all 38 keys."""
    body = _run(capped)
    run, n = body["run_id"], len(body["tokens"])
    assert len(layers) * len(heads) * n > CAP and len(layers) * len(heads) <= 6  # small answer, large work
    response = capped.post(f"/api/runs/{run}/row", json={"row": n - 1, "layers": layers, "heads": heads,
                                                         "include_row": False, "span": [0, 4]})
    assert response.status_code == 413, response.text
    detail = response.json()["detail"]
    assert detail.startswith(f"{field}:") and "max_computed_numbers=100" in detail, detail
    # under the cap: answered
    ok = capped.post(f"/api/runs/{run}/row", json={"row": n - 1, "layers": [0, 1], "heads": [2],
                                                   "include_row": False, "span": [0, 4]})
    assert ok.status_code == 200, ok.text
    assert np.array(ok.json()["span_mass"]).shape == (2, 1)


def test_a_window_computed_over_the_cap_is_413_naming_rows(capped):
    """Two rows × one key returns 2 numbers; it computes 2 rows × 38 keys, and their entropy over 38 keys again."""
    body = _run(capped)
    run = body["run_id"]
    one = {"layer": 1, "head": 2, "rows": [5, 6], "cols": [3, 4]}
    assert capped.post(f"/api/runs/{run}/window", json=one).status_code == 200  # 2 passes × 38 = 76
    for request in ({**one, "rows": [5, 7]}, {**one, "minus": run},
                    {**one, "weighting": "value_norm"}):
        response = capped.post(f"/api/runs/{run}/window", json=request)
        assert response.status_code == 413, (request, response.text)
        detail = response.json()["detail"]
        assert detail.startswith("rows:") and "max_computed_numbers=100" in detail, detail


def test_normal_requests_answer_the_same_numbers(long_client, short_client, llama):
    """Windows over several row blocks, view β, value-weighted rows and rows of every head: the engine's own
    functions on the kept run (what the endpoints answered before), and the short run's exact P."""
    long, short = _run(long_client), _run(short_client)
    n = len(long["tokens"])
    kept = long_client.app.state.runtime.get_run(long["run_id"]).atlas
    full = np.array(short["attention"])  # (L, H, T, T)
    from transformers import AutoConfig

    terms = attention_terms(AutoConfig.from_pretrained(llama), n)  # q·k over the head size, softmax over the keys
    for request in ({"layer": 1, "head": 3, "rows": [2, 15], "cols": [0, n]},  # 4 row blocks
                    {"layer": 0, "head": 1, "rows": [30, 38], "cols": [5, 30], "beta": 0.2},
                    {"layer": 1, "head": 0, "rows": [1, 14], "cols": [0, 20], "weighting": "value_norm"}):
        response = long_client.post(f"/api/runs/{long['run_id']}/window", json=request)
        assert response.status_code == 200, response.text
        got = np.array(response.json()["attention"])
        entropy = np.array(response.json()["row_entropy"])
        (r0, r1), (c0, c1) = request["rows"], request["cols"]
        record = kept.record(request["layer"])
        beta = request.get("beta")
        if request.get("weighting") == "value_norm":
            rows = value_weighted_rows(record, [request["head"]], r0, r1)[0].numpy()
            before = rows[:, c0:c1]
            before_entropy = -(rows * np.log(np.clip(rows, 1e-30, None))).sum(-1)
        else:
            before = window(record, request["head"], (r0, r1), (c0, c1), beta).numpy()
            before_entropy = full_row_entropy(record, [request["head"]], r0, r1, beta, 4)[0].numpy()
            if beta is None:
                assert_close_f32(got, full[request["layer"], request["head"], r0:r1, c0:c1], terms, scale=1.0)
        assert got.shape == (r1 - r0, c1 - c0)
        # not bit-equal (1 ulp apart: the endpoint batches its row blocks otherwise; JSON keeps float32 exactly)
        assert_close_f32(got, before, terms, scale=1.0)
        # −Σ p log p over the keys of probabilities with the error above, at the entropies' scale (at least 1)
        assert_close_f32(entropy, before_entropy, terms + n, scale=max(1.0, float(np.abs(before_entropy).max())))
    row = long_client.post(f"/api/runs/{long['run_id']}/row", json={"row": 20, "span": [3, 9]}).json()
    before = np.stack([full_rows(kept.record(l), [0, 1, 2, 3], 20, 21)[:, 0].numpy() for l in (0, 1)])
    assert np.array_equal(np.array(row["attention"], dtype=np.float32), before)  # JSON keeps float32 exactly
    assert_close_f32(row["attention"], full[:, :, 20], terms, scale=1.0)
    assert_close_f32(row["span_mass"], full[:, :, 20, 3:9].sum(-1), terms, scale=1.0)


def test_the_work_waits_for_the_model_lock(llama):
    """While other model work holds the runtime's lock, a window or a row waits in its queue (here past its 1 s
    limit: 503), as any model run does, instead of computing beside it."""
    # compute_gmacs_per_s far above the tiny model's need: the 1 s limit is for the lock wait, and the estimate a
    # busy machine measures at start-up must not refuse these small requests with a 413 first
    with tiny_lm_client(llama, **TINY_ATLAS, request_timeout_s=1.0, compute_gmacs_per_s=1e6) as client:
        run = _run(client)["run_id"]
        runtime = client.app.state.runtime
        requests = [("window", {"layer": 0, "head": 0, "rows": [0, 4], "cols": [0, 4]}), ("row", {"row": 3})]
        with runtime.admitted():
            for path, body in requests:
                response = client.post(f"/api/runs/{run}/{path}", json=body)
                assert response.status_code == 503, (path, response.text)
        for path, body in requests:  # the lock free again: answered
            assert client.post(f"/api/runs/{run}/{path}", json=body).status_code == 200
