"""Re-attaching to a job (issue 36 §3; docs/api.md "Re-attaching to a job"): every event of a job carries an id
`<job_id>:<n>`; GET /api/jobs/{job_id}/events replays the events after Last-Event-ID (or `?after=`) and follows the
live job to its end; a job whose stream dropped runs on for job_reattach_grace_s. 404s say which case it is, and
another client's job is a 404 too. The cut mid-way runs on the real server (uvicorn) behind a small TCP relay that
cuts the job's first stream and counts the POSTs that reached the server: the job is sent once."""
from __future__ import annotations

import json
import socket
import threading

import httpx
import pytest

from app.ids import replica_name
from tests.api.helpers import TINY_TEXT, tiny_lm_client
from tests.faults.conftest import LONG_TEXT, Server, build_big_bert
from tests.tiny_models import build_text_model

STREAM = {"Accept": "text/event-stream"}
ME = {"X-Attnlab-Client": "reattach-client-1", **STREAM}


def numbered(text: str) -> list[tuple[str, dict]]:
    """(id, payload) of every event of a server-sent-events body, in order."""
    events = []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        lines = block.split("\n")
        ids = [line[3:].strip() for line in lines if line.startswith("id:")]
        data = [line[5:].strip() for line in lines if line.startswith("data:")]
        if data:
            events.append((ids[0] if ids else None, json.loads("\n".join(data))))
    return events


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    folder = build_text_model("llama", tmp_path_factory.mktemp("reattach-llama"))
    with tiny_lm_client(folder) as c:
        c.app.state.runtime.warm_up()
        yield c


def _job(client, text: str = TINY_TEXT) -> list[tuple[str, dict]]:
    answer = client.post("/api/text/attention", json={"model": "lm", "text": text, "layers": [0], "heads": [0]},
                         headers=ME)
    assert answer.status_code == 200, answer.text
    return numbered(answer.text)


def test_every_event_of_a_job_has_an_id_and_replays_after_done(client):
    events = _job(client, TINY_TEXT + " numbered")
    job_id = events[0][1]["job_id"]
    assert job_id.startswith(replica_name() + ".")  # a job id names its replica, as a run id does
    assert [event_id for event_id, _ in events] == [f"{job_id}:{n}" for n in range(1, len(events) + 1)]
    assert events[-1][1]["done"] is True and len(events) >= 3  # accepted, progress, done

    # after done, Last-Event-ID replays what came after it: the same events, byte for byte the same payloads
    again = client.get(f"/api/jobs/{job_id}/events", headers={**ME, "Last-Event-ID": events[1][0]})
    assert again.status_code == 200 and again.headers["content-type"].startswith("text/event-stream")
    assert numbered(again.text) == events[2:]
    # ?after= for clients that cannot set the header; nothing named: from the first event
    assert numbered(client.get(f"/api/jobs/{job_id}/events?after=1", headers=ME).text) == events[1:]
    assert numbered(client.get(f"/api/jobs/{job_id}/events", headers=ME).text) == events
    # after the last event: nothing more, the stream ends at once
    assert numbered(client.get(f"/api/jobs/{job_id}/events?after={events[-1][0]}", headers=ME).text) == []


def test_a_job_of_another_client_unknown_expired_or_gone_is_a_404_that_says_which(client):
    events = _job(client, TINY_TEXT + " whose")
    job_id = events[0][1]["job_id"]
    other = client.get(f"/api/jobs/{job_id}/events", headers={**STREAM, "X-Attnlab-Client": "someone-else-2"})
    assert other.status_code == 404 and "is unknown" in other.json()["detail"]  # nothing said of another's job
    assert client.delete(f"/api/jobs/{job_id}", headers={"X-Attnlab-Client": "someone-else-2"}).status_code == 404

    unknown = client.get(f"/api/jobs/{replica_name()}.{'0' * 32}/events", headers=ME)
    assert unknown.status_code == 404 and "is unknown" in unknown.json()["detail"]
    gone = client.get(f"/api/jobs/zzzz9999.{'ab' * 16}/events", headers=ME)  # a replica that never registered
    assert gone.status_code == 404 and "its replica (zzzz9999) is gone" in gone.json()["detail"]
    assert "send the job again" in gone.json()["detail"]

    bad = client.get(f"/api/jobs/{job_id}/events", headers={**ME, "Last-Event-ID": "another.job:3"})
    assert bad.status_code == 422 and "Last-Event-ID" in json.dumps(bad.json()["detail"])

    # expired: its events are kept result_pin_s after it ended (pruned on the next look-up)
    found, _ = client.app.state.process.job_logs.find(job_id)
    found.ended_at -= found.keep_s + 1
    expired = client.get(f"/api/jobs/{job_id}/events", headers=ME)
    assert expired.status_code == 404 and "expired" in expired.json()["detail"]
    assert "result_pin_s=120" in expired.json()["detail"]


