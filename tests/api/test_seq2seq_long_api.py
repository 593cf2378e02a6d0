"""Encoder–decoders on the long path through the API (issue 20): an input over full_map_tokens answers per kind
(encoder, decoder, cross) an overview and received instead of maps, with a run_id whose windows of every kind are
exact for that run (block means = its overview, rows = its /row, ≤ 1e-6) and equal the short run's maps with masks,
β and perturbations active; the limits name their fields. A tiny random BART, full_map_tokens lowered so that a
sentence is "long".

Long against short: one block of query rows (atlas_block_rows ≥ the tokens) makes the long run round exactly like the
short one, so the two agree to ≤ 1e-6 at every layer. With several blocks the head outputs round differently in
float32 and this random model's sharp heads (initializer_range 0.3) grow that through the layers (the decoder's maps
then differ by up to ~1e-5 here): several blocks, and exactness against the model's own eager attention at every
layer, are tests/unit/test_seq2seq_atlas.py.
"""
from __future__ import annotations

import numpy as np
import pytest
from fastapi.testclient import TestClient

from app.ids import is_valid_run_id
from app.main import create_app
from app.settings import Settings
from tests.float32 import assert_close_f32
from tests.tiny_models import build_text_model

TEXT = ("the cat sat on the mat because it was tired , the dog ran on the street . a big red car did not cross "
        "the small blue house")
TARGET = "the dog sat on the rug because it was tired"
INTERVENTIONS = [
    {"op": "temperature", "beta": 0.3, "kind": "encoder", "layers": [1], "heads": [2]},
    {"op": "temperature", "beta": 2.0, "kind": "cross", "heads": [1]},
    {"op": "mask_keys", "tokens": [2, 5], "kind": "cross"},
    {"op": "mask_keys", "tokens": [3], "kind": "decoder"},
    {"op": "perturb_keys", "noise_std": 0.7, "seed": 2, "kind": "encoder", "layers": [0], "heads": [3], "tokens": [1, 4]},
]


@pytest.fixture(scope="module")
def bart(tmp_path_factory):
    return str(build_text_model("bart", tmp_path_factory.mktemp("bart")))


def _client(bart, **overrides):
    return TestClient(create_app(Settings(default_models=["s2s"], extra_models={"s2s": bart},
                                          max_response_numbers=200_000, **overrides)))


@pytest.fixture(scope="module")
def clients(bart):
    with _client(bart, full_map_tokens=8, overview_blocks=5, atlas_block_rows=64) as long, _client(bart) as short:
        yield long, short


def _terms(client, n_keys: int) -> int:
    """The float32 sums of one probability (tests/float32.py): q·k over the head size, the softmax over the keys."""
    return client.app.state.runtime.adapter("s2s").info.head_dim + n_keys


def _attention(client, **body):
    response = client.post("/api/text/attention", json={"model": "s2s", "text": TEXT, "target": TARGET,
                                                        "interventions": INTERVENTIONS, **body})
    assert response.status_code == 200, response.text
    return response.json()


