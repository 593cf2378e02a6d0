"""POST /api/text/attention and the service endpoints, on tiny random-weight BERTs (API.md)."""
from __future__ import annotations

import base64
import concurrent.futures

import numpy as np
import pytest
from torch import nn

from tests.float32 import assert_close_f32, attention_terms

SENTENCE = "the cat sat on the mat because it was tired ."


def post(client, **body):
    body.setdefault("model", "tiny")
    body.setdefault("text", SENTENCE)
    return client.post("/api/text/attention", json=body)


def test_health_ready_models(client):
    assert client.get("/api/health").json() == {"status": "ok"}
    assert client.get("/api/ready").status_code == 200
    models = {m["id"]: m for m in client.get("/api/models").json()["models"]}
    tiny = models["tiny"]
    assert (tiny["kind"], tiny["layers"], tiny["heads"], tiny["head_dim"], tiny["output"]) == ("text", 2, 4, 8, "embedding")
    assert tiny["native_beta"] == pytest.approx(8**-0.5)
    assert tiny["max_tokens"] == 64
    assert models["tiny-mlm"]["output"] == "mlm"
    text_only = client.get("/api/models", params={"kind": "text"}).json()["models"]
    assert {m["kind"] for m in text_only} == {"text"} and {m["id"] for m in text_only} == {i for i, m in models.items() if m["kind"] == "text"}
    # speech models are listed by their kind; a kind that does not exist is a 422 naming the field
    audio = client.get("/api/models", params={"kind": "audio"}).json()["models"]
    assert {m["kind"] for m in audio} <= {"audio"} and {m["id"] for m in audio} == {i for i, m in models.items() if m["kind"] == "audio"}
    bad = client.get("/api/models", params={"kind": "video"})
    assert bad.status_code == 422 and "kind" in bad.text


def test_text_page_embeds_the_loaded_text_models(client):
    """The page config carries the text models' infos (all loaded), so the page's first request need not wait."""
    import json
    import re

    client.get("/api/models")  # loads every model
    html = client.get("/").text
    config = json.loads(re.search(r'<script[^>]*id="page-config"[^>]*>(.*?)</script>', html, re.S).group(1))
    assert {m["id"] for m in config["models"]} >= {"tiny", "tiny-mlm"} and {m["kind"] for m in config["models"]} == {"text"}


def test_full_response_shapes_and_rows(client):
    r = post(client, include_scores=True)
    assert r.status_code == 200
    data = r.json()
    T = len(data["tokens"])
    assert data["tokens"][0] == "[CLS]" and data["tokens"][-1] == "[SEP]"
    assert data["layers"] == [0, 1] and data["heads"] == [0, 1, 2, 3] and data["truncated"] is False
    att = np.array(data["attention"])
    assert att.shape == (2, 4, T, T)
    assert_close_f32(att.sum(-1), np.ones((2, 4, T)), T, scale=1.0)  # T probabilities summed
    assert np.array(data["scores"]).shape == (2, 4, T, T)
    assert data["effect"] is None and data["warnings"] == []


def test_slices(client):
    full = np.array(post(client).json()["attention"])
    part = post(client, layers=[1], heads=[3, 0]).json()
    assert part["layers"] == [1] and part["heads"] == [3, 0]
    assert np.array_equal(np.array(part["attention"])[0], full[1, [3, 0]])  # the same numbers, sliced


def test_scores_reproduce_attention_at_native_beta(client):
    data = post(client, include_scores=True, layers=[0], heads=[1]).json()
    s = np.array(data["scores"][0][0], dtype=np.float64)
    p = np.exp(data["native_beta"] * s - (data["native_beta"] * s).max(-1, keepdims=True))
    # float64 softmax of the float32 scores against float32 P: q·k over the head size, softmax over the keys
    terms = attention_terms(client.app.state.runtime.adapter("tiny").model.config, s.shape[-1])
    assert_close_f32(p / p.sum(-1, keepdims=True), data["attention"][0][0], terms, scale=1.0)