class CuttingRelay:
    """A TCP relay in front of the server: counts the jobs sent through it (streamed POSTs), and cuts the first streamed answer once it
    has passed `cut_after` (both sockets closed: what a dropped network or a proxy's cut does)."""

    def __init__(self, port: int, cut_after: bytes):
        self.target, self.cut_after = port, cut_after
        self.posts: list[bytes] = []
        self.cut = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                near, _ = self.listener.accept()
            except OSError:
                return
            far = socket.create_connection(("127.0.0.1", self.target))
            threading.Thread(target=self._up, args=(near, far), daemon=True).start()
            threading.Thread(target=self._down, args=(far, near), daemon=True).start()

    def _up(self, near: socket.socket, far: socket.socket) -> None:
        while (chunk := _recv(near)):
            if chunk.startswith(b"POST ") and b"text/event-stream" in chunk:  # a job sent
                self.posts.append(chunk.split(b"\r\n", 1)[0])
            try:
                far.sendall(chunk)
            except OSError:
                break
        far.close()

    def _down(self, far: socket.socket, near: socket.socket) -> None:
        seen = b""
        while (chunk := _recv(far)):
            seen += chunk
            if not self.cut.is_set() and b"text/event-stream" in seen and self.cut_after in seen:
                self.cut.set()
                end = chunk.find(b"\n\n", chunk.find(self.cut_after))  # the rest of that event, then nothing
                near.sendall(chunk[:end + 2] if self.cut_after in chunk and end >= 0 else chunk)
                break
            near.sendall(chunk)
        for s in (near, far):  # shutdown first: a close alone waits for the other thread's recv on it
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def close(self) -> None:
        self.listener.close()


def _recv(s: socket.socket) -> bytes:
    try:
        return s.recv(65536)
    except OSError:
        return b""


def serve_big_bert(tmp_path_factory, name: str):
    """A real server on the 12-layer random BERT (a module fixture's body: yields it ready, stops it after)."""
    big = build_big_bert(tmp_path_factory.mktemp(f"{name}-big"))
    started = Server(tmp_path_factory.mktemp(f"{name}-server"),
                     {"default_models": ["big"], "extra_text_models": {"big": str(big)}, "full_map_tokens": 64})
    try:
        started.wait_ready()
        yield started
    finally:
        started.stop()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from serve_big_bert(tmp_path_factory, "reattach")


LONG_COMPARE = {"model": "big", "text": LONG_TEXT, "layers": [0], "heads": [0], "compare": True,
                "interventions": [{"op": "mask_keys", "tokens": [1, 2]}]}


def test_a_cut_stream_re_attaches_and_the_job_runs_once(server):
    relay = CuttingRelay(server.port, cut_after=b'"progress":3,')
    try:
        base = f"http://127.0.0.1:{relay.port}"
        with httpx.Client(timeout=120) as http:
            first = []
            with http.stream("POST", base + "/api/text/attention", json=LONG_COMPARE, headers=ME) as answer:
                assert answer.status_code == 200
                text = ""
                try:
                    for piece in answer.iter_text():
                        text += piece
                except httpx.HTTPError:  # the cut: the body ended without its last chunk
                    pass
                first = numbered(text)
            assert relay.cut.is_set() and first, "the relay never cut the stream"
            assert "done" not in first[-1][1] and first[-1][1]["progress"] == 3
            last_id = first[-1][0]
            job_id = first[0][1]["job_id"]
            rest = http.get(f"{base}/api/jobs/{job_id}/events", headers={**ME, "Last-Event-ID": last_id})
            assert rest.status_code == 200, rest.text
            later = numbered(rest.text)
    finally:
        relay.close()
    events = first + later
    # no duplicates, none missing: the ids run 1..N once each, and the bar moves on from where it was cut
    assert [event_id for event_id, _ in events] == [f"{job_id}:{n}" for n in range(1, len(events) + 1)]
    progress = [payload["progress"] for _, payload in events if "progress" in payload]
    assert progress == list(range(1, progress[-1] + 1)) and progress[-1] == events[0][1]["total"]
    done = events[-1][1]
    assert done["done"] is True and done["run_id"] and done["base_run_id"]
    assert len(relay.posts) == 1, relay.posts  # the job was sent once: the model ran it once
    # the run it made answers: the same job's done event, replayed after the end, names the same run
    replay = httpx.get(f"{server.base}/api/jobs/{job_id}/events?after={len(events) - 1}", headers=ME, timeout=30)
    assert numbered(replay.text)[-1][1]["run_id"] == done["run_id"]