def test_long_seq2seq_first_view_per_kind(clients):
    long_client, short_client = clients
    long, short = _attention(long_client, compare=True), _attention(short_client)
    m, n = len(long["tokens"]), len(long["target_tokens"])
    assert m > 8 and long["tokens"] == short["tokens"] and long["target_tokens"] == short["target_tokens"]
    assert long["attention"] is None and long["full_map_tokens"] == 8 and is_valid_run_id(long["run_id"])
    assert short["run_id"] and short["run_id"] != long["run_id"]
    for kind, (q, k) in {"encoder": (m, m), "decoder": (n, n), "cross": (n, m)}.items():
        full = np.array(short["attention"][kind])  # (L, H, T_q, T_k)
        view = long["overview"][kind]
        rows, cols = view["edges"], view["col_edges"]
        assert rows[-1] == q and cols[-1] == k and len(rows) - 1 <= 5 and len(cols) - 1 <= 5
        maps = np.array(view["maps"])
        terms = _terms(long_client, k) + q * k  # then a mean over at most q·k cells
        for a in range(len(rows) - 1):
            for b in range(len(cols) - 1):
                block = full[:, :, rows[a]:rows[a + 1], cols[b]:cols[b + 1]].mean(axis=(-1, -2))
                assert_close_f32(maps[:, :, a, b], block, terms, scale=1.0)  # probabilities: at most 1
        received = np.array(long["received"][kind])
        assert_close_f32(received, full.mean(axis=2), terms, scale=1.0)
        assert np.allclose(received.sum(axis=-1), 1.0, atol=1e-5)
        assert np.allclose(long["entropy"][kind], short["entropy"][kind], atol=2e-5)
    # compare: the output change and hidden cosine are there; the TV per head is not (no maps kept), and it says so
    assert long["effect"]["attention_tv"] is None and long["effect"]["output"]["kind"] == "seq2seq"
    assert any("attention_tv" in w for w in long["warnings"])
    assert np.allclose(long["output"]["probs"], short["output"]["probs"], atol=1e-5)


@pytest.mark.parametrize("kind", ["encoder", "decoder", "cross"])
def test_long_seq2seq_windows_and_rows_by_kind(clients, kind):
    long_client, short_client = clients
    long = _attention(long_client)
    run, view = long["run_id"], long["overview"][kind]
    full = np.array(_attention(short_client)["attention"][kind])  # (L, H, T_q, T_k)
    q, k = full.shape[-2:]
    windows = np.zeros_like(full)
    for layer in range(full.shape[0]):
        for head in range(full.shape[1]):
            window = long_client.post(f"/api/runs/{run}/window", json={"layer": layer, "head": head, "kind": kind,
                                                                      "rows": [0, q], "cols": [0, k]})
            assert window.status_code == 200, window.text
            windows[layer, head] = np.array(window.json()["attention"])
    terms = _terms(long_client, k)
    assert_close_f32(windows, full, terms, scale=1.0)  # rebuilt from q̂, k̂ against the short run's maps
    assert np.allclose(windows.sum(axis=-1), 1.0, atol=1e-5)
    masked = [2, 5] if kind == "cross" else [3] if kind == "decoder" else []
    assert not masked or float(np.abs(windows[..., masked]).max()) == 0.0  # the run's key masks are in its windows
    rows, cols = view["edges"], view["col_edges"]
    for a in range(len(rows) - 1):  # the same run: its windows' block means are its overview
        for b in range(len(cols) - 1):
            block = windows[:, :, rows[a]:rows[a + 1], cols[b]:cols[b + 1]].mean(axis=(-1, -2))
            # the forward's block means against means of the rebuilt windows: over at most q·k cells
            assert_close_f32(np.array(view["maps"])[:, :, a, b], block, terms + q * k, scale=1.0)
    row = long_client.post(f"/api/runs/{run}/row", json={"row": q - 1, "kind": kind, "span": [0, 3]}).json()
    # a row alone against the full window's row: ulps apart (another batching of the softmax), so not exact
    assert_close_f32(row["attention"], windows[:, :, q - 1, :], terms, scale=1.0)
    assert_close_f32(row["span_mass"], windows[:, :, q - 1, 0:3].sum(axis=-1), terms, scale=1.0)


def test_long_seq2seq_limits_name_their_fields(clients):
    long_client, _ = clients
    run = _attention(long_client)["run_id"]
    for body, field in [({"layer": 0, "head": 0, "rows": [0, 2], "cols": [0, 2]}, "kind"),
                        ({"layer": 2, "head": 0, "rows": [0, 2], "cols": [0, 2], "kind": "cross"}, "layer"),
                        ({"layer": 0, "head": 0, "rows": [0, 40], "cols": [0, 2], "kind": "decoder"}, "rows")]:
        response = long_client.post(f"/api/runs/{run}/window", json=body)
        assert response.status_code == 422, (body, response.text)
        assert field in str(response.json()["detail"]), response.text
