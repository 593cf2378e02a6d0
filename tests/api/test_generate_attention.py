"""Attention while the model writes (POST /api/text/generate with `attention`, issue 39) on tiny random decoders: each
step's row equals the model's own eager attention on the finished sequence at that query, masked keys are exactly 0
at every step, top-k rows carry the row's exact log-sum-exp, and the continuation is a kept run whose windows equal
eager attention."""
from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.api.helpers import TINY_ATLAS, TINY_TEXT, sse_events, tiny_models_client

TEXT = "the cat sat on the mat because it was tired"
FAMILIES = {"tiny-llama": "llama", "tiny-gemma2": "gemma2", "tiny-gemma3": "gemma3"}
# prompts each tiny random model continues for 6 tokens (on most, its end-of-sequence token comes first); longer than
# the Gemma models' sliding window (4), so a row's keys outside the window are 0 as the model's own mask says
TEXTS = {"tiny-llama": TEXT, "tiny-gemma2": "it was the capital of france , the cat sat",
         "tiny-gemma3": "small red house because the car house big cross did"}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with tiny_models_client(tmp_path_factory, FAMILIES, default_models=["tiny-llama"], max_new_tokens=12,
                            max_response_numbers=200_000) as client:
        yield client


def _generate(client, model: str, attention: dict, interventions=(), max_new_tokens: int = 6, text: str = TEXT):
    body = {"model": model, "text": text, "max_new_tokens": max_new_tokens, "interventions": list(interventions),
            "attention": attention}
    response = client.post("/api/text/generate", json=body)
    assert response.status_code == 200, response.text
    events = sse_events(response)
    assert events[-1].get("done") is True, events[-1]
    return events[:-1], events[-1]


