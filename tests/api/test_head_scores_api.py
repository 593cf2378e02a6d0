"""Head kinds through the API (docs/api.md "Head kinds"): POST /api/text/head_scores on tiny random decoders, its scores
equal to ones computed here from transformers' eager attention on the probe it reports, its labels by the stated
thresholds, the job form, the 422s; and `sink_mass` in every attention response (short and long runs) equal to the
mean of column 0 of P."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fastapi.testclient import TestClient

from app.main import create_app
from app.settings import Settings
from tests.api.helpers import TINY_ATLAS, sse_events, tiny_lm_client
from tests.api.helpers import TINY_TEXT as TEXT
from tests.float32 import assert_close_f32
from tests.tiny_models import build_text_model


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return str(build_text_model("llama", tmp_path_factory.mktemp("llama")))


@pytest.fixture(scope="module")
def client(tmp_path_factory, llama):
    empty = tmp_path_factory.mktemp("no-weights")  # GET /api/models then loads no prepared real model
    models = {"lm": llama, **{name: str(build_text_model(family, tmp_path_factory.mktemp(family)))
                              for name, family in (("enc", "bert"), ("gemma3", "gemma3"))}}
    with TestClient(create_app(Settings(default_models=["lm"], extra_models=models, weights_dir=str(empty),
                                        max_response_numbers=200_000))) as c:
        c.app.state.runtime.warm_up()
        yield c


@pytest.fixture(scope="module")
def builtin(client):
    response = client.post("/api/text/head_scores", json={"model": "lm", "text": None})
    assert response.status_code == 200, response.text
    return response.json()


def eager_attention(folder: str, ids: list[int]) -> np.ndarray:
    """P of every layer and head from plain transformers eager attention: (L, H, T, T)."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([ids]), output_attentions=True)
    return torch.stack(out.attentions)[:, 0].double().numpy()


def test_builtin_scores_equal_eager_on_the_reported_probe(builtin, llama):
    probe = builtin["probe"]
    ids, n = probe["repeated_tokens"]["ids"], probe["period"]
    assert probe["kind"] == "builtin" and len(ids) == 1 + 2 * n and ids[1:n + 1] == ids[n + 1:]
    assert len(set(ids[1:n + 1])) == n  # distinct: each token of the second repeat occurred exactly once before
    P = eager_attention(llama, ids)  # (L, H, T, T)
    rows = np.arange(n + 1, 2 * n + 1)
    expected = {
        "previous_token": P.diagonal(offset=-1, axis1=-2, axis2=-1).mean(-1),
        "induction": P[:, :, rows, rows - n + 1].mean(-1),
        "duplicate_token": P[:, :, rows, rows - n].mean(-1),  # the one earlier copy of each second-repeat token
        "sink": P[..., 0].mean(-1),
        "mean_distance": (P * np.abs(np.subtract.outer(np.arange(len(ids)), np.arange(len(ids))))).sum(-1).mean(-1),
    }
    for name, value in expected.items():
        assert np.allclose(builtin["scores"][name], value, atol=1e-4), name
    assert np.array(builtin["scores"]["retrieval"]).shape == (2, 4)


def test_retrieval_equals_greedy_copying_with_eager_attention(client, builtin, llama):
    """Each needle probe continued greedily by plain transformers (eager attention, no cache): per head, the share of
    steps whose top-attended key (argmax of the row that produced the token) is the copied token's source."""
    import transformers as tf

    from models.head_kinds import retrieval_probe

    probe = builtin["probe"]
    adapter = client.app.state.runtime.adapter("lm")
    model = tf.AutoModelForCausalLM.from_pretrained(llama, attn_implementation="eager").eval()
    hits, steps = np.zeros((2, 4)), 0
    for number in range(probe["needles"]):
        ids, sources, n_steps = retrieval_probe(
            lambda text: adapter.tokenizer(text, add_special_tokens=False)["input_ids"], probe["first_token_id"],
            probe["needle"]["filler"], number, probe["seed"])
        steps += n_steps
        for _ in range(n_steps):
            with torch.inference_mode():
                out = model(input_ids=torch.tensor([ids]), output_attentions=True)
            token = int(out.logits[0, -1].argmax())
            top = torch.stack(out.attentions)[:, 0, :, -1].argmax(-1).numpy()  # (L, H)
            if token in sources:
                hits += top == sources[token]
            ids = ids + [token]
            if token in adapter.eos_ids:
                break
    assert probe["needle"]["steps"] == steps
    assert_close_f32(builtin["scores"]["retrieval"], hits / steps, 1, scale=1.0)  # a share: one float32 division
    listed = {(h["layer"], h["head"]) for h in builtin["retrieval_heads"]}
    assert listed == {tuple(int(i) for i in x) for x in np.argwhere(hits / steps > probe["needle"]["threshold"])}


def test_labels_follow_the_stated_thresholds(builtin):
    thresholds, scores = builtin["probe"]["thresholds"], builtin["scores"]
    assert set(thresholds) == {"previous_token", "induction", "duplicate_token", "sink"}
    for layer in range(builtin["layers"]):
        for head in range(builtin["heads"]):
            over = {k: scores[k][layer][head] for k in thresholds if scores[k][layer][head] > thresholds[k]}
            assert builtin["labels"][layer][head] == (max(over, key=over.get) if over else None)
    assert builtin["locality"] is None  # no sliding-window layers


