"""Issue 12, item 11: wrong types are refused (422 naming the field), parse errors say what is wrong, and
OpenAPI declares what the guards answer. Before the fix `"heads": [true]` answered for head 1, and
`"samples": "2"`, `"include_scores": "yes"`, `"seed": false` were accepted; a non-UTF-8 body, 100k-deep
nesting or a 5,000-digit number got "There was an error parsing the body"."""
from __future__ import annotations

import pytest

BASE = {"model": "tiny", "text": "the cat sat on the mat", "layers": [0], "heads": [0]}


@pytest.mark.parametrize("change, field", [
    ({"heads": [True]}, ["body", "heads", 0]),
    ({"samples": "2", "compare": True}, ["body", "samples"]),
    ({"include_scores": "yes"}, ["body", "include_scores"]),
    ({"interventions": [{"op": "perturb_keys", "noise_std": 0.1, "seed": False}]}, ["body", "interventions", 0, "perturb_keys", "seed"]),
    ({"layers": ["0"]}, ["body", "layers", 0]),
    ({"compare": 1}, ["body", "compare"]),
])
def test_wrong_types_are_422_naming_the_field(make_client, change, field):
    r = make_client().post("/api/text/attention", json={**BASE, **change})
    assert r.status_code == 422, r.text
    assert field in [e["loc"] for e in r.json()["detail"]], r.json()


def test_right_types_still_pass(make_client):
    r = make_client().post("/api/text/attention", json={**BASE, "samples": 2, "compare": True, "include_scores": True,
                                                        "interventions": [{"op": "temperature", "beta": 2}]})  # int for a float: fine
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("body, status, words", [
    (b'{"text": "caf\xe9"}', 400, "UTF-8"),
    (b"[" * 100_000 + b"]" * 100_000, 400, "nested too deeply"),
    (b'{"text": "a", "samples": ' + b"9" * 5000 + b"}", 400, "4,300 digits"),
    (b'{"text": "a", "samples": }', 422, "Expecting value at line 1, column 26"),
])
def test_parse_errors_say_what_is_wrong(make_client, body, status, words):
    r = make_client().post("/api/text/attention", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    assert words in r.text and "There was an error parsing the body" not in r.text


def test_not_json_is_415(make_client):
    r = make_client().post("/api/text/attention", content=b"text=hello", headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 415 and "application/json" in r.json()["detail"]


def test_openapi_declares_the_guards_answers(make_client):
    schema = make_client().get("/openapi.json").json()
    operations = [(path, method, op) for path, ops in schema["paths"].items() for method, op in ops.items()]
    assert len(operations) >= 13
    for path, method, op in operations:
        codes = set(op["responses"])
        assert "503" in codes, (path, method)
        if method == "post":
            assert {"400", "408", "413", "415", "422", "503"} <= codes, (path, codes)
    assert "404" in schema["paths"]["/api/image/attention"]["post"]["responses"]
    assert "404" in schema["paths"]["/api/images/{image_id}/view"]["get"]["responses"]


# ---- issue 19 §7: the Gaussian routes, strict like the text routes -----------------------------------------
@pytest.mark.parametrize("path, body, field", [
    ("/api/gaussian/attention", {"query": [0, False]}, ["body", "query", 1]),
    ("/api/gaussian/attention", {"layer": False}, ["body", "layer"]),
    ("/api/gaussian/attention", {"head": True}, ["body", "head"]),
    ("/api/gaussian/attention", {"alpha": "5"}, ["body", "alpha"]),
    ("/api/gaussian/attention", {"epoch": True}, ["body", "epoch"]),
    ("/api/gaussian/conv-equivalence", {"seed": False}, ["body", "seed"]),
    ("/api/gaussian/conv-equivalence", {"kernel_size": True}, ["body", "kernel_size"]),
    ("/api/gaussian/conv-equivalence", {"image_size": 16.0}, ["body", "image_size"]),
])
def test_gaussian_routes_refuse_coerced_types(make_client, path, body, field):
    r = make_client().post(path, json=body)
    assert r.status_code == 422, r.text
    assert field in [e["loc"] for e in r.json()["detail"]], r.json()


def test_gaussian_routes_still_take_right_types_and_declare_their_404(make_client):
    client = make_client()
    r = client.post("/api/gaussian/conv-equivalence", json={"kernel_size": 3, "image_size": 8, "seed": 1, "alpha": 50})
    assert r.status_code == 200, r.text
    r = client.post("/api/gaussian/attention", json={"query": [1, 2], "layer": 0, "head": 0, "alpha": 5})
    assert r.status_code in (200, 404), r.text  # 404 only where no trained run is committed
    assert client.post("/api/gaussian/attention", json={"model": "nope"}).status_code == 404
    paths = client.get("/openapi.json").json()["paths"]
    for path, method in [("/api/gaussian/attention", "post"), ("/api/gaussian/centers", "get"),
                         ("/api/gaussian/history", "get"), ("/api/gaussian/blocks", "get")]:
        assert "404" in paths[path][method]["responses"], path
    schema = client.get("/openapi.json").json()["components"]["schemas"]["ConvEquivalenceRequest"]
    assert schema["properties"]["kernel_size"]["enum"] == [1, 3, 5, 7]
