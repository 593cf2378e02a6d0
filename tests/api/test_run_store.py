"""The run store through the API (issue 36 §1, docs/api.md "Runs"): the page's order (a long first view, then a
compare masking early keys) keeps both runs and computes the base once, with the RAM tier too small for both; runs
that left RAM answer windows from disk, exactly; a 404 says unknown or expired; a run larger than the disk tier is
refused before it runs. A tiny Llama with a small full_map_tokens, so that a sentence is "long" (the real
smollm2-135m at default settings: tests/integration/test_page_order.py)."""
from __future__ import annotations

import numpy as np
import pytest

from tests.api.helpers import TINY_ATLAS, job_events, tiny_lm_client
from tests.api.helpers import TINY_TEXT as TEXT
from tests.float32 import assert_close_f32, attention_terms
from tests.tiny_models import build_text_model

STREAM = {"Accept": "text/event-stream", "X-Attnlab-Client": "page"}
MASK = [{"op": "mask_keys", "tokens": [1, 2, 3]}]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return str(build_text_model("llama", tmp_path_factory.mktemp("llama")))


def _page_request(interventions: list) -> dict:
    """What the text page sends (static/js/text.js request()): a compare when there are interventions."""
    compare = bool(interventions)
    return {"model": "lm", "text": TEXT, "layers": [0], "heads": [0], "include_scores": True,
            "interventions": interventions, "compare": compare, "include_base": compare, "samples": 1,
            "thumbnail_size": 24, "encoding": "f32"}


def _streamed(client, body: dict) -> tuple[dict, list[dict], dict]:
    response = client.post("/api/text/attention", json=body, headers=STREAM)
    assert response.status_code == 200, response.text
    accepted, *events = job_events(response)
    assert events[-1].get("done") is True, events[-1]
    return accepted, events[:-1], events[-1]


def _window(client, run_id: str, **extra) -> np.ndarray:
    response = client.post(f"/api/runs/{run_id}/window", json={"layer": 1, "head": 2, "rows": [4, 20], "cols": [0, 20],
                                                               **extra})
    assert response.status_code == 200, response.text
    return np.array(response.json()["attention"])


def test_the_pages_order_keeps_both_runs_and_computes_the_base_once(llama):
    """The RAM tier holds one run and pins are over at once (the first view was made longer than result_pin_s ago):
    the compare was accepted with runs: 1, then the base was evicted by the intervened run, computed again (the
    progress total jumped from L to 2L) and evicted the intervened run, whose windows answered 404 right after done.
    Now the job holds its runs and runs leaving RAM go to disk: one pass, and windows of both runs answer."""
    with tiny_lm_client(llama, **TINY_ATLAS, result_cache_items=1, result_pin_s=0) as client, \
            tiny_lm_client(llama) as short:
        n_layers = client.app.state.runtime.adapter("lm").info.layers
        _, _, first = _streamed(client, _page_request([]))
        accepted, progress, compare = _streamed(client, _page_request(MASK))
        assert accepted["runs"] == 1
        assert {e["total"] for e in progress if "total" in e} == {n_layers}  # the base was not computed again
        assert compare["base_run_id"] == first["run_id"]
        # both runs answer windows, exactly: the intervened one equals the full P of the same intervention
        masked = short.post("/api/text/attention", json={"model": "lm", "text": TEXT, "interventions": MASK})
        full = np.array(masked.json()["attention"])  # (L, H, T, T)
        # windows rebuilt from q̂, k̂ against the full maps: q·k over the head size, softmax over the keys
        terms = attention_terms(client.app.state.runtime.adapter("lm").model.config, full.shape[-1])
        assert_close_f32(_window(client, compare["run_id"]), full[1, 2, 4:20, 0:20], terms, scale=1.0)
        plain = np.array(short.post("/api/text/attention", json={"model": "lm", "text": TEXT}).json()["attention"])
        assert_close_f32(_window(client, compare["base_run_id"]), plain[1, 2, 4:20, 0:20], terms, scale=1.0)
        diff = _window(client, compare["run_id"], minus=compare["base_run_id"])
        # a difference of two such probabilities: their roundings add (twice the terms)
        assert_close_f32(diff, (full - plain)[1, 2, 4:20, 0:20], 2 * terms, scale=1.0)
        assert client.app.state.runtime.cache.flush(timeout=60)  # files are written by the store's writer thread
        stats = client.app.state.runtime.cache.stats()
        assert stats["ram_runs"] == 1 and stats["disk_runs"] == 1  # one of them answered from disk