def test_text_scores_and_cache(client, llama):
    text = "the cat sat on the mat , the cat sat on the mat"
    body = client.post("/api/text/head_scores", json={"model": "lm", "text": text}).json()
    ids = client.app.state.runtime.adapter("lm").prompt_ids(text)
    assert body["probe"] == {"kind": "text", "tokens": len(ids), "thresholds": body["probe"]["thresholds"]}
    assert "retrieval" not in body["scores"]  # the needle probe is built in only
    P = eager_attention(llama, ids)
    same = np.equal.outer(ids, ids) & np.tri(len(ids), k=-1, dtype=bool)  # (T, T) earlier copies
    rows = same.any(-1)
    duplicate = (P * same).sum(-1)[:, :, rows].mean(-1)
    assert np.allclose(body["scores"]["duplicate_token"], duplicate, atol=1e-4)
    assert np.allclose(body["scores"]["sink"], P[..., 0].mean(-1), atol=1e-4)
    again = client.post("/api/text/head_scores", json={"model": "lm", "text": text}).json()
    assert again == body


def test_job_form_gives_progress_then_the_same_answer(client, builtin):
    text = "a dog and a cat , a dog and a cat"  # not asked before: the job runs (a cached answer is sent at once)
    response = client.post("/api/text/head_scores", json={"model": "lm", "text": text},
                           headers={"Accept": "text/event-stream"})
    events = sse_events(response)
    assert [e["progress"] for e in events[:-1]] == [0, 1] and all(e["total"] == 1 for e in events[:-1])
    assert events[-1]["done"] is True
    plain = client.post("/api/text/head_scores", json={"model": "lm", "text": text}).json()
    assert {k: v for k, v in events[-1].items() if k != "done"} == plain
    again = sse_events(client.post("/api/text/head_scores", json={"model": "lm", "text": None},
                                   headers={"Accept": "text/event-stream"}))
    assert {k: v for k, v in again[-1].items() if k != "done"} == builtin


def test_locality_of_a_windowed_model(client):
    body = client.post("/api/text/head_scores", json={"model": "gemma3", "text": None}).json()
    assert body["locality"] == [["local"] * 4, ["global"] * 4] and body["sliding_window"] == 8


@pytest.mark.parametrize("payload, field", [
    ({"model": "lm", "text": "   "}, "text"),
    ({"model": "lm", "text": 5}, "text"),
    ({"model": "enc", "text": None}, "model"),
    ({"model": "nope", "text": None}, "model"),
    ({"model": "lm", "text": None, "layers": [0]}, "layers"),
    ({"model": "lm", "text": "a " * 300}, "text"),
])
def test_bad_fields_are_422_naming_them(client, payload, field):
    response = client.post("/api/text/head_scores", json=payload)
    assert response.status_code == 422, response.text
    assert field in str(response.json()["detail"])


# ---- sink_mass in attention responses ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def long_client(llama):
    with tiny_lm_client(llama, **TINY_ATLAS) as c:
        yield c


def test_sink_mass_is_the_mean_of_column_zero(client, long_client):
    short = client.post("/api/text/attention", json={"model": "lm", "text": TEXT, "layers": [1], "heads": [2]}).json()
    everything = client.post("/api/text/attention", json={"model": "lm", "text": TEXT}).json()
    P = np.array(everything["attention"])  # (L, H, T, T)
    n = P.shape[-1]
    # a float32 mean over the n queries, in the forward; every head, whichever were asked for
    assert_close_f32(short["sink_mass"], P[..., 0].mean(-1), n, scale=1.0)
    long = long_client.post("/api/text/attention", json={"model": "lm", "text": TEXT}).json()
    assert long["attention"] is None and long["overview"] is not None  # the long path: no P kept
    # the long path's P (q·k over the head size, softmax over the keys) against the short one's, then the mean
    terms = long_client.app.state.runtime.adapter("lm").info.head_dim + 2 * n
    assert_close_f32(long["sink_mass"], P[..., 0].mean(-1), terms, scale=1.0)


@pytest.fixture(scope="module")
def bart(tmp_path_factory):
    return str(build_text_model("bart", tmp_path_factory.mktemp("bart")))


def test_encoder_decoder_sink_mass_per_kind(bart):
    """Per kind (encoder, decoder, cross: its first key is the first source token), short and long runs alike."""
    body = {"model": "lm", "text": "the cat sat on the mat because it was tired", "target": "the dog ran on the street"}
    with tiny_lm_client(bart) as short_client, tiny_lm_client(bart, **TINY_ATLAS) as long_client:
        short = short_client.post("/api/text/attention", json=body).json()
        long = long_client.post("/api/text/attention", json=body).json()
        head_dim = long_client.app.state.runtime.adapter("lm").info.head_dim
    assert long["attention"] is None and short["attention"] is not None
    assert set(short["sink_mass"]) == {"encoder", "decoder", "cross"}
    for kind, maps in short["attention"].items():
        P = np.array(maps)  # (L, H, T_q, T_k)
        n_queries, n_keys = P.shape[-2:]
        assert_close_f32(short["sink_mass"][kind], P[..., 0].mean(-1), n_queries, scale=1.0)  # a mean over queries
        # the long path's P against the short one's (q·k over the head size, softmax over the keys), then the mean
        assert_close_f32(long["sink_mass"][kind], P[..., 0].mean(-1), head_dim + n_keys + n_queries, scale=1.0)
