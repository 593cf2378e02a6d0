"""Long inputs through the API (docs/api.md "Runs, windows and long inputs"): run_id on every response, the first view
of an input over full_map_tokens (overview, received, no maps), exact windows and rows of kept runs, view-mode β,
and the limits (413 naming max_window_cells, 404 unknown/evicted, 422 out of range). A tiny Llama with GQA, with a
small full_map_tokens so that a sentence is "long"."""
from __future__ import annotations

import numpy as np
import pytest
from fastapi.testclient import TestClient

from app.ids import is_valid_run_id
from app.main import create_app
from app.settings import Settings
from tests.api.helpers import TINY_ATLAS, tiny_lm_client
from tests.api.helpers import TINY_TEXT as TEXT
from tests.float32 import assert_close_f32, attention_terms
from tests.tiny_models import build_text_model



@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return str(build_text_model("llama", tmp_path_factory.mktemp("llama")))


@pytest.fixture(scope="module")
def long_client(llama):
    with tiny_lm_client(llama, **TINY_ATLAS, max_window_cells=300) as c:
        yield c


@pytest.fixture(scope="module")
def short_client(llama):
    with tiny_lm_client(llama) as c:
        yield c


def _terms(llama: str, n: int) -> int:
    """The float32 sums one probability takes (tests/float32.py): the comparisons below allow their rounding."""
    from transformers import AutoConfig

    return attention_terms(AutoConfig.from_pretrained(llama), n)


def _attention(client, **body):
    response = client.post("/api/text/attention", json={"model": "lm", "text": TEXT, **body})
    assert response.status_code == 200, response.text
    return response.json()


def test_long_first_view_has_overview_not_maps(long_client, short_client, llama):
    long = _attention(long_client, thumbnail_size=4)
    short = _attention(short_client)
    n = len(long["tokens"])
    assert n > 8 and long["tokens"] == short["tokens"]
    assert long["attention"] is None and short["attention"] is not None
    assert is_valid_run_id(long["run_id"]) and long["run_id"] != short["run_id"]
    full = np.array(short["attention"])  # (L, H, T, T)
    edges = long["overview"]["edges"]
    assert edges[0] == 0 and edges[-1] == n and len(edges) - 1 <= 6
    overview = np.array(long["overview"]["maps"])  # (L, H, B, B)
    terms = _terms(llama, n)
    for a in range(len(edges) - 1):
        for b in range(len(edges) - 1):
            block = full[:, :, edges[a]:edges[a + 1], edges[b]:edges[b + 1]].mean(axis=(-1, -2))
            assert_close_f32(overview[:, :, a, b], block, terms, scale=1.0)
    received = np.array(long["received"])
    assert_close_f32(received, full.mean(axis=2), terms, scale=1.0)
    assert np.allclose(received.sum(axis=-1), 1.0, atol=1e-5)
    assert np.allclose(long["entropy"], short["entropy"], atol=2e-5)
    assert np.allclose(long["mean_distance"], short["mean_distance"], atol=2e-5)
    assert np.array(short["received"]).shape == received.shape
    assert long["thumbnails"]["shape"][-2:] == [4, 4]
    assert long["output"]["top"][0]["id"] == short["output"]["top"][0]["id"]


def test_windows_and_rows_are_exact(long_client, short_client, llama):
    long = _attention(long_client)
    full = np.array(_attention(short_client)["attention"])
    run = long["run_id"]
    response = long_client.post(f"/api/runs/{run}/window", json={"layer": 1, "head": 3, "rows": [5, 20], "cols": [2, 19]})
    assert response.status_code == 200, response.text
    terms = _terms(llama, full.shape[-1])
    assert_close_f32(response.json()["attention"], full[1, 3, 5:20, 2:19], terms, scale=1.0)
    # one row over every key of every head, and the mass on a span (the retrieval view)
    last = len(long["tokens"]) - 1
    row = long_client.post(f"/api/runs/{run}/row", json={"row": last, "span": [3, 7]}).json()
    rows = np.array(row["attention"])  # (L, H, T)
    assert_close_f32(rows, full[:, :, last, :], terms, scale=1.0)
    assert_close_f32(row["span_mass"], full[:, :, last, 3:7].sum(axis=-1), terms, scale=1.0)
    # a short run's windows are slices of its kept P
    short_run = _attention(short_client)["run_id"]
    window = short_client.post(f"/api/runs/{short_run}/window", json={"layer": 0, "head": 1, "rows": [0, 4], "cols": [0, 9]})
    assert np.array_equal(np.array(window.json()["attention"], dtype=np.float32), full[0, 1, :4, :9].astype(np.float32))


@pytest.mark.parametrize("which", ["long", "short"])
def test_view_beta_equals_the_run_at_that_beta_for_that_head(which, long_client, short_client, llama):
    client = long_client if which == "long" else short_client
    run = _attention(client)["run_id"]
    beta = 0.8
    rerun = _attention(short_client, interventions=[{"op": "temperature", "beta": beta, "layers": [1], "heads": [2]}])
    expected = np.array(rerun["attention"])[1, 2]
    n = expected.shape[0]
    window = client.post(f"/api/runs/{run}/window", json={"layer": 1, "head": 2, "rows": [0, 7], "cols": [0, n], "beta": beta})
    assert window.status_code == 200, window.text
    assert_close_f32(window.json()["attention"], expected[:7], _terms(llama, n), scale=1.0)
    plain = client.post(f"/api/runs/{run}/window", json={"layer": 1, "head": 2, "rows": [0, 7], "cols": [0, n]})
    assert np.abs(np.array(plain.json()["attention"]) - expected[:7]).max() > 1e-3