def test_compare_effect_and_scoped_beta(client):
    ivs = [{"op": "temperature", "beta": 5.0, "layers": [1], "heads": [2]}]
    data = post(client, interventions=ivs, compare=True).json()
    effect = data["effect"]
    tv = np.array(effect["attention_tv"])
    assert tv.shape == (2, 4)
    assert tv[0].max() == 0 and tv[1, 2] > 0 and tv[1, [0, 1, 3]].max() == 0
    assert len(effect["hidden_cosine"]) == 3  # embeddings + 2 layers
    assert effect["hidden_cosine"][:2] == pytest.approx([1.0, 1.0], abs=1e-6)
    assert effect["output"]["kind"] == "embedding" and effect["output"]["cls_cosine"] < 1


def test_include_base_returns_the_same_slice_without_interventions(client):
    """One request gives P̂ and P for the P̂ − P map: base_attention equals a plain request's attention."""
    ivs = [{"op": "mask_keys", "tokens": [3]}]
    data = post(client, interventions=ivs, compare=True, include_base=True, layers=[1], heads=[0, 2]).json()
    plain = post(client, layers=[1], heads=[0, 2]).json()
    assert data["base_attention"] == plain["attention"]
    assert data["attention"] != plain["attention"]
    assert np.array(data["attention"])[..., 3].max() == 0 and np.array(data["base_attention"])[..., 3].min() > 0
    assert post(client, interventions=ivs, compare=True, layers=[1]).json()["base_attention"] is None  # opt-in
    assert post(client, include_base=True).json()["base_attention"] is None  # only with compare
    f16 = post(client, interventions=ivs, compare=True, include_base=True, encoding="f16").json()["base_attention"]
    assert f16["dtype"] == "float16" and f16["shape"] == [2, 4, len(plain["tokens"]), len(plain["tokens"])]


def test_key_perturbation_through_the_api_keeps_row_ratios(client):
    j = 4
    base = post(client, include_scores=True, layers=[0]).json()
    iv = {"op": "perturb_keys", "tokens": [j], "noise_std": 1.0, "scale": 1.5, "seed": 3, "layers": [0]}
    pert = post(client, include_scores=True, layers=[0], interventions=[iv]).json()
    s0, s1 = np.array(base["scores"]), np.array(pert["scores"])
    others = [c for c in range(s0.shape[-1]) if c != j]
    assert np.allclose(s0[..., others], s1[..., others], atol=1e-5) and not np.allclose(s0[..., j], s1[..., j])
    ratio = np.array(pert["attention"])[..., others] / np.array(base["attention"])[..., others]
    assert np.allclose(ratio, ratio[..., :1], rtol=1e-4)
    assert post(client, layers=[0], interventions=[iv]).json()["attention"] == pert["attention"]  # seeded


def test_samples_report_mean_and_spread(client):
    iv = {"op": "perturb_keys", "noise_std": 2.0, "seed": 0}
    data = post(client, interventions=[iv], compare=True, samples=4).json()
    effect = data["effect"]
    assert effect["samples"] == 4
    assert len(effect["hidden_cosine_std"]) == 3 and max(effect["hidden_cosine_std"]) > 0
    assert "cls_cosine_std" in effect["output"]
    one = post(client, interventions=[iv], compare=True).json()
    assert data["attention"] == one["attention"]  # attention is the first sample's


def test_all_masked_keys_warn_and_stay_finite(client):
    T = len(post(client).json()["tokens"])
    data = post(client, interventions=[{"op": "mask_keys", "tokens": list(range(T)), "layers": [0], "heads": [1]}]).json()
    att = np.array(data["attention"])
    assert np.all(att[0, 1] == 0) and np.isfinite(att).all()
    assert any("every key masked" in w for w in data["warnings"])


