"""POST /api/text/patching, /lens, /faithfulness and the value-weighted maps and patch_heads op of
/api/text/attention, on tiny random models added the way an operator adds them; 4xx naming the field."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from app.main import create_app
from app.settings import Settings
from tests.api.helpers import sse_events, tiny_models_client
from tests.float32 import assert_close_f32, attention_terms
from tests.tiny_models import build_text_model

CLEAN, CORRUPT = "the cat sat on the mat", "the dog ran on the rug"
PATCH = {"model": "tiny-llama", "clean": CLEAN, "corrupt": CORRUPT, "answer": "tired", "wrong": "house"}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    # patching_batch_tokens: 3 copies of the 8-token prompts per batch, so a scan has several batches
    with tiny_models_client(tmp_path_factory, {"tiny-llama": "llama", "tiny-bert": "bert", "tiny-bart": "bart"},
                            default_models=["tiny-llama"], max_response_numbers=200_000, patching_batch_tokens=24) as c:
        yield c


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
    events = sse_events(r)
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
    unknown = {"op": "patch_heads", "source": run_id.split(".")[0] + "." + "0" * 32}  # shaped as a run id, never made
    r = client.post("/api/text/attention", json={"model": "tiny-llama", "text": CORRUPT, "interventions": [unknown]})
    assert r.status_code == 404 and "interventions[0].source" in r.json()["detail"]
    shorter = {"op": "patch_heads", "source": run_id}
    r = client.post("/api/text/attention", json={"model": "tiny-llama", "text": "the dog", "interventions": [shorter]})
    assert r.status_code == 422 and "same token count" in r.json()["detail"][0]["msg"]
    r = client.post("/api/text/generate", json={"model": "tiny-llama", "text": CORRUPT, "interventions": [shorter]})
    assert r.status_code == 422 and _loc(r) == ["body", "interventions", 0, "source"]
    residual = {"op": "patch_residual", "source": run_id}
    r = client.post("/api/text/generate", json={"model": "tiny-llama", "text": CORRUPT, "interventions": [residual]})
    assert r.status_code == 422 and _loc(r) == ["body", "interventions", 0, "source"]  # continuations: not offered
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
    # encoder–decoders too (every kind; tests/api/test_value_weighting_seq2seq.py checks the maps)
    r = client.post("/api/text/attention", json={"model": "tiny-bart", "text": "the cat", "weighting": "value_norm"})
    assert r.status_code == 200 and r.json()["weighting"] == "value_norm"


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


# ---- value-weighted windows, rows and overviews; residual patches; the patch sources' store ------------------------
@pytest.fixture(scope="module")
def short_and_long(tmp_path_factory):
    """Two apps on the same tiny models: one keeps full maps, the other runs every input over 4 tokens blockwise
    (an atlas: windows rebuilt from q̂/k̂); the second keeps one patch source at a time."""
    models = {"tiny-llama": str(build_text_model("llama", tmp_path_factory.mktemp("llama-w"))),
              "tiny-bert": str(build_text_model("bert", tmp_path_factory.mktemp("bert-w")))}
    common = dict(default_models=[], max_response_numbers=200_000, extra_models=models)
    with TestClient(create_app(Settings(**common))) as short, \
            TestClient(create_app(Settings(**common, full_map_tokens=4, overview_blocks=3, patch_sources_runs=1,
                                             result_cache_items=2))) as long:
        yield short, long


def _f32(field: dict) -> np.ndarray:
    import base64
    return np.frombuffer(base64.b64decode(field["data"]), dtype="<f4").reshape(field["shape"])


def _weighted_terms(client, model: str, n_tokens: int) -> int:
    """The float32 sums of one value-weighted probability (tests/float32.py): q·k over the head size and the softmax
    over the keys, the value norms over the hidden size (independent roundings add in quadrature: their terms add)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(client.app.state.runtime.settings.extra_models[model])
    return attention_terms(config, n_tokens) + config.hidden_size


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-bert"])
def test_value_weighted_windows_rows_and_overview_equal_the_full_map(short_and_long, model):
    short, long = short_and_long
    text = "the cat sat on the mat because it was tired"
    req = {"model": model, "text": text, "weighting": "value_norm", "encoding": "f32", "thumbnail_size": 4}
    full_body = short.post("/api/text/attention", json=req).json()
    full = _f32(full_body["attention"])  # (L, H, T, T) value-weighted
    p = _f32(short.post("/api/text/attention", json={**req, "weighting": "attention"}).json()["attention"])
    assert not np.allclose(full, p, atol=1e-3)
    n_tokens = full.shape[-1]
    terms = _weighted_terms(short, model, n_tokens)
    for client, body in [(short, full_body), (long, long.post("/api/text/attention", json=req).json())]:
        run_id = body["run_id"]
        for layer, head, rows, cols in [(0, 1, [0, n_tokens], [0, n_tokens]), (1, 3, [2, 7], [1, 5])]:
            w = client.post(f"/api/runs/{run_id}/window", json={"layer": layer, "head": head, "rows": rows, "cols": cols,
                                                               "weighting": "value_norm", "encoding": "f32"})
            assert w.status_code == 200 and w.json()["weighting"] == "value_norm"
            window = _f32(w.json()["attention"])
            assert_close_f32(window, full[layer, head, rows[0]:rows[1], cols[0]:cols[1]], terms, scale=1.0)
            plain = _f32(client.post(f"/api/runs/{run_id}/window", json={"layer": layer, "head": head, "rows": rows,
                                                                         "cols": cols, "encoding": "f32"}).json()["attention"])
            assert_close_f32(plain, p[layer, head, rows[0]:rows[1], cols[0]:cols[1]], terms, scale=1.0)
        row = client.post(f"/api/runs/{run_id}/row", json={"row": 5, "weighting": "value_norm", "encoding": "f32",
                                                           "span": [0, 2]}).json()
        assert_close_f32(_f32(row["attention"]), full[:, :, 5], terms, scale=1.0)
        assert_close_f32(row["span_mass"], full[:, :, 5, 0:2].sum(-1), terms, scale=1.0)
    # the long run's first view: the overview and received of the value-weighted maps, their thumbnails
    long_body = long.post("/api/text/attention", json=req).json()
    assert long_body["weighting"] == "value_norm" and long_body["attention"] is None
    edges, col_edges = long_body["overview"]["edges"], long_body["overview"]["col_edges"]
    overview = _f32(long_body["overview"]["maps"])
    for a, (r0, r1) in enumerate(zip(edges, edges[1:])):
        for b, (c0, c1) in enumerate(zip(col_edges, col_edges[1:])):
            block = full[:, :, r0:r1, c0:c1].mean(axis=(-1, -2))
            assert_close_f32(overview[:, :, a, b], block, terms + (r1 - r0) * (c1 - c0), scale=1.0)  # then a block mean
    assert_close_f32(_f32(long_body["received"]), full.mean(axis=2), terms + n_tokens, scale=1.0)  # a mean over queries
    plain_long = long.post("/api/text/attention", json={**req, "weighting": "attention"}).json()
    assert long_body["thumbnails"]["data"] != plain_long["thumbnails"]["data"]
    assert_close_f32(_f32(full_body["received"]), full.mean(axis=2), n_tokens, scale=1.0)  # a mean over the queries
    assert full_body["thumbnails"]["data"] != short.post("/api/text/attention", json={**req, "weighting": "attention"}).json()["thumbnails"]["data"]
    from app.attention import thumbnails  # the same encoding, from the returned full value-weighted maps
    expected = thumbnails(torch.from_numpy(full.copy()), 4)
    assert np.array_equal(full_body["thumbnails"]["max"], expected["max"])  # the same pooling of the same float32 maps
    assert full_body["thumbnails"]["shape"] == expected["shape"]