def test_runs_on_disk_answer_windows_and_rows_exactly(llama):
    """A RAM tier too small for any run: every run lives on disk, memory-mapped; windows, rows, view-mode β and
    minus equal those of a server that keeps everything in RAM."""
    with tiny_lm_client(llama, **TINY_ATLAS, result_cache_bytes=1) as disk, tiny_lm_client(llama, **TINY_ATLAS) as ram:
        runs = {}
        for name, client in (("disk", disk), ("ram", ram)):
            body = {"model": "lm", "text": TEXT, "interventions": MASK, "compare": True, "include_base": True}
            runs[name] = client.post("/api/text/attention", json=body).json()
        store = disk.app.state.runtime.cache
        assert store.flush(timeout=60)
        assert store.host_bytes == 0 and store.stats()["disk_runs"] == 2
        for extra in ({}, {"beta": 0.5}, {"include_scores": True}, {"weighting": "value_norm"}):
            windows = []
            for name, client in (("disk", disk), ("ram", ram)):
                response = client.post(f"/api/runs/{runs[name]['run_id']}/window", json={
                    "layer": 0, "head": 1, "rows": [0, 20], "cols": [0, 20], "minus": runs[name]["base_run_id"], **extra})
                assert response.status_code == 200, response.text
                windows.append(response.json())
            assert windows[0]["attention"] == windows[1]["attention"] and windows[0]["scores"] == windows[1]["scores"]
            assert windows[0]["row_entropy"] == windows[1]["row_entropy"], extra
        rows = [client.post(f"/api/runs/{runs[name]['run_id']}/row", json={"row": 10, "span": [1, 4]}).json()
                for name, client in (("disk", disk), ("ram", ram))]
        assert rows[0]["attention"] == rows[1]["attention"] and rows[0]["span_mass"] == rows[1]["span_mass"]


def test_a_404_says_unknown_or_expired(llama):
    """Issue 38 item 5: a run this process never held is not 'evicted from the cache'."""
    body = {"layer": 0, "head": 0, "rows": [0, 2], "cols": [0, 2]}
    with tiny_lm_client(llama, **TINY_ATLAS, result_cache_items=1, result_pin_s=0, run_store_disk_bytes=0) as client:
        first = client.post("/api/text/attention", json={"model": "lm", "text": TEXT}).json()["run_id"]
        client.post("/api/text/attention", json={"model": "lm", "text": TEXT + " it was"})
        expired = client.post(f"/api/runs/{first}/window", json=body)
        assert expired.status_code == 404 and "expired" in expired.json()["detail"]
        never = first[:-4] + ("0000" if not first.endswith("0000") else "1111")  # this replica's shape, never made
        unknown = client.post(f"/api/runs/{never}/window", json=body)
        assert unknown.status_code == 404 and "unknown" in unknown.json()["detail"]
        for response in (expired, unknown):
            assert "evicted" not in response.json()["detail"]


def test_a_run_larger_than_the_disk_tier_is_refused_before_it_runs(llama):
    with tiny_lm_client(llama, **TINY_ATLAS, run_store_disk_bytes=1024) as client:
        response = client.post("/api/text/attention", json={"model": "lm", "text": TEXT})
        assert response.status_code == 413 and "run_store_disk_bytes" in response.json()["detail"]
        assert client.post("/api/text/attention", json={"model": "lm", "text": "the cat"}).status_code == 200


def test_a_plain_view_is_answered_before_older_runs_leave_ram(llama, monkeypatch):
    """Making room in the RAM tier (an older run's file encoded and queued for the writer) waits until the response is
    sent: it ran when no handler was at work any more, and the RAM tier is within its bounds once the client has the
    answer (TestClient returns after the response's background work)."""
    from app.in_flight import MODEL_REQUESTS

    with tiny_lm_client(llama, result_cache_items=1, result_pin_s=0) as client:
        cache = client.app.state.runtime.cache
        handlers_at_work: list[int] = []
        real_make_room = cache.make_room

        def make_room(keep=None):
            handlers_at_work.append(MODEL_REQUESTS.in_flight)
            real_make_room(keep=keep)

        monkeypatch.setattr(cache, "make_room", make_room)
        for text in (TEXT, TEXT + " and again", TEXT + " once more"):
            response = client.post("/api/text/attention", json={"model": "lm", "text": text, "layers": [0],
                                                                "heads": [0]})
            assert response.status_code == 200, response.text
            stats = cache.stats()
            assert stats["ram_runs"] - stats["writing_runs"] <= 1, stats
        assert len(handlers_at_work) == 3 and set(handlers_at_work) == {0}, handlers_at_work
