"""One process's side of the fleet (issue 36 §2, §4; app/fleet.py, app/metrics.py): a run id names its replica, a
run of a replica that is not registered is a 404 that says its replica is gone (not "unknown"), in the path or in a
body's `minus`; GET /metrics in Prometheus text: the queue, kept run bytes, requests by status. The three-replica
fleet behind nginx is tests/ops/test_fleet.py."""
from __future__ import annotations

import re

import pytest

from app.ids import replica_name, run_owner
from tests.api.helpers import TINY_ATLAS, TINY_TEXT, tiny_lm_client
from tests.tiny_models import build_text_model

BOX = {"layer": 0, "head": 0, "rows": [0, 4], "cols": [0, 4]}
ELSEWHERE = "zzzz9999." + "ab" * 16  # shaped as a run id of a replica that never registered


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    folder = build_text_model("llama", tmp_path_factory.mktemp("fleet-llama"))
    with tiny_lm_client(folder, **TINY_ATLAS) as c:
        c.app.state.runtime.warm_up()
        yield c


def test_a_run_id_names_this_replica_and_a_gone_one_says_so(client):
    made = client.post("/api/text/attention", json={"model": "lm", "text": TINY_TEXT})
    assert made.status_code == 200, made.text
    run_id = made.json()["run_id"]
    assert run_owner(run_id) == replica_name()
    assert client.post(f"/api/runs/{run_id}/window", json=BOX).status_code == 200

    gone = client.post(f"/api/runs/{ELSEWHERE}/window", json=BOX)
    assert gone.status_code == 404 and "its replica (zzzz9999) is gone" in gone.json()["detail"]
    gone_row = client.post(f"/api/runs/{ELSEWHERE}/row", json={"row": 0})
    assert gone_row.status_code == 404 and "is gone" in gone_row.json()["detail"]
    # `minus` naming another replica's run: the request goes to that owner, which is gone.
    minus = client.post(f"/api/runs/{run_id}/window", json={**BOX, "minus": ELSEWHERE})
    assert minus.status_code == 404 and "its replica (zzzz9999) is gone" in minus.json()["detail"]
    # A run id of this replica that was never made is not "gone": the run store answers it.
    mine = client.post(f"/api/runs/{replica_name()}.{'0' * 32}/window", json=BOX)
    assert mine.status_code == 404 and "is gone" not in mine.json()["detail"]


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
    assert match, f"{name} missing from:\n{text}"
    return float(match.group(1))


def test_metrics_in_prometheus_text(client):
    client.post(f"/api/runs/{ELSEWHERE}/window", json=BOX)  # one more 404
    made = client.post("/api/text/attention", json={"model": "lm", "text": TINY_TEXT + " again"})
    assert made.status_code == 200
    answer = client.get("/metrics")
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/plain; version=0.0.4")
    text = answer.text
    for name in ("attnlab_jobs_running", "attnlab_jobs_waiting", "attnlab_queue_eta_seconds"):
        assert _metric(text, name) == 0  # nothing queued now
        assert f"# TYPE {name} gauge" in text
    assert _metric(text, 'attnlab_kept_run_bytes{tier="ram"}') > 0  # the runs just made are kept
    assert _metric(text, "attnlab_ready") == 1 and _metric(text, "attnlab_draining") == 0
    assert _metric(text, 'attnlab_requests_total{status="404"}') >= 1
    assert _metric(text, 'attnlab_requests_total{status="200"}') >= 1
    assert f'attnlab_replica_info{{replica="{replica_name()}"}} 1' in text
