"""The binary form (issue 55 §2, docs/api.md "The binary form"): a request sent with `Accept: application/octet-stream`
is answered by a JSON header and the f16/f32 fields' raw little-endian bytes. Every number decodes to exactly the JSON
form's (decoded here by hand from the documented layout, and by attnlab.results.read_binary); errors stay JSON; a JSON
field stays JSON; attnlab.Lab asks for it when every head's map is asked, against a real server."""
from __future__ import annotations

import base64
import json
import struct

import httpx
import numpy as np
import pytest

from attnlab.results import read_binary
from tests.api.helpers import tiny_models_client
from tests.faults.conftest import Server
from tests.tiny_models import build_text_model

TEXT = "the cat sat on the mat because it was tired"
BINARY = {"Accept": "application/octet-stream"}
F32_FIELDS = ("attention", "scores", "received")


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with tiny_models_client(tmp_path_factory, {"tiny-llama": "llama"}, default_models=["tiny-llama"],
                            max_response_numbers=200_000) as client:
        yield client


def _by_hand(body: bytes) -> tuple[dict, bytes]:
    """The documented layout, read without the client's code: (header, data)."""
    (n,) = struct.unpack("<I", body[:4])
    assert (4 + n) % 8 == 0  # the data starts 8-byte aligned
    return json.loads(body[4:4 + n]), body[4 + n:]


def _part(field: dict, data: bytes) -> np.ndarray:
    dtype = {"float32": "<f4", "float16": "<f2"}[field["dtype"]]
    assert field["offset"] % 8 == 0
    return np.frombuffer(data[field["offset"]:field["offset"] + field["nbytes"]], dtype=dtype).reshape(field["shape"])


def _base64(field: dict) -> np.ndarray:
    dtype = {"float32": "<f4", "float16": "<f2"}[field["dtype"]]
    return np.frombuffer(base64.b64decode(field["data"]), dtype=dtype).reshape(field["shape"])


@pytest.mark.parametrize("encoding", ["f32", "f16"])
def test_the_binary_form_is_the_json_forms_numbers_exactly(client, encoding):
    request = {"model": "tiny-llama", "text": TEXT, "include_scores": True, "encoding": encoding,
               "thumbnail_size": 4, "interventions": [{"op": "temperature", "beta": 0.5, "layers": [1]}]}
    as_json = client.post("/api/text/attention", json=request)
    as_binary = client.post("/api/text/attention", json=request, headers=BINARY)
    assert as_json.status_code == as_binary.status_code == 200, as_binary.text[:300]
    assert as_binary.headers["content-type"] == "application/octet-stream"
    expected = as_json.json()
    header, data = _by_hand(as_binary.content)
    client_side = read_binary(bytearray(as_binary.content))
    for name in F32_FIELDS:
        exact = _base64(expected[name])
        assert exact.size > 0
        assert np.array_equal(_part(header[name], data), exact), name
        wanted = exact.astype(np.float32)
        assert client_side[name].dtype == np.float32 and np.array_equal(client_side[name], wanted), name
    # every other field is the same JSON
    others = set(expected) - set(F32_FIELDS) - {"elapsed_s"}
    assert {k: header[k] for k in others} == {k: expected[k] for k in others}
    if encoding == "f32":  # the client's arrays view its buffer: writable, no copy made
        assert client_side["attention"].flags.writeable and not client_side["attention"].flags.owndata


def test_errors_and_json_fields_stay_json(client):
    bad = client.post("/api/text/attention", json={"model": "tiny-llama", "text": TEXT, "layers": [99]},
                      headers=BINARY)
    assert bad.status_code == 422 and bad.headers["content-type"] == "application/json" and "layers" in bad.text
    plain = client.post("/api/text/attention", json={"model": "tiny-llama", "text": TEXT, "layers": [0], "heads": [1]},
                        headers=BINARY)
    header, data = _by_hand(plain.content)
    assert isinstance(header["attention"], list) and data == b""  # encoding "json": numbers in the header
    reference = client.post("/api/text/attention", json={"model": "tiny-llama", "text": TEXT, "layers": [0],
                                                         "heads": [1]}).json()
    assert header["attention"] == reference["attention"]


