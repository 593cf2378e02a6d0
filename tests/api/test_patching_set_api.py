"""POST /api/text/patching over a set of prompt pairs (`pairs` or `template` + `fillers`) on a tiny random decoder:
the set's numbers against the single-pair answers, the job's events, and the 4xx naming the field."""
from __future__ import annotations

import numpy as np
import pytest

from tests.api.helpers import sse_events, tiny_models_client
from tests.float32 import assert_close_f32

PAIRS = [{"clean": "the cat sat on the mat", "corrupt": "the dog ran on the rug"},
         {"clean": "a red car was big", "corrupt": "a blue tree was small", "answer": "it", "wrong": "street"}]
SET = {"model": "tiny-llama", "answer": "tired", "wrong": "house", "pairs": PAIRS, "top_k": 3}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with tiny_models_client(tmp_path_factory, {"tiny-llama": "llama"}, default_models=["tiny-llama"],
                            patching_batch_tokens=24, patching_max_pairs=4) as c:
        yield c


def _loc(response) -> list:
    return response.json()["detail"][0]["loc"]


def _array(value) -> np.ndarray:
    return np.array(value, dtype=float)


def test_a_set_is_the_mean_of_its_single_pair_scans(client):
    r = client.post("/api/text/patching", json=SET)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["set"] is True and body["n_pairs"] == 2 and body["pairs_used"] == [0, 1]
    singles = []
    for pair in PAIRS:
        single = {"model": "tiny-llama", "answer": pair.get("answer", "tired"), "wrong": pair.get("wrong", "house"),
                  "clean": pair["clean"], "corrupt": pair["corrupt"]}
        answer = client.post("/api/text/patching", json=single)
        assert answer.status_code == 200, answer.text
        singles.append(answer.json())
    per_pair = _array(body["effect_per_pair"])  # (P, L, H)
    assert per_pair.shape == (2, 2, 4)
    for k, single in enumerate(singles):
        assert np.array_equal(per_pair[k], _array(single["effect"]))  # the same code per pair: exactly
        assert np.array_equal(_array(body["estimates"]["head_output"]["per_pair"][k]), _array(single["attribution"]))
        assert body["pairs"][k]["ld_clean"] == single["ld_clean"]
    # the server's float32 mean and standard deviation over the 2 pairs, at the effects' scale
    scale = float(np.abs(per_pair).max())
    assert_close_f32(_array(body["effect"]), per_pair.mean(axis=0), len(PAIRS), scale=scale)
    assert_close_f32(_array(body["effect_std"]), per_pair.std(axis=0, ddof=1), len(PAIRS), scale=scale)
    for name in ("head_output", "atp", "atp_star"):
        numbers = body["agreement"][name]
        assert -1 <= numbers["spearman"] <= 1 and 0 <= numbers["top_k_overlap"] <= 1 and numbers["k"] == 3
        assert _array(body["estimates"][name]["mean"]).shape == (2, 4)
    assert body["pairs"][1]["answer"] == "it" and body["pairs"][0]["answer"] == "tired"


def test_a_template_with_fillers_is_the_same_set(client):
    template = {"text": "the {animal} {verb} on the {thing}",
                "fillers": [{"clean": {"animal": "cat", "verb": "sat", "thing": "mat"},
                             "corrupt": {"animal": "dog", "verb": "ran", "thing": "rug"}},
                            {"clean": {"animal": "dog", "verb": "sat", "thing": "mat"},
                             "corrupt": {"animal": "cat", "verb": "ran", "thing": "rug"}}]}
    from_template = client.post("/api/text/patching", json={**SET, "pairs": None, "template": template})
    assert from_template.status_code == 200, from_template.text
    pairs = [{"clean": "the cat sat on the mat", "corrupt": "the dog ran on the rug"},
             {"clean": "the dog sat on the mat", "corrupt": "the cat ran on the rug"}]
    from_pairs = client.post("/api/text/patching", json={**SET, "pairs": pairs}).json()
    assert from_template.json()["effect"] == from_pairs["effect"]


