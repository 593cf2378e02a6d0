"""Value-weighted attention on encoder–decoders through the API (issue 22 §3, "wherever P is"): POST /api/text/attention
with `weighting: "value_norm"` on a tiny BART/T5 answers every kind value-weighted (encoder and cross keys weighted by
the source tokens' values, the decoder's by the target's), short and long (over full_map_tokens: per kind the
overview and received of the value-weighted maps), and the kept run's windows and rows of every kind take the
weighting and equal the first view's maps."""
from __future__ import annotations

import base64

import numpy as np
import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from app.settings import Settings
from tests.tiny_models import build_text_model

TEXT = "the cat sat on the mat because it was tired , the dog ran"
TARGET = "the dog sat on the rug"
INTERVENTIONS = [{"op": "mask_keys", "tokens": [2, 5], "kind": "cross"},
                 {"op": "temperature", "beta": 0.3, "kind": "encoder", "layers": [1], "heads": [2]}]
KINDS = ("encoder", "decoder", "cross")


def _f32(field: dict) -> np.ndarray:
    return np.frombuffer(base64.b64decode(field["data"]), dtype="<f4").reshape(field["shape"])


@pytest.fixture(scope="module", params=["bart", "t5"])
def clients(request, tmp_path_factory):
    folder = str(build_text_model(request.param, tmp_path_factory.mktemp(request.param)))
    common = dict(default_models=[], extra_models={"s2s": folder}, max_response_numbers=200_000)
    # atlas_block_rows ≥ the tokens: the long run rounds like the short one (tests/api/test_seq2seq_long_api.py)
    with TestClient(create_app(Settings(**common))) as short, \
            TestClient(create_app(Settings(**common, full_map_tokens=8, overview_blocks=5, atlas_block_rows=64))) as long:
        yield short, long


def _view(client, **body) -> dict:
    r = client.post("/api/text/attention", json={"model": "s2s", "text": TEXT, "target": TARGET, "encoding": "f32",
                                                 "interventions": INTERVENTIONS, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_every_kind_is_value_weighted_and_differs_from_p(clients):
    short, _ = clients
    plain, body = _view(short), _view(short, weighting="value_norm", compare=True, include_base=True)
    assert body["weighting"] == "value_norm"
    for kind in KINDS:
        p, vw = _f32(plain["attention"][kind]), _f32(body["attention"][kind])
        assert vw.shape == p.shape and np.allclose(vw.sum(-1), 1, atol=1e-5), kind
        assert not np.allclose(vw, p, atol=1e-3), kind
        base = _f32(body["base_attention"][kind])  # the run without interventions, value-weighted too
        assert np.allclose(base.sum(-1), 1, atol=1e-5) and not np.allclose(base, vw, atol=1e-4)
    assert float(np.abs(_f32(body["attention"]["cross"])[..., [2, 5]]).max()) == 0.0  # masked source keys stay 0


def test_windows_rows_and_long_overview_equal_the_first_view(clients):
    short, long = clients
    body = _view(short, weighting="value_norm")
    long_body = _view(long, weighting="value_norm")
    assert long_body["weighting"] == "value_norm" and long_body["overview"] is not None
    for kind in KINDS:
        full = _f32(body["attention"][kind])  # (L, H, T_q, T_k)
        n_rows, n_cols = full.shape[-2:]
        overview = long_body["overview"][kind]
        maps = _f32(overview["maps"])
        for a, (r0, r1) in enumerate(zip(overview["edges"], overview["edges"][1:])):
            for b, (c0, c1) in enumerate(zip(overview["col_edges"], overview["col_edges"][1:])):
                assert np.abs(maps[:, :, a, b] - full[:, :, r0:r1, c0:c1].mean(axis=(-1, -2))).max() <= 1e-5, kind
        assert np.abs(_f32(long_body["received"][kind]) - full.mean(axis=2)).max() <= 1e-5
        for client, run_id in [(short, body["run_id"]), (long, long_body["run_id"])]:
            for layer, head, rows, cols in [(0, 1, [0, n_rows], [0, n_cols]), (1, 3, [1, n_rows - 1], [1, n_cols])]:
                w = client.post(f"/api/runs/{run_id}/window", json={
                    "layer": layer, "head": head, "rows": rows, "cols": cols, "kind": kind, "weighting": "value_norm",
                    "encoding": "f32"})
                assert w.status_code == 200, w.text
                got = _f32(w.json()["attention"])
                assert np.abs(got - full[layer, head, rows[0]:rows[1], cols[0]:cols[1]]).max() <= 1e-5, (kind, layer)
            row = client.post(f"/api/runs/{run_id}/row", json={"row": 2, "kind": kind, "weighting": "value_norm",
                                                               "encoding": "f32"})
            assert row.status_code == 200, row.text
            assert np.abs(_f32(row.json()["attention"]) - full[:, :, 2]).max() <= 1e-5