def test_mlm_output(client):
    data = post(client, model="tiny-mlm", text="the cat [MASK] on the mat",
                interventions=[{"op": "ablate_heads", "layers": [0]}], compare=True).json()
    assert data["output"]["masks"][0]["position"] == 3
    out = data["effect"]["output"]
    assert out["kind"] == "mlm" and len(out["before"][0]["top"]) == 5 and out["kl"][0] >= 0


def test_f16_encoding_matches_json(client):
    js = np.array(post(client, layers=[0], heads=[0]).json()["attention"])
    f16 = post(client, layers=[0], heads=[0], encoding="f16").json()["attention"]
    arr = np.frombuffer(base64.b64decode(f16["data"]), dtype="<f2").reshape(f16["shape"])
    assert arr.shape == js.shape and np.allclose(arr, js, atol=1e-3)


def test_f32_encoding_is_exact(client):
    """'f32' carries the very float32 values the JSON lists carry (P and Ŝ), in base64 little-endian."""
    js = post(client, layers=[1], heads=[2, 3], include_scores=True).json()
    binary = post(client, layers=[1], heads=[2, 3], include_scores=True, encoding="f32").json()
    for field in ("attention", "scores"):
        arr = np.frombuffer(base64.b64decode(binary[field]["data"]), dtype="<f4").reshape(binary[field]["shape"])
        assert binary[field]["dtype"] == "float32"
        assert np.array_equal(arr, np.array(js[field], dtype=np.float32))


def test_truncation_flagged(client):
    data = post(client, text=" ".join(["cat"] * 300), layers=[0], heads=[0]).json()
    assert data["truncated"] is True and len(data["tokens"]) == 64
    assert any("truncated" in w for w in data["warnings"])


@pytest.mark.parametrize(
    "body,field",
    [
        ({"interventions": [{"op": "temperature", "beta": 0}]}, "beta"),
        ({"interventions": [{"op": "temperature", "beta": 1e5}]}, "beta"),
        ({"interventions": [{"op": "sharpen"}]}, "interventions"),
        ({"interventions": [{"op": "mask_keys", "tokens": [999]}]}, "tokens"),
        ({"interventions": [{"op": "mask_keys", "tokens": [-1]}]}, "tokens"),
        ({"interventions": [{"op": "causal", "layers": [2]}]}, "layers"),
        ({"interventions": [{"op": "ablate_heads", "heads": [4]}]}, "heads"),
        ({"interventions": [{"op": "perturb_keys", "noise_std": -1}]}, "noise_std"),
        ({"layers": [5]}, "layers"),
        ({"heads": [9]}, "heads"),
        ({"text": ""}, "text"),
        ({"text": "   "}, "text"),
        ({"text": "x" * 2001}, "text"),
        ({"model": "../../etc/passwd"}, "model"),
        ({"samples": 0}, "samples"),
        ({"unknown_field": 1}, "unknown_field"),
    ],
)
def test_bad_input_is_422_naming_the_field(client, body, field):
    r = post(client, **body)
    assert r.status_code == 422, r.text
    assert field in r.text


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_json_literals_are_422(client, literal):
    raw = '{"model": "tiny", "text": "the cat", "interventions": [{"op": "temperature", "beta": %s}]}' % literal
    r = client.post("/api/text/attention", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 422 and "beta" in r.text


def test_malformed_json_is_4xx(client):
    r = client.post("/api/text/attention", content="{not json", headers={"content-type": "application/json"})
    assert 400 <= r.status_code < 500


def test_response_over_the_cap_is_413_naming_it(client):
    long_text = " ".join(["cat"] * 60)
    r = post(client, text=long_text, include_scores=True)  # 2 × 2 × 4 × 62² > 20,000
    assert r.status_code == 413 and "max_response_numbers" in r.json()["detail"]
    assert post(client, text=long_text, layers=[0], heads=[0]).status_code == 200


def test_concurrent_requests_are_isolated(client):
    bodies = {
        "hot": {"interventions": [{"op": "temperature", "beta": 80}]},
        "masked": {"interventions": [{"op": "mask_keys", "tokens": [1, 2, 3]}]},
        "plain": {},
    }
    expected = {k: post(client, **dict(b)).json()["attention"] for k, b in bodies.items()}
    jobs = [k for k in bodies for _ in range(6)]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda k: (k, post(client, **dict(bodies[k]), text=SENTENCE + " ").json()), jobs))
    # a different text (trailing space is stripped by the tokenizer but is a new cache key) forces real runs
    for name, data in results:
        assert data["attention"] == expected[name], name