def test_a_streamed_set_is_a_job_with_progress_then_the_same_answer(client):
    plain = client.post("/api/text/patching", json=SET).json()
    r = client.post("/api/text/patching", json=SET, headers={"Accept": "text/event-stream"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r)  # checks the accepted event (eta_s, queue_position, runs)
    progress = [e for e in events if "progress" in e]
    steps = [e["progress"] for e in progress]
    total = 2 * (2 * 4 + 1)  # per pair: its 8 heads and the estimates
    assert steps == sorted(steps) and len(steps) >= 4 and steps[-1] == total and progress[0]["total"] == total
    assert events[-1]["done"] is True
    assert events[-1]["effect"] == plain["effect"] and events[-1]["agreement"] == plain["agreement"]


def test_the_estimates_alone(client):
    r = client.post("/api/text/patching", json={**SET, "method": "attribution"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert "agreement" not in body
    # issue 38 §6: `effect` has one meaning under method "attribution", a pair's or a set's: the attribution estimate
    # on the head output (a set: its mean over the pairs, each pair's value the single-pair scan's `effect`)
    head_output = body["estimates"]["head_output"]
    assert body["effect"] == head_output["mean"] == body["attribution"]
    assert body["effect_std"] == head_output["std"] and body["effect_per_pair"] == head_output["per_pair"]
    assert body["effect"] != body["estimates"]["atp_star"]["mean"]
    for k, pair in enumerate(PAIRS):
        single = client.post("/api/text/patching", json={
            "model": "tiny-llama", "answer": pair.get("answer", "tired"), "wrong": pair.get("wrong", "house"),
            "clean": pair["clean"], "corrupt": pair["corrupt"], "method": "attribution"}).json()
        # the same pair's estimate alone and within the set: the set's runs are batched, so the float32 sums of the
        # gradient·difference products (over the hidden size, 32, and the pair's positions) may come in another order
        tokens = max(len(pair["clean"].split()), len(pair["corrupt"].split())) + 2
        assert_close_f32(_array(body["effect_per_pair"][k]), _array(single["effect"]), 32 * tokens)


@pytest.mark.parametrize("change, status, loc", [
    ({"pairs": [PAIRS[0], {"clean": "the cat sat", "corrupt": "the dog ran on the rug"}]}, 422,
     ["body", "pairs", 1, "corrupt"]),
    ({"answer": None}, 422, ["body", "pairs", 0, "answer"]),
    ({"pairs": [{**PAIRS[0], "wrong": "cat dog"}]}, 422, ["body", "pairs", 0, "wrong"]),
    ({"pairs": [{**PAIRS[0], "clean": "   "}]}, 422, ["body", "pairs", 0, "clean"]),
    ({"pairs": [PAIRS[0]] * 5}, 413, None),
    ({"scan": "residual"}, 422, ["body", "scan"]),
    ({"clean": "the cat"}, 422, ["body", "clean"]),
    ({"pairs": []}, 422, ["body", "pairs"]),
    ({"template": {"text": "the {animal} sat", "fillers": [{"clean": {"animal": "cat"}, "corrupt": {}}]}}, 422,
     ["body", "template"]),
    ({"pairs": None, "template": {"text": "the {animal} sat", "fillers": [{"clean": {"animal": "cat"},
                                                                            "corrupt": {"beast": "dog"}}]}}, 422,
     ["body", "template", "fillers", 0, "corrupt"]),
    ({"pairs": None, "template": {"text": "the cat sat", "fillers": [{"clean": {}, "corrupt": {}}]}}, 422,
     ["body", "template", "text"]),
    ({"pairs": None, "template": {"text": "the {cat sat", "fillers": [{"clean": {}, "corrupt": {}}]}}, 422,
     ["body", "template", "text"]),
    ({"pairs": None, "template": {"text": "the {cat:d} sat", "fillers": [{"clean": {"cat": "a"},
                                                                         "corrupt": {"cat": "b"}}]}}, 422,
     ["body", "template", "text"]),
])
def test_a_bad_set_is_refused_naming_the_field(client, change, status, loc):
    r = client.post("/api/text/patching", json={**SET, **change})
    assert r.status_code == status, r.text
    if loc is None:
        detail = r.json()["detail"]
        assert detail.startswith("pairs:") and "patching_max_pairs" in detail and "limit is 4" in detail
    else:
        assert _loc(r)[:len(loc)] == loc, r.json()


def test_a_single_pair_still_needs_its_prompts(client):
    r = client.post("/api/text/patching", json={"model": "tiny-llama", "clean": "the cat", "answer": "tired",
                                                "wrong": "house"})
    assert r.status_code == 422 and _loc(r) == ["body", "corrupt"]


def test_a_set_over_the_time_limit_is_refused_before_it_runs_naming_its_field(client, monkeypatch):
    """The cost check counts every pair: 413 naming `pairs` (or `template`) before any forward."""
    import app.costs

    per_mac = []
    monkeypatch.setattr(app.costs, "estimated_seconds", lambda measures, adapter, settings, macs: per_mac.append(macs) or 1e7)
    r = client.post("/api/text/patching", json=SET)
    assert r.status_code == 413 and r.json()["detail"].startswith("pairs: a head scan of 2 pairs"), r.text
    one = client.post("/api/text/patching", json={**SET, "pairs": PAIRS[:1]})
    assert one.status_code == 413
    assert 1.5 * per_mac[1] < per_mac[0] < 2 * per_mac[1]  # the first pair and a shorter second against the first alone


def _peak_rss_during(call) -> tuple[object, float, int]:
    """(call's result, its seconds, the growth of this process's RSS over its start while it ran: sampled every 5 ms
    from /proc/self/status)."""
    import threading
    import time

    from app.memory import process_rss

    start_rss, peak, done = process_rss(), [0], threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], process_rss())
            time.sleep(0.005)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    started = time.perf_counter()
    try:
        result = call()
    finally:
        elapsed = time.perf_counter() - started
        done.set()
        watcher.join()
    return result, elapsed, max(0, max(peak[0], process_rss()) - start_rss)


def test_a_hostile_template_is_refused_at_once_without_being_built(client):
    """Issue 37 §1: the 175-byte template "The capital of {c:>1000000000} is" went through str.format before any
    limit was checked: a 422 after 3.1 s and +1.3 GB of RSS (four at once: the server was OOM-killed). Only plain
    {name} slots are filled now, by concatenation: a format spec is a 422 naming template.text, at once."""
    hostile = {**SET, "pairs": None, "template": {
        "text": "The capital of {c:>1000000000} is",
        "fillers": [{"clean": {"c": "France"}, "corrupt": {"c": "Italy"}}]}}
    plain_refusal = {**hostile, "template": {**hostile["template"], "text": "The capital of {c!r} is"}}
    assert client.post("/api/text/patching", json=plain_refusal).status_code == 422  # the route's first use, warm
    r, seconds, growth = _peak_rss_during(lambda: client.post("/api/text/patching", json=hostile))
    assert seconds < 0.5 and growth < 100 * 2**20, \
        f"the answer ({r.status_code}) took {seconds:.2f} s and RSS grew by {growth / 2**20:,.0f} MiB"
    assert r.status_code == 422 and _loc(r) == ["body", "template", "text"], r.text
    assert "format spec" in r.json()["detail"][0]["msg"]


@pytest.mark.parametrize("text, what", [
    ("the {c!r} sat", "conversion"), ("the {c.__class__} sat", "attribute or index"),
    ("the {c[0]} sat", "attribute or index"), ("the {} sat", "no name"), ("the {c:{c}} sat", "format spec"),
])
def test_only_plain_named_slots_are_filled(client, text, what):
    body = {**SET, "pairs": None, "template": {"text": text, "fillers": [{"clean": {"c": "cat"},
                                                                          "corrupt": {"c": "dog"}}]}}
    r = client.post("/api/text/patching", json=body)
    assert r.status_code == 422 and _loc(r) == ["body", "template", "text"], r.text
    assert what in r.json()["detail"][0]["msg"]


def test_a_template_keeps_literal_braces_and_is_filled_as_written(client):
    """{{ and }} stay literal braces; a value is inserted as it is (braces inside it are not read as slots)."""
    from app.pipeline.patching_set import expand_template
    from app.schemas import PatchingRequest

    req = PatchingRequest(model="tiny-llama", template={"text": "{{x}} {a} and {a}{b}", "fillers": [
        {"clean": {"a": "{b}", "b": "!"}, "corrupt": {"a": "%s", "b": "{0}"}}]})
    pairs = expand_template(req, 100)
    assert pairs[0]["clean"] == "{x} {b} and {b}!" and pairs[0]["corrupt"] == "{x} %s and %s{0}"


def test_the_limits_come_before_the_template_is_filled(client):
    """patching_max_pairs is checked on the fillers' count before any prompt is built, and a filled prompt's length
    is counted before it is built: 413 on the count, 422 naming the filler over max_text_chars."""
    many = {**SET, "pairs": None, "template": {"text": "the {c:>999999999} sat",
                                               "fillers": [{"clean": {"c": "cat"}, "corrupt": {"c": "dog"}}] * 5}}
    r = client.post("/api/text/patching", json=many)
    assert r.status_code == 413 and "template.fillers: 5 pairs" in r.json()["detail"], r.text
    limit = client.app.state.runtime.settings.max_text_chars
    long = {**SET, "pairs": None, "template": {"text": "the {c} sat {c}", "fillers": [
        {"clean": {"c": "cat"}, "corrupt": {"c": "d" * (limit // 2)}}]}}
    r = client.post("/api/text/patching", json=long)
    assert r.status_code == 422 and _loc(r) == ["body", "template", "fillers", 0, "corrupt"], r.text
    assert "max_text_chars" in r.json()["detail"][0]["msg"]