def _eager(client, model: str, ids: list[int]) -> torch.Tensor:
    """The model's own eager attention (transformers' implementation, not the lab's) on `ids`: (L, H, T, T)."""
    source = client.app.state.runtime.settings.extra_models[model]
    eager = AutoModelForCausalLM.from_pretrained(source, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        out = eager(input_ids=torch.tensor([ids]), output_attentions=True)
    return torch.stack([a[0] for a in out.attentions])


def _decode(field) -> np.ndarray:
    if isinstance(field, dict):
        return np.frombuffer(base64.b64decode(field["data"]), dtype="<f4").reshape(field["shape"])
    return np.array(field, dtype=np.float64)


@pytest.mark.parametrize("model", list(FAMILIES))
def test_each_step_row_equals_eager_attention_on_the_finished_sequence(client, model):
    """At step s the row has P + s keys and is the query at P + s − 1, for every layer and head, on both sides."""
    steps, done = _generate(client, model, {"layers": None, "heads": None}, text=TEXTS[model])
    adapter = client.app.state.runtime.adapter(model)
    prompt = adapter.prompt_ids(TEXTS[model])
    n = len(prompt)
    assert done["prompt_tokens"] == n
    for prefix in ("", "base_"):
        ids = prompt + [e[f"{prefix}id"] for e in steps if e[f"{prefix}id"] is not None]
        eager = _eager(client, model, ids).numpy()  # (L, H, T, T)
        taken = 0
        for s, event in enumerate(steps):
            if event[f"{prefix}ended"]:
                assert event[f"{prefix}attention"] is None
                continue
            rows = _decode(event[f"{prefix}attention"])  # (L, H, P + s)
            assert rows.shape == (adapter.info.layers, adapter.info.heads, n + s)
            np.testing.assert_allclose(rows, eager[:, :, n + s - 1, : n + s], atol=1e-4, rtol=0)
            taken += 1
        assert taken == 6


def test_chosen_layers_and_heads_and_f32_rows(client):
    steps, _ = _generate(client, "tiny-llama", {"layers": [1], "heads": [3, 0], "encoding": "f32"})
    adapter = client.app.state.runtime.adapter("tiny-llama")
    prompt = adapter.prompt_ids(TEXT)
    ids = prompt + [e["id"] for e in steps if e["id"] is not None]
    eager = _eager(client, "tiny-llama", ids).numpy()
    for s, event in enumerate(e for e in steps if not e["ended"]):
        rows = _decode(event["attention"])
        assert rows.shape == (1, 2, len(prompt) + s)
        np.testing.assert_allclose(rows[0], eager[1, [3, 0], len(prompt) + s - 1, : len(prompt) + s], atol=1e-4)


def test_masked_keys_are_exactly_zero_at_every_step(client):
    masked = [1, 3, 4]
    steps, _ = _generate(client, "tiny-llama", {"layers": None, "heads": None},
                         [{"op": "mask_keys", "tokens": masked}], max_new_tokens=8)
    live = [e for e in steps if not e["ended"]]
    assert len(live) >= 2
    for event in live:
        rows = _decode(event["attention"])
        assert np.all(rows[..., masked] == 0.0)  # exactly, on every layer and head
        np.testing.assert_allclose(rows.sum(-1), 1.0, atol=1e-5)
        assert np.all(_decode(event["base_attention"])[..., masked] > 0)  # the plain side attends there


def test_temperature_applies_at_every_step(client):
    """β on layer 0 flattens its rows toward uniform at every step; the plain side is untouched."""
    steps, _ = _generate(client, "tiny-llama", {"layers": [0], "heads": None},
                         [{"op": "temperature", "beta": 1e-7, "layers": [0]}])
    for s, event in enumerate(e for e in steps if not e["ended"]):
        rows = _decode(event["attention"])[0]  # (H, T_k)
        np.testing.assert_allclose(rows, 1.0 / rows.shape[-1], atol=1e-4)
        assert np.abs(_decode(event["base_attention"])[0] - 1.0 / rows.shape[-1]).max() > 1e-3


def test_top_k_rows_carry_the_exact_log_sum_exp(client):
    """The k largest probabilities, and lse such that exp(z_j − lse) is P[i, j] for every key, z from the kept run."""
    steps, done = _generate(client, "tiny-llama", {"layers": [0, 1], "heads": None, "top_k": 3},
                            [{"op": "mask_keys", "tokens": [2]}])
    runtime = client.app.state.runtime
    adapter = runtime.adapter("tiny-llama")
    n = len(adapter.prompt_ids(TEXT))
    run = runtime.get_run(done["run_id"])
    full = _decode(client.post(f"/api/runs/{done['run_id']}/window", json={
        "layer": 1, "head": 2, "rows": [0, len(run.tokens)], "cols": [0, len(run.tokens)]}).json()["attention"])
    record = run.atlas.record(1)
    for s, event in enumerate(e for e in steps if not e["ended"]):
        rows = event["attention"]
        assert len(rows) == 2 and len(rows[0]) == adapter.info.heads
        head = rows[1][2]
        query = n + s - 1
        expected = np.sort(full[query])[::-1][:3]
        np.testing.assert_allclose(head["values"], expected, atol=1e-5)
        np.testing.assert_allclose(full[query, head["indices"]], head["values"], atol=1e-5)
        assert 2 not in head["indices"]
        # every key's probability from z (q̂ k̂ᵀ of the kept run) and the step's lse
        q, k = record.queries[2, query].float(), record.keys[2 // record.n_rep, : query + 1].float()
        z = (q @ k.T * record.native_beta).numpy()
        p = np.exp(z - head["lse"])
        p[2] = 0.0
        np.testing.assert_allclose(p, full[query, : query + 1], atol=1e-5)
    # the plain side (no intervention on the layer: lse from the most attended key's logit) against its own run
    base = runtime.get_run(done["base_run_id"]).atlas.record(0)
    for s, event in enumerate(e for e in steps if not e["base_ended"]):
        query = n + s - 1
        for head, row in enumerate(event["base_attention"][0]):
            q, k = base.queries[head, query].float(), base.keys[head // base.n_rep, : query + 1].float()
            z = (q @ k.T * base.native_beta).numpy()
            np.testing.assert_allclose(np.exp(z[row["indices"]] - row["lse"]), row["values"], atol=1e-5)
            np.testing.assert_allclose(np.exp(z - row["lse"]).sum(), 1.0, atol=1e-5)


def test_the_continuation_is_a_run_whose_windows_equal_eager(client):
    steps, done = _generate(client, "tiny-llama", {"layers": [0], "heads": [0], "top_k": 2},
                            [{"op": "temperature", "beta": 0.05, "layers": [1]}])
    adapter = client.app.state.runtime.adapter("tiny-llama")
    prompt = adapter.prompt_ids(TEXT)
    base_ids = prompt + [e["base_id"] for e in steps if e["base_id"] is not None]
    T = len(base_ids)
    window = client.post(f"/api/runs/{done['base_run_id']}/window",
                         json={"layer": 1, "head": 3, "rows": [0, T], "cols": [0, T]})
    assert window.status_code == 200, window.text
    eager = _eager(client, "tiny-llama", base_ids).numpy()
    np.testing.assert_allclose(_decode(window.json()["attention"]), eager[1, 3], atol=1e-5)
    # the intervened run: its generated rows are the ones streamed (layer 0 head 0's top 2), and minus works on it
    ids = prompt + [e["id"] for e in steps if e["id"] is not None]
    run = client.app.state.runtime.get_run(done["run_id"])
    assert run.tokens == [adapter.token_text(i) for i in ids]
    minus = client.post(f"/api/runs/{done['run_id']}/window", json={
        "layer": 1, "head": 0, "rows": [0, 1], "cols": [0, 1], "minus": done["base_run_id"]})
    if ids == base_ids:
        assert minus.status_code == 200, minus.text
    else:  # continuations that part: P̂ − P of other tokens means nothing (issue 56)
        assert minus.status_code == 422 and "minus" in minus.text, minus.text
    # the last step's row is the query that produced the last token: position len(ids) − 2
    row = client.post(f"/api/runs/{done['run_id']}/row", json={"row": len(ids) - 2, "layers": [0], "heads": [0]})
    assert row.status_code == 200, row.text
    last = [e for e in steps if not e["ended"]][-1]["attention"][0][0]
    np.testing.assert_allclose(np.array(row.json()["attention"][0][0])[last["indices"]], last["values"], atol=1e-5)


@pytest.mark.parametrize("attention,field", [
    ({"layers": [2]}, "layers"),  # the tiny llama has 2 layers
    ({"heads": [4]}, "heads"),
    ({"heads": [1, 1]}, "heads"),
    ({"top_k": 0}, "top_k"),
    ({"layers": "all"}, "layers"),
    ({"rows": 3}, "rows"),
])
def test_bad_attention_fields_are_422_naming_them(client, attention, field):
    response = client.post("/api/text/generate", json={"model": "tiny-llama", "text": TEXT, "max_new_tokens": 2,
                                                       "attention": attention})
    assert response.status_code == 422, response.text
    detail = json.dumps(response.json()["detail"])
    assert "attention" in detail and field in detail, detail


def test_a_stream_without_attention_has_no_attention_keys_but_names_its_runs(client):
    response = client.post("/api/text/generate", json={"model": "tiny-llama", "text": TEXT, "max_new_tokens": 2})
    events = sse_events(response)
    assert all("attention" not in e for e in events[:-1])
    assert client.app.state.runtime.get_run(events[-1]["run_id"]) is not None


def test_a_long_prompt_streams_blockwise_rows_equal_to_eager(tmp_path_factory):
    """A prompt over full_map_tokens runs its forward in blocks of query rows (no T × T map, models/atlas.py): step
    0's row is rebuilt from the layer's record, the later steps come through the KV cache; all equal eager."""
    with tiny_models_client(tmp_path_factory, {"tiny-llama": "llama"}, default_models=["tiny-llama"],
                            max_new_tokens=12, max_response_numbers=200_000, **TINY_ATLAS) as long_client:
        text = TINY_TEXT
        steps, done = _generate(long_client, "tiny-llama", {"layers": None, "heads": None}, text=text,
                                interventions=[{"op": "mask_keys", "tokens": [5]}])
        top, _ = _generate(long_client, "tiny-llama", {"layers": None, "heads": None, "top_k": 4}, text=text)
        adapter = long_client.app.state.runtime.adapter("tiny-llama")
        prompt = adapter.prompt_ids(text)
        n = len(prompt)
        assert n > TINY_ATLAS["full_map_tokens"]
        ids = prompt + [e["base_id"] for e in steps if e["base_id"] is not None]
        eager = _eager(long_client, "tiny-llama", ids).numpy()
        for s, (event, top_event) in enumerate(zip(steps, top)):
            if event["base_ended"]:
                break
            np.testing.assert_allclose(_decode(event["base_attention"]), eager[:, :, n + s - 1, : n + s], atol=1e-4)
            assert np.all(_decode(event["attention"])[..., 5] == 0.0)
            for layer, heads in enumerate(top_event["base_attention"]):
                for head, row in enumerate(heads):
                    expected = eager[layer, head, n + s - 1, : n + s]
                    np.testing.assert_allclose(row["values"], np.sort(expected)[::-1][:4], atol=1e-5)
        # the kept runs are long runs (an atlas) and answer windows like any
        window = long_client.post(f"/api/runs/{done['base_run_id']}/window",
                                  json={"layer": 0, "head": 1, "rows": [n, len(ids)], "cols": [0, len(ids)]})
        assert window.status_code == 200, window.text
        np.testing.assert_allclose(_decode(window.json()["attention"]), eager[0, 1, n:, :], atol=1e-5)


def test_why_on_a_generated_token_uses_the_kept_sequence_ids(client):
    """POST /api/text/qk_attribution with the continuation's ids (prompt_ids + generated ids): its score is β × the
    kept run's own score at (query, key) of a generated row."""
    steps, done = _generate(client, "tiny-llama", {"layers": [1], "heads": [2]},
                            [{"op": "temperature", "beta": 0.5, "layers": [1]}])
    generated = [e["id"] for e in steps if e["id"] is not None]
    assert done["prompt_ids"] == client.app.state.runtime.adapter("tiny-llama").prompt_ids(TEXT)
    s = len(generated) - 1
    ids = done["prompt_ids"] + generated[:s]
    query = len(ids) - 1
    key = int(np.argmax(_decode(steps[s]["attention"])[0, 0]))
    answer = client.post("/api/text/qk_attribution", json={
        "model": "tiny-llama", "text": TEXT, "ids": ids, "layer": 1, "head": 2, "query": query, "key": key,
        "interventions": [{"op": "temperature", "beta": 0.5, "layers": [1]}]})
    assert answer.status_code == 200, answer.text
    window = client.post(f"/api/runs/{done['run_id']}/window", json={
        "layer": 1, "head": 2, "rows": [query, query + 1], "cols": [key, key + 1], "include_scores": True})
    found = answer.json()
    assert found["score"] == pytest.approx(found["beta"] * window.json()["scores"][0][0], rel=1e-5)
    bad = client.post("/api/text/qk_attribution", json={"model": "tiny-llama", "text": TEXT, "ids": [10**6],
                                                        "layer": 0, "head": 0, "query": 0, "key": 0})
    assert bad.status_code == 422 and "ids" in bad.text