def test_security_headers_on_pages(client):
    r = client.get("/")
    assert r.status_code == 200
    assert r.headers["x-content-type-options"] == "nosniff"
    assert "default-src 'self'" in r.headers["content-security-policy"]


def test_thumbnails_are_every_head_pooled_as_uint8_pictures(client):
    text = " ".join(["the cat sat on the mat"] * 4)  # 26 tokens > 8
    data = post(client, text=text, layers=[0], heads=[0], thumbnail_size=8).json()
    thumbs = data["thumbnails"]
    assert thumbs["dtype"] == "uint8" and thumbs["shape"] == [2, 4, 8, 8]
    levels = np.frombuffer(base64.b64decode(thumbs["data"]), dtype=np.uint8).reshape(thumbs["shape"])
    assert (levels.reshape(8, -1).max(-1) == 255).all()  # each head scaled to its own maximum
    full = np.array(post(client, text=text).json()["attention"])  # (2, 4, T, T)
    T = full.shape[-1]
    bins = [(i * T // 8, -(-(i + 1) * T // 8)) for i in range(8)]  # adaptive pooling's bins
    pooled = np.array([[[[full[l, h, r0:r1, c0:c1].mean() for c0, c1 in bins] for r0, r1 in bins]
                        for h in range(4)] for l in range(2)])
    assert np.allclose(thumbs["max"], pooled.max(axis=(-1, -2)), rtol=1e-4)
    assert np.abs(levels / 255.0 - pooled / pooled.max(axis=(-1, -2), keepdims=True)).max() <= 0.5 / 255 + 1e-6


def test_warming_the_example_makes_the_pages_first_view_a_cache_hit(client):
    from app.routes.pages import EXAMPLE_PAIR, EXAMPLE_TEXT, warm_example

    runtime = client.app.state.runtime
    assert warm_example(runtime, "no-such-model") is False
    assert warm_example(runtime, "tiny") is True
    hits = runtime.cache.hits
    body = {"model": "tiny", "text": EXAMPLE_TEXT, "text_pair": EXAMPLE_PAIR, "layers": [0], "heads": [0],
            "include_scores": True, "thumbnail_size": 24, "encoding": "f32"}
    response = client.post("/api/text/attention", json=body)
    assert response.status_code == 200 and runtime.cache.hits == hits + 1
    assert "model;" not in response.headers["server-timing"]  # no model run for the visitor


@pytest.mark.parametrize("limited_client", [{"cpu_linear": "blas"}, {"cpu_linear": "onednn"}], indirect=True)
def test_ready_says_what_runs_the_linear_layers_on_the_cpu(limited_client):
    """ATTNLAB_CPU_LINEAR reaches the loaded model (models/cpu_linear.py), and /api/ready says which it is."""
    from models.cpu_linear import OneDNNLinear, onednn_available

    runtime = limited_client.app.state.runtime
    chosen = runtime.settings.cpu_linear if onednn_available() else "blas"
    routed = [type(m) is OneDNNLinear for m in runtime.adapter("tiny").model.modules() if isinstance(m, nn.Linear)]
    assert routed and all(r == (chosen == "onednn") for r in routed)
    assert limited_client.get("/api/ready").json()["cpu_linear"] == chosen
    # and the view it serves is the same attention either way (tests/unit/test_cpu_linear.py bounds the difference)
    assert post(limited_client).status_code == 200