def test_a_residual_patch_as_an_intervention(short_and_long):
    short, _ = short_and_long
    scan = short.post("/api/text/patching", json={**PATCH, "scan": "residual"}).json()
    n_layers, n_tokens = np.array(scan["effect"]).shape
    patch = {"op": "patch_residual", "source": scan["clean_run_id"], "layers": [n_layers - 1]}  # every position
    r = short.post("/api/text/attention", json={"model": "tiny-llama", "text": CORRUPT, "interventions": [patch],
                                                "compare": True, "layers": [0], "heads": [0]})
    assert r.status_code == 200, r.text
    clean = short.post("/api/text/attention", json={"model": "tiny-llama", "text": CLEAN, "layers": [0], "heads": [0]}).json()
    after = r.json()["effect"]["output"]["top_after"]
    assert [t["id"] for t in after[:3]] == [t["id"] for t in clean["output"]["top"][:3]]
    assert after[0]["prob"] == pytest.approx(clean["output"]["top"][0]["prob"], abs=1e-5)
    assert r.json()["effect"]["output"]["kl"] > 0
    # one cell, and the lens sees it from that layer on
    cell = {**patch, "layers": [0], "tokens": [n_tokens - 1]}
    lens = short.post("/api/text/lens", json={"model": "tiny-llama", "text": CORRUPT, "interventions": [cell], "compare": True})
    assert lens.status_code == 200, lens.text
    assert lens.json()["top"][0][-1] != lens.json()["top_before"][0][-1]
    # heads are not a residual patch's scope; other token counts and encoder–decoders are refused
    r = short.post("/api/text/attention", json={"model": "tiny-llama", "text": CORRUPT, "interventions": [{**patch, "heads": [0]}]})
    assert r.status_code == 422 and _loc(r) == ["body", "interventions", 0, "heads"]
    r = short.post("/api/text/attention", json={"model": "tiny-llama", "text": "the dog", "interventions": [patch]})
    assert r.status_code == 422 and "same token count" in r.json()["detail"][0]["msg"]


