"""Issue 53 §1: a drain hands its work over. Three replicas, Debian's redis-server and Debian's nginx from the shipped
deploy/nginx.conf (tests/ops/fleet.py). One client (an attnlab.Lab and a plain SSE client sharing its id, so nginx
puts both on one replica) has a long compare running and a second job queued behind it on one replica; that replica
gets a SIGTERM. Both jobs end `done` and neither client sends its job again (their POSTs are counted): the queued job
moves to a peer at once, the running one finishes or moves by its ETA against the drain's time left, each client
following its job by re-attaching (app/handover.py). After the replica has exited, its pinned run answers 410
saying it drained, not a bare 404. Every wait is on an event (a job seen on the board, a thread's end, the process's
exit), with limits long enough for a loaded machine."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from app.ids import run_owner
from attnlab import Lab
from tests.ops.fleet import build_long_llama, long_text, running_fleet

pytestmark = pytest.mark.slow  # three replicas, redis-server and nginx; one replica drained

# drain_s short against the long compare, so its ETA decides the move; result_pin_s keeps the first run pinned (the
# drain then lasts drain_s) so that it is still on the replica's list until the end
SETTINGS = {"default_models": ["lm"], "full_map_tokens": 64, "max_tokens": 4096, "max_text_chars": 40_000,
            "drain_s": 12.0, "shutdown_grace_s": 2.0, "job_reattach_grace_s": 60.0}
MASK = [{"op": "mask_keys", "tokens": [1, 2, 3], "layers": [0, 1], "heads": [0, 1]}]
CLIENT = "drain-client-0001"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    folder = build_long_llama(tmp_path_factory.mktemp("long-llama"))
    with running_fleet(tmp_path_factory.mktemp("fleet"), SETTINGS, folder) as started:
        yield started


def _events_of(response: httpx.Response, out: dict) -> dict | None:
    """Read a job's stream into out["events"] (ids in out["last_id"]): its done/error event, or None when the stream
    ended (or broke) without one."""
    buffer = b""
    try:
        for chunk in response.iter_raw():
            buffer += chunk
            while b"\n\n" in buffer:
                raw, buffer = buffer.split(b"\n\n", 1)
                lines = raw.split(b"\n")
                data = [line[5:] for line in lines if line.startswith(b"data:")]
                ids = [line[3:].strip().decode() for line in lines if line.startswith(b"id:")]
                if ids:
                    out["last_id"] = ids[0]
                if not data:
                    continue
                event = json.loads(data[0])
                out["events"].append(event)
                if event.get("accepted") and "job_id" not in out:
                    out["job_id"] = event["job_id"]
                if "done" in event or "error" in event:
                    return event
    except httpx.TransportError:  # cut: the replica went
        pass
    return None


def plain_sse_job(base: str, body: dict, out: dict) -> None:
    """A plain SSE client: POST the job once, then on a cut re-attach to the URL of the job it was first given
    (GET /api/jobs/<first job id>/events) with the last event id it saw, as EventSource does with its URL."""
    out.update(posts=0, reattaches=0, events=[], statuses=[])
    headers = {"X-Attnlab-Client": CLIENT, "Accept": "text/event-stream"}
    timeout = httpx.Timeout(300, connect=10)
    with httpx.stream("POST", base + "/api/text/attention", headers=headers, json=body, timeout=timeout) as r:
        out["posts"] += 1
        out["statuses"].append(r.status_code)
        end = _events_of(r, out) if r.status_code == 200 else None
    while end is None and out["reattaches"] < 5 and "job_id" in out:
        out["reattaches"] += 1
        with httpx.stream("GET", f"{base}/api/jobs/{out['job_id']}/events", timeout=timeout,
                          headers={**headers, "Last-Event-ID": out["last_id"]}) as r:
            out["statuses"].append(r.status_code)
            if r.status_code != 200:
                r.read()
                out["refused"] = r.text
                break
            end = _events_of(r, out)
    out["last"] = end


class CountingLab(Lab):
    """attnlab.Lab that counts the POSTs it sends (a job sent again would be a second one)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.posts: list[str] = []

    def _open(self, method, path, *args, **kwargs):
        if method == "POST":
            self.posts.append(path)
        return super()._open(method, path, *args, **kwargs)


def _board(replica) -> list[dict]:
    try:
        return replica.jobs()
    except httpx.TransportError:
        return []


