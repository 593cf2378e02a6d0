"""Progress of a text attention request (issue 20, the page's progress bar): with `Accept: text/event-stream` the
route streams {"progress", "total", "run"} after each attention layer and then {"done": true, …the JSON response…};
refusals before the first layer keep their own status. A tiny Llama with a small full_map_tokens, so that a sentence
is a long input (an overview, not maps)."""
from __future__ import annotations

import json

import pytest
from tests.api.helpers import TINY_ATLAS, tiny_lm_client
from tests.api.helpers import TINY_TEXT as TEXT
from tests.tiny_models import build_text_model

STREAM = {"Accept": "text/event-stream"}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    llama = str(build_text_model("llama", tmp_path_factory.mktemp("llama-progress")))
    with tiny_lm_client(llama, **TINY_ATLAS) as c:
        yield c


def _events(client, **body) -> tuple[int, str, list[dict]]:
    with client.stream("POST", "/api/text/attention", json={"model": "lm", **body}, headers=STREAM) as response:
        text = "".join(response.iter_text())
        kind = response.headers.get("content-type", "")
        status = response.status_code
    if not kind.startswith("text/event-stream"):
        return status, kind, [json.loads(text)]
    blocks = [b for b in text.split("\n\n") if b.strip()]
    # each event: its id (`<job_id>:<n>`, for re-attaching: docs/api.md "Re-attaching to a job"), then its data
    ids = [b.split("\n", 1)[0] for b in blocks]
    assert all(b.startswith("id: ") and b.split("\n", 1)[1].startswith("data: ") for b in blocks), blocks
    events = [json.loads(b.split("\n", 1)[1][len("data: "):]) for b in blocks]
    # a job's first event, before any layer (docs/api.md "Jobs"); the rest as before it
    accepted, *events = events
    assert ids == [f"id: {accepted['job_id']}:{n}" for n in range(1, len(blocks) + 1)], ids
    assert accepted["accepted"] is True and {"accepted", "eta_s", "queue_position", "runs"} <= set(accepted), accepted
    assert set(accepted) <= {"accepted", "eta_s", "queue_position", "runs", "total", "job_id"}, accepted
    for event in events:  # each progress event's ETA: what is left by the job's own rate (timing: not compared)
        if "progress" in event:
            assert event.pop("eta_s") >= 0, event
            if "total" in accepted:  # the bar's length is the accepted event's, from the first event to the last
                assert event["total"] == accepted["total"], (accepted, event)
    return status, kind, events


def _layers(client) -> int:
    return next(m["layers"] for m in client.get("/api/models").json()["models"] if m["id"] == "lm")


def test_layers_then_the_response(client):
    n_layers = _layers(client)
    status, kind, events = _events(client, text=TEXT + " one", layers=[1], heads=[0], encoding="f32")
    assert status == 200 and kind.startswith("text/event-stream")
    *progress, done = events
    assert progress == [{"progress": k, "total": n_layers, "run": 1, "runs": 1} for k in range(1, n_layers + 1)]
    assert done["done"] is True and done["attention"] is None and done["overview"]["edges"][-1] == len(done["tokens"])
    # the same request without the stream: the cached run, the same answer
    plain = client.post("/api/text/attention", json={"model": "lm", "text": TEXT + " one", "layers": [1], "heads": [0],
                                                     "encoding": "f32"})
    assert plain.status_code == 200 and plain.headers["content-type"].startswith("application/json")
    body = plain.json()
    for key in ("run_id", "tokens", "overview", "received", "entropy", "mean_distance", "output"):
        assert done[key] == body[key], key


def test_a_cached_run_answers_at_once_and_each_run_is_counted(client):
    text = TEXT + " two"
    first = _events(client, text=text)[2]
    again = _events(client, text=text)[2]
    assert len(first) > 1 and len(again) == 1 and again[0]["done"] and again[0]["run_id"] == first[-1]["run_id"]
    # compare: the run with the intervention and the run without it, each layer by layer
    n_layers = _layers(client)
    mask = {"op": "mask_keys", "tokens": [2]}
    events = _events(client, text=TEXT + " three", interventions=[mask], compare=True)[2]
    runs = [e["run"] for e in events if "progress" in e]
    assert runs == [1] * n_layers + [2] * n_layers and events[-1]["done"] and events[-1]["effect"] is not None


@pytest.mark.parametrize("samples, runs", [(1, 2), (3, 4)])
def test_one_bar_over_every_run_of_a_request(client, samples, runs):
    """A compare runs the model twice (and once more per further sample): the bar goes once from 1 to runs × layers,
    every event with the same total, never restarting."""
    n_layers = _layers(client)
    noise = {"op": "perturb_keys", "noise_std": 0.5, "layers": [0]}  # samples re-seed it: every run is a new run
    events = _events(client, text=TEXT + f" five {samples}", interventions=[noise], compare=True, samples=samples)[2]
    *progress, done = events
    assert done["done"] is True and done["effect"] is not None
    assert [e["progress"] for e in progress] == list(range(1, runs * n_layers + 1))  # monotone, one step a layer
    assert {e["total"] for e in progress} == {runs * n_layers} and {e["runs"] for e in progress} == {runs}
    assert [e["run"] for e in progress] == [k for k in range(1, runs + 1) for _ in range(n_layers)]
    # the same request again: every run cached, answered at once (nothing to count)
    again = _events(client, text=TEXT + f" five {samples}", interventions=[noise], compare=True, samples=samples)[2]
    assert len(again) == 1 and again[0]["done"]


@pytest.mark.parametrize("body, status, field", [
    ({"layers": [99]}, 422, "layers"),  # found inside the streamed work, before its first layer
    ({"position": 999}, 422, "position"),
    ({"text": "x" * 20_001}, 422, "text"),  # max_text_chars
])
def test_refusals_keep_their_status(client, body, status, field):
    code, kind, events = _events(client, **{"text": TEXT + " four", **body})
    assert code == status and kind.startswith("application/json")
    assert field in json.dumps(events[0]["detail"])



def test_a_value_weighted_overview_is_one_more_pass_on_the_bar(client):
    """A long first view with weighting value_norm rebuilds its overview layer by layer after the model run: the bar
    counts it as one more pass (2 × layers), and a weighting switch on a cached run shows the overview's pass alone."""
    n_layers = _layers(client)
    *progress, done = _events(client, text=TEXT + " six", weighting="value_norm")[2]
    assert done["done"] is True and done["weighting"] == "value_norm"
    assert [e["progress"] for e in progress] == list(range(1, 2 * n_layers + 1))
    assert {e["total"] for e in progress} == {2 * n_layers} and [e["run"] for e in progress][-1] == 2
    assert len(_events(client, text=TEXT + " seven")[2]) == n_layers + 1  # the run alone, cached after
    *progress, done = _events(client, text=TEXT + " seven", weighting="value_norm")[2]
    assert done["done"] is True and [e["progress"] for e in progress] == list(range(1, n_layers + 1))
    assert {e["total"] for e in progress} == {n_layers}