def test_patch_sources_have_their_own_bounded_store_404_and_410(short_and_long):
    _, long = short_and_long  # patch_sources_runs=1
    first = long.post("/api/text/patching", json={**PATCH, "method": "attribution"}).json()["clean_run_id"]
    patch = {"op": "patch_heads", "source": first, "layers": [0], "heads": [1]}
    body = {"model": "tiny-llama", "text": CORRUPT, "interventions": [patch], "layers": [0], "heads": [0]}
    assert long.post("/api/text/attention", json=body).status_code == 200
    # many other runs fill the result cache: the source is not in it and stays
    for i in range(6):
        long.post("/api/text/attention", json={"model": "tiny-llama", "text": f"the cat sat {i}", "layers": [0], "heads": [0]})
    assert long.post("/api/text/attention", json=body).status_code == 200
    second = long.post("/api/text/patching", json={**PATCH, "method": "attribution"}).json()["clean_run_id"]
    r = long.post("/api/text/attention", json=body)
    assert r.status_code == 410 and "patch_sources_runs" in r.json()["detail"] and "interventions[0].source" in r.json()["detail"]
    residual = {"op": "patch_residual", "source": first}
    r = long.post("/api/text/lens", json={"model": "tiny-llama", "text": CORRUPT, "interventions": [residual]})
    assert r.status_code == 410
    r = long.post("/api/text/attention", json={**body, "interventions": [{**patch, "source": second}]})
    assert r.status_code == 200
    never_made = second.split(".")[0] + "." + "f" * 32  # a run id of this replica, never made
    r = long.post("/api/text/attention", json={**body, "interventions": [{**patch, "source": never_made}]})
    assert r.status_code == 404


def test_value_norm_windows_of_runs_without_norms_and_a_streamed_first_view(client):
    # an encoder–decoder run keeps its value norms too: its cross windows take the weighting
    run_id = client.post("/api/text/attention", json={"model": "tiny-bart", "text": "the cat", "target": "the dog"}).json()["run_id"]
    r = client.post(f"/api/runs/{run_id}/window", json={"layer": 0, "head": 0, "rows": [0, 2], "cols": [0, 2],
                                                         "kind": "cross", "weighting": "value_norm"})
    assert r.status_code == 200 and r.json()["weighting"] == "value_norm"
    # the progress stream of /api/text/attention answers the same value-weighted maps
    req = {"model": "tiny-llama", "text": CLEAN, "layers": [1], "heads": [2], "weighting": "value_norm"}
    plain = client.post("/api/text/attention", json=req).json()
    events = sse_events(client.post("/api/text/attention", json=req, headers={"Accept": "text/event-stream"}))
    assert events[-1]["done"] is True and events[-1]["weighting"] == "value_norm"
    assert np.array_equal(events[-1]["attention"], plain["attention"])  # the same run, through the stream
