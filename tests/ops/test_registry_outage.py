"""Routing that survives Redis (issue 53 §2, the registry's part; app/fleet.py Registry): each replica keeps the last
URL Redis gave for every owner (asked, or read with the whole registry at each heartbeat) and asks the owner there
when Redis does not answer, or answers nothing because it restarted empty before the owner's next heartbeat, instead
of answering "its replica is gone" at once. Before: with Redis down, live runs answered 404 "gone" (10–13 of 18
windows), and still at +1 s after Redis returned. On Debian's redis-server, stopped and started again (empty: no
persistence, as in deploy/). A forwarded request that reaches a process which is not the owner (its address reused
after a restart) is still answered "gone", by that process."""
from __future__ import annotations

import types

import pytest

import app.fleet as fleet_module
from app.fleet import Registry
from tests.faults.conftest import free_port
from tests.ops.fleet import require_tools
from tests.ops.test_replicas import Redis


@pytest.fixture
def redis_server(tmp_path):
    require_tools()
    server = Redis(free_port(), tmp_path / "redis.log")
    server.start()
    try:
        yield server
    finally:
        server.stop()


def test_an_owner_is_asked_at_its_last_known_url_through_a_redis_outage_and_restart(redis_server, monkeypatch):
    monkeypatch.setattr(fleet_module, "URL_CACHE_S", 0.0)  # every look-up asks Redis (no 2 s memo in the way)
    settings = types.SimpleNamespace(redis_url=f"redis://127.0.0.1:{redis_server.port}/0", redis_timeout_s=0.5,
                                     replica_ttl_s=15.0)
    owner = Registry(settings, "http://127.0.0.1:7001")
    owner.name = "ownerrep1"
    assert owner.register()
    asker = Registry(settings, "http://127.0.0.1:7002")
    asker.name = "askerrep2"
    asker.beat()  # its heartbeat: registered, and the whole registry read (it never asked for the owner itself)
    assert asker.replicas() == {"ownerrep1": "http://127.0.0.1:7001", "askerrep2": "http://127.0.0.1:7002"}

    redis_server.stop()  # an outage
    assert asker.url_of("ownerrep1") == "http://127.0.0.1:7001"  # asked there, not presumed gone
    assert asker.url_of("neverseen") is None  # nothing known: gone, as before

    redis_server.start()  # back, empty (no persistence): no entry until the owner's next heartbeat
    assert asker.replicas().get("ownerrep1") is None
    assert asker.url_of("ownerrep1") == "http://127.0.0.1:7001"
    owner.url = "http://127.0.0.1:7003"  # the owner registers again, at another address: Redis's answer wins
    assert owner.register()
    assert asker.url_of("ownerrep1") == "http://127.0.0.1:7003"


def test_a_forwarded_request_for_another_replicas_run_is_gone_not_unknown(tmp_path_factory):
    """The last known URL may serve another process now (a replica restarted on the same address, with a new name):
    it answers that the owner is gone, not that the run is unknown."""
    from app.ids import replica_name
    from tests.api.helpers import tiny_lm_client
    from tests.tiny_models import build_text_model

    folder = build_text_model("llama", tmp_path_factory.mktemp("outage-llama"))
    with tiny_lm_client(folder) as client:
        client.app.state.runtime.warm_up()  # not racing the background warm-up (a thread left in torch at exit)
        box = {"layer": 0, "head": 0, "rows": [0, 4], "cols": [0, 4]}
        other = "zzzz9999." + "ab" * 16
        answer = client.post(f"/api/runs/{other}/window", json=box, headers={"X-Attnlab-Forwarded": "peer1"})
        assert answer.status_code == 404
        assert f"its replica (zzzz9999) is gone (its address now serves replica {replica_name()})" in \
            answer.json()["detail"]
        mine = client.post(f"/api/runs/{replica_name()}.{'0' * 32}/window", json=box,
                           headers={"X-Attnlab-Forwarded": "peer1"})
        assert mine.status_code == 404 and "is gone" not in mine.json()["detail"]  # its own: the run store answers
