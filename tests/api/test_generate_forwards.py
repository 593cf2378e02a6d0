"""A continuation costs its decode (issue 55 §1): POST /api/text/generate without interventions decodes ONCE (the base
side is the same sequence), and its kept runs are named at the end without running the model again; a run is made by
one forward of the finished sequence on first use of its id, and its windows are exactly those of that forward.

The model's forwards are counted by a forward pre-hook on the tiny decoder's top-level module."""
from __future__ import annotations

import base64
import threading

import numpy as np
import pytest
import torch

from tests.api.helpers import sse_events, tiny_models_client

TEXT = "the cat sat on the mat because it was tired"


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with tiny_models_client(tmp_path_factory, {"tiny-llama": "llama"}, default_models=["tiny-llama"],
                            max_new_tokens=12, max_response_numbers=200_000) as client:
        yield client


class Forwards:
    """Counts the model's forwards (calls of its top-level module) while in a `with`."""

    def __init__(self, model: torch.nn.Module):
        self.model, self.calls, self.fed = model, 0, []
        self._lock = threading.Lock()

    def _count(self, module, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        with self._lock:
            self.calls += 1
            self.fed.append(None if ids is None else int(ids.shape[-1]))

    def __enter__(self) -> Forwards:
        self._handle = self.model.register_forward_pre_hook(self._count, with_kwargs=True)
        return self

    def __exit__(self, *exc) -> None:
        self._handle.remove()


def _generate(client, attention=None, interventions=(), max_new_tokens: int = 8, text: str = TEXT):
    body = {"model": "tiny-llama", "text": text, "max_new_tokens": max_new_tokens, "interventions": list(interventions)}
    if attention is not None:
        body["attention"] = attention
    response = client.post("/api/text/generate", json=body)
    assert response.status_code == 200, response.text
    events = sse_events(response)
    assert events[-1].get("done") is True, events[-1]
    return events[:-1], events[-1]


@pytest.mark.parametrize("attention", [None, {"layers": None, "heads": None, "encoding": "f32"}], ids=["plain", "rows"])
def test_a_continuation_without_interventions_is_one_decode(client, attention):
    """The prompt's forward, then one one-token forward per further new token: no second decode, no re-run."""
    adapter = client.app.state.runtime.adapter("tiny-llama")
    prompt = adapter.prompt_ids(TEXT)
    with Forwards(adapter.model) as forwards:
        steps, done = _generate(client, attention)
    tokens = [e["id"] for e in steps if not e["ended"]]
    assert tokens, "the tiny model wrote no token"
    assert forwards.calls == len(tokens), forwards.fed
    assert forwards.fed == [len(prompt)] + [1] * (len(tokens) - 1)
    # the base side is the same sequence, field for field
    for event in steps:
        for name in ("token", "id", "prob", "ended") + (("attention",) if attention else ()):
            assert event[f"base_{name}"] == event[name]
    assert done["base_text"] == done["text"] and done["base_run_id"] == done["run_id"]


def test_the_kept_run_is_made_on_first_use_by_one_forward(client):
    """No forward at the end of the stream; the first window of the run id runs the finished sequence once, later
    windows and rows none; its windows are bit-identical to the engine's own run of those ids."""
    runtime = client.app.state.runtime
    adapter = runtime.adapter("tiny-llama")
    # a prompt of its own: no earlier test's run of the same ids is kept
    text = TEXT + " and slept"
    with Forwards(adapter.model) as forwards:
        steps, done = _generate(client, text=text)
        decoded = forwards.calls
        ids = done["prompt_ids"] + [e["id"] for e in steps if not e["ended"]]
        T = len(ids)
        first = client.post(f"/api/runs/{done['run_id']}/window", json={"layer": 1, "head": 2, "rows": [0, T],
                                                                       "cols": [0, T], "encoding": "f32"})
        assert first.status_code == 200, first.text
        assert forwards.calls == decoded + 1 and forwards.fed[-1] == T
        again = client.post(f"/api/runs/{done['base_run_id']}/row", json={"row": T - 1, "layers": [0], "heads": [0]})
        assert again.status_code == 200, again.text
        assert forwards.calls == decoded + 1
    own = adapter.run(adapter.encode_ids(ids), (), False).attention[1, 2]  # (T, T): the engine's run of the ids
    field = first.json()["attention"]
    window = np.frombuffer(base64.b64decode(field["data"]), dtype="<f4").reshape(field["shape"])
    assert np.array_equal(window, own.numpy())
    assert runtime.get_run(done["run_id"]).tokens == [adapter.token_text(i) for i in ids]


def test_with_interventions_two_decodes_and_two_runs_made_on_use(client):
    adapter = client.app.state.runtime.adapter("tiny-llama")
    with Forwards(adapter.model) as forwards:
        steps, done = _generate(client, interventions=[{"op": "temperature", "beta": 0.05, "layers": [1]}])
        live = sum(not e["ended"] for e in steps) + sum(not e["base_ended"] for e in steps)
        assert forwards.calls == live
        assert done["run_id"] != done["base_run_id"]
        runs = [client.app.state.runtime.get_run(done[name]) for name in ("run_id", "base_run_id")]
        assert forwards.calls == live + 2
    assert all(run is not None and run.atlas is not None for run in runs)
    assert runs[0].run_id == done["run_id"] and runs[1].run_id == done["base_run_id"]
