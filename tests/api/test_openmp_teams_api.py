"""The served side of one OpenMP team at a time (app/openmp_teams.py): every API POST counts as a model request in
flight while its handler works (app/lifecycle.ParsedJsonRoute), and a plain answer's thread (app/streams.answered:
text, image, speech and analysis answers, windows and rows) releases its OpenMP team when another one is in flight.
The mechanism itself, by the process's threads, is in tests/unit/test_openmp_teams.py."""
from __future__ import annotations

import re

import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from app.openmp_teams import MODEL_REQUESTS, TeamStats
from tests.api.helpers import make_settings

BODY = {"model": "tiny", "text": "the cat sat on the mat", "layers": [0], "heads": [1]}


@pytest.fixture
def served(tiny_bert, request):
    with TestClient(create_app(make_settings(tiny_bert, **getattr(request, "param", {})))) as client:
        client.app.state.runtime.warm_up()
        yield client
    TeamStats.enabled = True  # process-wide (each app's start sets it): back to the default for later apps


def releases(client) -> int:
    metrics = client.get("/metrics").text
    return int(re.search(r"^attnlab_openmp_team_releases_total (\d+)$", metrics, re.M).group(1))


@pytest.fixture
def another_in_flight():
    """Another model request in flight, as the route class counts one."""
    MODEL_REQUESTS.entered()
    yield
    MODEL_REQUESTS.left()


def test_a_request_alone_keeps_its_team(served):
    before, in_flight = releases(served), MODEL_REQUESTS.in_flight
    for _ in range(3):
        assert served.post("/api/text/attention", json=BODY).status_code == 200
    assert releases(served) == before
    assert MODEL_REQUESTS.in_flight == in_flight  # counted while its handler worked, and no longer


def test_answers_release_their_team_while_another_request_is_in_flight(served, another_in_flight):
    before = releases(served)
    view = served.post("/api/text/attention", json=BODY)
    assert view.status_code == 200
    assert releases(served) == before + 1
    window = served.post(f"/api/runs/{view.json()['run_id']}/window",
                         json={"layer": 0, "head": 1, "rows": [0, 4], "cols": [0, 4]})
    assert window.status_code == 200, window.text
    assert releases(served) == before + 2


def test_a_refused_request_is_no_longer_counted(served):
    in_flight = MODEL_REQUESTS.in_flight
    assert served.post("/api/text/attention", json={**BODY, "layers": [99]}).status_code == 422
    assert MODEL_REQUESTS.in_flight == in_flight


@pytest.mark.parametrize("served", [{"openmp_one_team": False}], indirect=True)
def test_the_setting_turns_it_off(served, another_in_flight):
    before = releases(served)
    assert served.post("/api/text/attention", json=BODY).status_code == 200
    assert releases(served) == before