def test_delete_cancels_a_running_job_at_its_next_layer(server):
    """The page's Cancel: the job stops at once, whatever streams listen (leaving alone would give it
    job_reattach_grace_s to be re-attached). Its listening stream ends with an error event that says so."""
    body = {**LONG_COMPARE, "interventions": [{"op": "mask_keys", "tokens": [3, 4]}]}  # not cached
    events, text = [], ""
    with httpx.Client(timeout=120) as http:
        with http.stream("POST", server.base + "/api/text/attention", json=body, headers=ME) as answer:
            assert answer.status_code == 200
            for line in answer.iter_lines():
                text += line + "\n"
                if line.startswith("data:") and '"progress":1,' in line:
                    job_id = numbered(text)[0][1]["job_id"]
                    cancelled = http.delete(f"{server.base}/api/jobs/{job_id}", headers=ME)
                    assert cancelled.status_code == 200 and cancelled.json()["cancelled"] is True
            events = numbered(text)
    last = events[-1][1]
    assert last.get("cancelled") is True and "cancelled" in last["error"], last
    progress = [payload["progress"] for _, payload in events if "progress" in payload]
    assert progress[-1] < events[0][1]["total"] // 2, progress  # stopped well before its end (24 layers)


def test_the_notebook_client_resumes_a_cut_stream_without_sending_the_job_again(server):
    """attnlab.Lab through the relay: its job's stream is cut mid-way; it re-attaches with the last event id, the
    answer is the job's (its run answers windows), and the job reached the server once."""
    from attnlab import Lab

    relay = CuttingRelay(server.port, cut_after=b'"progress":2,')
    try:
        lab = Lab(f"http://127.0.0.1:{relay.port}", progress=False, timeout=120)
        body = {**LONG_COMPARE, "interventions": [{"op": "mask_keys", "tokens": [5]}]}  # not cached
        result = lab.attention(body["text"], "big", layers=[0], heads=[0], compare=True,
                               interventions=body["interventions"])
        assert relay.cut.is_set(), "the relay never cut the stream"
        assert relay.posts == [b"POST /api/text/attention HTTP/1.1"], relay.posts  # sent once, re-attached after
        window = lab.window(result.run_id, 0, 0, rows=[0, 4], cols=[0, 4])
        assert window.attention.shape == (4, 4)
    finally:
        relay.close()


def test_a_re_attach_past_the_kept_events_is_told_of_the_gap(tmp_path):
    """job_event_buffer=8: a client that re-attaches after more events than that gets `event: gap` first (the numbers
    missed, the first kept id; no id of its own), then the kept events in order, ending with the done event. A
    continuation's events are its tokens: those in the gap are not sent again (the done event has the whole text)."""
    folder = build_text_model("llama", tmp_path / "gap-llama")
    with tiny_lm_client(folder, job_event_buffer=8) as c:
        answer = c.post("/api/text/generate", headers=ME, json={"model": "lm", "text": TINY_TEXT, "max_new_tokens": 16})
        events = numbered(answer.text)
        assert len(events) > 12, len(events)  # accepted, an event per token, done
        job_id = events[0][1]["job_id"]
        replay = c.get(f"/api/jobs/{job_id}/events?after=1", headers=ME)
    assert replay.text.startswith("event: gap\ndata: ")
    (gap_id, gap), *kept = numbered(replay.text)
    first = len(events) - 7  # the latest 8 kept, the done event among them
    assert gap_id is None and gap == {"gap": {"after": 1, "first": first, "missed": first - 2,
                                              "first_id": f"{job_id}:{first}", "why": "job_event_buffer"}}
    assert kept == events[first - 1:] and kept[-1][1]["done"] is True