def _wait_for(what: str, check, limit_s: float = 300) -> None:
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        if check():
            return
        time.sleep(0.1)
    raise AssertionError(f"{what}: not seen in {limit_s:g} s")


def test_sigterm_hands_a_running_and_a_queued_job_over_and_no_client_resends(fleet):
    # The client's first run: it names the replica nginx puts this client on (the one to drain), and stays pinned.
    first = httpx.post(fleet.nginx.base + "/api/text/attention", timeout=300,
                       headers={"X-Attnlab-Client": CLIENT},
                       json={"model": "lm", "text": long_text(120, shift=3), "layers": [0], "heads": [0]})
    assert first.status_code == 200, first.text
    pinned_run = first.json()["run_id"]
    target = fleet.by_name(run_owner(pinned_run))

    # A long compare through attnlab.Lab (its POSTs counted), then a queued job behind it (the same client: it
    # waits for the client's running job) through a plain SSE client.
    lab = CountingLab(fleet.nginx.base, progress=False, timeout=300)
    lab.client_id = CLIENT
    running: dict = {}

    def call() -> None:
        try:
            running["result"] = lab.attention(long_text(3000, shift=11), "lm", layers=[0], heads=[0], compare=True,
                                              interventions=MASK)
        except Exception as exc:  # noqa: BLE001 - said below
            running["error"] = exc

    lab_thread = threading.Thread(target=call)
    lab_thread.start()
    _wait_for("the compare running on " + target.name,
              lambda: any(j["state"] == "running" for j in _board(target)))
    queued: dict = {}
    plain_thread = threading.Thread(target=plain_sse_job, args=(
        fleet.nginx.base, {"model": "lm", "text": long_text(400, shift=17), "layers": [0], "heads": [0]}, queued))
    plain_thread.start()
    _wait_for("the second job queued on " + target.name,
              lambda: [j["state"] for j in _board(target)].count("queued") == 1)

    signalled = time.monotonic()
    target.proc.send_signal(15)  # SIGTERM: the drain
    lab_thread.join(timeout=600)
    plain_thread.join(timeout=600)
    assert not lab_thread.is_alive() and not plain_thread.is_alive()
    assert target.proc.wait(timeout=120) == 0
    stopped_after = time.monotonic() - signalled

    # Both jobs ended done; each client sent its job once.
    assert "error" not in running, running.get("error")
    assert queued.get("last", {}).get("done") is True, (queued.get("last"), queued.get("statuses"),
                                                        queued.get("refused"), queued["events"][-3:])
    assert lab.posts == ["/api/text/attention"], lab.posts
    assert queued["posts"] == 1, queued
    # The queued job moved at once: its stream said so and named its new job, whose answer came from a peer.
    moves = [e["handed_over"] for e in queued["events"] if "handed_over" in e]
    drain_log = [line for line in target.log_path.read_text().splitlines()
                 if "drain" in line or "Traceback" in line or "Error" in line]
    assert len(moves) == 1, (moves, queued["events"][:3], drain_log[-30:])
    assert len(moves) == 1 and moves[0]["from"] == target.name and moves[0]["to"] != target.name, moves
    assert run_owner(queued["last"]["run_id"]) == moves[0]["to"]
    after_move = queued["events"][queued["events"].index({"handed_over": moves[0]}) + 1]
    assert after_move.get("accepted") is True and after_move["job_id"] == moves[0]["job_id"], after_move
    # The running job finished on its replica within the drain, or moved and ran again on a peer.
    compare_owner = run_owner(running["result"].response["run_id"])
    how = "finished in the drain" if compare_owner == target.name else f"moved to {compare_owner} and ran again"

    # After the exit its pinned run says where it went: the replica drained (410), not a bare "gone".
    gone = httpx.post(f"{fleet.nginx.base}/api/runs/{pinned_run}/window", timeout=60,
                      headers={"X-Attnlab-Client": "drain-after"},
                      json={"layer": 0, "head": 0, "rows": [0, 16], "cols": [0, 16]})
    assert gone.status_code == 410 and "drained" in gone.json()["detail"], gone.text
    print(f"\nSIGTERM of {target.name}: the queued job moved to {moves[0]['to']} and ended done; the running compare "
          f"{how}; POSTs: Lab 1, plain 1 (re-attaches: plain {queued['reattaches']}); exited 0 after "
          f"{stopped_after:.1f} s; its run then answered 410")