def test_limits(long_client, llama):
    run = _attention(long_client)["run_id"]
    n = len(_attention(long_client)["tokens"])
    too_big = long_client.post(f"/api/runs/{run}/window", json={"layer": 0, "head": 0, "rows": [0, 20], "cols": [0, 20]})
    assert too_big.status_code == 413 and "max_window_cells" in too_big.json()["detail"]
    for body, field in [({"layer": 9, "head": 0, "rows": [0, 2], "cols": [0, 2]}, "layer"),
                        ({"layer": 0, "head": 4, "rows": [0, 2], "cols": [0, 2]}, "head"),
                        ({"layer": 0, "head": 0, "rows": [0, n + 1], "cols": [0, 2]}, "rows"),
                        ({"layer": 0, "head": 0, "rows": [3, 3], "cols": [0, 2]}, "rows"),
                        ({"layer": 0, "head": 0, "rows": [0, 2], "cols": [0, 2], "kind": "cross"}, "kind")]:
        response = long_client.post(f"/api/runs/{run}/window", json=body)
        assert response.status_code == 422, (body, response.text)
        assert field in str(response.json()["detail"]), response.text
    assert long_client.post(f"/api/runs/{run}/row", json={"row": n}).status_code == 422
    for unknown in ("0" * 32, "not-an-id"):
        response = long_client.post(f"/api/runs/{unknown}/window", json={"layer": 0, "head": 0, "rows": [0, 2], "cols": [0, 2]})
        assert response.status_code == 404 and "is unknown: this server never held it" in response.json()["detail"]
    # expired: without a disk tier a store of one run keeps only the latest once the first one's pin is over
    # (result_pin_s=0; pinned runs: tests/api/test_jobs_api.py; the disk tier: tests/api/test_run_store.py)
    with tiny_lm_client(llama, full_map_tokens=8, result_cache_items=1, result_pin_s=0, run_store_disk_bytes=0) as client:
        first = _attention(client)["run_id"]
        body = {"layer": 0, "head": 0, "rows": [0, 2], "cols": [0, 2]}
        assert client.post(f"/api/runs/{first}/window", json=body).status_code == 200
        _attention(client, text=TEXT + " it was")
        response = client.post(f"/api/runs/{first}/window", json=body)
        assert response.status_code == 404 and f"run {first!r} expired" in response.json()["detail"]


def test_long_scores_come_by_window(long_client):
    response = long_client.post("/api/text/attention", json={"model": "lm", "text": TEXT, "include_scores": True})
    assert response.status_code == 200 and response.json()["scores"] is None
    assert any("include_scores" in w for w in response.json()["warnings"])
    run = _attention(long_client)["run_id"]
    window = long_client.post(f"/api/runs/{run}/window", json={"layer": 0, "head": 0, "rows": [0, 3], "cols": [0, 5],
                                                               "include_scores": True}).json()
    assert np.array(window["scores"]).shape == (3, 5)


def test_long_image_first_view_rollout_rows_and_windows(tmp_path_factory):
    """An image over full_map_tokens: overview and received instead of maps, the rollout and mean distance from the
    atlas equal to the full maps', requested query rows exact, windows of the kept run."""
    from tests.api.test_images_api import build_tiny_vit, uploaded_id

    folder = str(build_tiny_vit(tmp_path_factory.mktemp("vit")))
    results = {}
    for name, full_map in (("long", 8), ("short", 512)):
        settings = Settings(default_models=[], extra_image_models={"tiny-vit": folder}, full_map_tokens_image=full_map,
                            overview_blocks=5, max_response_numbers=200_000)
        with TestClient(create_app(settings)) as client:
            image_id = uploaded_id(client, seed=7)
            response = client.post("/api/image/attention", json={"model": "tiny-vit", "image_id": image_id})
            assert response.status_code == 200, response.text
            rows = client.post("/api/image/attention", json={"model": "tiny-vit", "image_id": image_id,
                                                             "queries": [0, 5], "layers": [1]})
            assert rows.status_code == 200, rows.text
            body = response.json()
            window = client.post(f"/api/runs/{body['run_id']}/window", json={"layer": 1, "head": 1, "rows": [2, 9],
                                                                          "cols": [0, 17]})
            assert window.status_code == 200, window.text
            results[name] = (body, rows.json(), window.json())
    (long, long_rows, long_window), (short, short_rows, short_window) = results["long"], results["short"]
    assert long["attention"] is None and np.array(long["overview"]["maps"]).shape[-1] <= 5
    maps = np.array(short["attention"])  # (L, H, T, T)
    terms = _terms(folder, maps.shape[-1])  # q·k over the head size, softmax over the keys
    # the rollout: L products of T-term sums of probabilities (rows of distributions: at most 1)
    assert_close_f32(long["rollout"], short["rollout"], terms + maps.shape[0] * maps.shape[-1], scale=1.0)
    assert np.allclose(long["mean_distance"], short["mean_distance"], atol=1e-4)
    assert_close_f32(long_rows["attention"], short_rows["attention"], terms, scale=1.0)
    assert_close_f32(long_window["attention"], short_window["attention"], terms, scale=1.0)
    assert_close_f32(long["received"], maps.mean(axis=2), terms + maps.shape[2], scale=1.0)  # then a mean over queries