@pytest.mark.parametrize("encoding", ["f32", "f16"])
def test_windows_and_rows_in_the_binary_form_are_the_json_forms_numbers(client, encoding):
    run = client.post("/api/text/attention", json={"model": "tiny-llama", "text": TEXT, "layers": [0], "heads": [0]})
    run_id = run.json()["run_id"]
    asks = [(f"/api/runs/{run_id}/window", {"layer": 1, "head": 2, "rows": [1, 6], "cols": [0, 5],
                                            "include_scores": True, "encoding": encoding}, ("attention", "scores")),
            (f"/api/runs/{run_id}/window", {"layer": 0, "head": 1, "rows": [0, 4], "cols": [0, 4], "beta": 2.0,
                                            "encoding": encoding}, ("attention",)),
            (f"/api/runs/{run_id}/row", {"row": 5, "span": [0, 2], "encoding": encoding}, ("attention",))]
    for path, request, fields in asks:
        as_json = client.post(path, json=request)
        as_binary = client.post(path, json=request, headers=BINARY)
        assert as_json.status_code == as_binary.status_code == 200, as_binary.text[:300]
        assert as_binary.headers["content-type"] == "application/octet-stream"
        expected = as_json.json()
        header, data = _by_hand(as_binary.content)
        client_side = read_binary(bytearray(as_binary.content))
        for name in fields:
            exact = _base64(expected[name])
            assert exact.size > 0 and np.array_equal(_part(header[name], data), exact), (path, name)
            assert np.array_equal(client_side[name], exact.astype(np.float32)), (path, name)
        others = set(expected) - set(fields)
        assert {k: header[k] for k in others} == {k: expected[k] for k in others}
    missing = client.post("/api/runs/r-nothing-here/window", headers=BINARY,
                          json={"layer": 0, "head": 0, "rows": [0, 1], "cols": [0, 1]})
    assert missing.status_code == 404 and missing.headers["content-type"] == "application/json"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = build_text_model("llama", tmp_path_factory.mktemp("binary-llama"))
    started = Server(tmp_path_factory.mktemp("binary-server"),
                     {"default_models": ["lm"], "extra_models": {"lm": str(folder)}})
    try:
        started.wait_ready()
        yield started
    finally:
        started.stop()


def test_the_notebook_client_asks_for_every_heads_map_in_the_binary_form(server, monkeypatch):
    from attnlab import Lab

    lab = Lab(server.base, progress=False, timeout=120)
    monkeypatch.setattr(lab, "_job", lambda *a, **k: pytest.fail("every head's map was asked as a job"))
    result = lab.attention(TEXT, "lm", include_scores=True)
    served = httpx.post(server.base + "/api/text/attention", timeout=120,
                        json={"model": "lm", "text": TEXT, "include_scores": True, "encoding": "f32"}).json()
    assert result.attention.shape == tuple(served["attention"]["shape"])
    assert np.array_equal(result.attention, _base64(served["attention"]))
    assert np.array_equal(result.scores, _base64(served["scores"]))
    assert result.tokens == served["tokens"] and result.run_id == served["run_id"]
    # windows and rows come in the binary form too: never through the JSON path
    json_path = lab._json
    monkeypatch.setattr(lab, "_json", lambda method, path, *a, **k: pytest.fail(f"{path} read as JSON")
                        if path.startswith("/api/runs/") else json_path(method, path, *a, **k))
    window = lab.window(result.run_id, 1, 2, rows=[0, 3], cols=[0, 3])
    assert np.array_equal(window.attention, result.attention[1, 2, :3, :3])
    row = lab.row(result.run_id, 4, layers=[0, 1], heads=[2])
    assert row["attention"].shape == (2, 1, len(result.tokens))
    # a row is rebuilt from the run's q̂ k̂ᵀ (models/atlas.py full_rows), not sliced from P: float32 rounding apart
    np.testing.assert_allclose(row["attention"][:, 0], result.attention[[0, 1], 2, 4], rtol=1e-5, atol=1e-7)


def test_every_heads_map_of_smollm2_at_128_tokens_is_one_request_under_the_default_cap():
    """The default max_response_numbers admits 128 tokens × every head of smollm2-135m (its shape from the prepared
    weights' config): the maps and each head's received attention, as a plain every-head request answers them."""
    from pathlib import Path

    from app.attention import check_response_numbers
    from app.settings import Settings

    config = json.loads((Path(__file__).resolve().parents[2] / "weights" / "smollm2-135m" / "config.json").read_text())
    heads = config["num_hidden_layers"] * config["num_attention_heads"]
    numbers = heads * 128 * 128 + heads * 128  # (L, H, T, T) maps + (L, H, T) received
    check_response_numbers(Settings(), numbers, {"layers": config["num_hidden_layers"]}, "")  # no 413
    with pytest.raises(Exception) as refused:  # and the cap still bites past it
        check_response_numbers(Settings(), 2 * numbers, {"layers": config["num_hidden_layers"]}, "")
    assert getattr(refused.value, "status_code", None) == 413
