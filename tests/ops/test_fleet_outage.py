"""Issue 53 on the real fleet (tests/ops/fleet.py: three replicas, Debian's redis-server and Debian's nginx from the
shipped deploy/nginx.conf), measured from outside through nginx as a user would meet it. It replaces
benchmarks/fleet_sim.py, a simulation that imported no app code.

- §2, routing without Redis: with redis-server stopped, 20 of 20 windows of a live run answer 200 whichever replica
  they land on (each replica asks the owner at its last known URL), and again right after Redis is back, empty.
  Before: 10–13 of 18 answered 404 "gone … run the input again".
- §6, identities that cost nothing to mint: 40 client ids from one address (forwarded by nginx, a trusted proxy) get
  that address's cap over the whole fleet (429 + Retry-After naming max_queued_jobs_per_address), while another
  address is still served, bystanders get 0 × 502 and the held jobs' cancels (DELETE) reach their replicas. Before:
  40 ids got 36 jobs accepted. (tests/faults/test_address_cap.py is the one-process case; tests/ops/test_fleet.py the
  per-client cap's bystanders.)"""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.ops.fleet import Fleet, build_long_llama, long_text, running_fleet

pytestmark = pytest.mark.slow  # three replicas, redis-server and nginx

CAP = 3
SETTINGS = {"default_models": ["lm"], "full_map_tokens": 64, "max_tokens": 4096, "max_text_chars": 40_000,
            "max_queued_jobs_per_address": CAP, "trusted_proxies": ["127.0.0.1"], "job_reattach_grace_s": 120,
            "shutdown_grace_s": 2.0}
PACE_S = 0.06  # under nginx's own per-address rate (20 r/s): a 429 below is the app's


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    folder = build_long_llama(tmp_path_factory.mktemp("long-llama"))
    with running_fleet(tmp_path_factory.mktemp("fleet-outage"), SETTINGS, folder) as started:
        yield started


def _who(name: str, address: str | None = None) -> dict:
    return {"X-Attnlab-Client": name, **({"X-Forwarded-For": address} if address else {})}


def _windows(fleet: Fleet, run_id: str, n_tokens: int, tag: str, count: int = 20) -> list[httpx.Response]:
    """`count` windows of `run_id`, each sent through nginx as another client (spread over the replicas)."""
    answers = []
    for i in range(count):
        r0 = (i * 37) % max(1, n_tokens - 32)
        answers.append(httpx.post(f"{fleet.nginx.base}/api/runs/{run_id}/window", headers=_who(f"{tag}-{i}"),
                                  json={"layer": i % 4, "head": i % 4, "rows": [r0, r0 + 32], "cols": [0, 32]},
                                  timeout=60))
    return answers


def test_with_redis_stopped_every_window_of_a_live_run_answers(fleet):
    made = httpx.post(fleet.nginx.base + "/api/text/attention", timeout=600,
                      headers={**_who("outage-maker"), "Accept": "text/event-stream"},
                      json={"model": "lm", "text": long_text(600, shift=3)})
    assert made.status_code == 200, made.text[:300]
    done = [json.loads(line[5:]) for line in made.text.splitlines() if line.startswith("data:")][-1]
    assert done.get("done") is True, done
    run_id, n_tokens = done["run_id"], len(done["tokens"])
    assert all(a.status_code == 200 for a in _windows(fleet, run_id, n_tokens, "before"))
    fleet.redis.stop()
    try:
        during = _windows(fleet, run_id, n_tokens, "during")
    finally:
        fleet.redis.start()  # back, empty (no persistence, as deployed)
    after = _windows(fleet, run_id, n_tokens, "after", count=5)
    statuses = [a.status_code for a in during]
    assert statuses == [200] * 20, [(a.status_code, a.text[:120]) for a in during if a.status_code != 200]
    assert [a.status_code for a in after] == [200] * 5, [a.text[:120] for a in after]
    print(f"\nRedis stopped: {statuses.count(200)}/20 windows of a live run answered 200 through nginx; "
          f"right after it came back empty: {sum(a.status_code == 200 for a in after)}/5")


class HeldJob(threading.Thread):
    """A long streamed compare through nginx, read to its end in a thread: its first answer (status, event or body,
    Retry-After) and when its done or error event arrived."""

    def __init__(self, base: str, headers: dict, text: str):
        super().__init__(daemon=True)
        self.base, self.headers, self.text = base, headers, text
        self.answered = threading.Event()
        self.first: tuple[int, dict, str | None] | None = None
        self.last: dict = {}
        self.ended_at = float("inf")
        self.start()

    def run(self) -> None:
        body = {"model": "lm", "text": self.text, "layers": [0], "heads": [0], "compare": True, "samples": 4,
                "interventions": [{"op": "perturb_keys", "noise_std": 0.5, "seed": 1}]}
        try:
            with httpx.stream("POST", self.base + "/api/text/attention", json=body, timeout=httpx.Timeout(600, connect=10),
                              headers={**self.headers, "Accept": "text/event-stream"}) as r:
                if r.status_code != 200:
                    r.read()
                    self.first = (r.status_code, r.json(), r.headers.get("Retry-After"))
                    return
                for line in r.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    self.last = json.loads(line[5:])
                    if self.first is None:
                        self.first = (200, self.last, None)
                        self.answered.set()
                    if "done" in self.last or "error" in self.last:
                        self.ended_at = time.monotonic()
        finally:
            self.answered.set()


def _submit(base: str, headers: dict) -> tuple[float, int, dict | str, str | None]:
    """A short job; its first answer: (when sent, status, its accepted event or refusal body, Retry-After)."""
    sent = time.monotonic()
    with httpx.stream("POST", base + "/api/text/attention", json={"model": "lm", "text": long_text(40, shift=7)},
                      headers={**headers, "Accept": "text/event-stream"}, timeout=60) as r:
        if r.status_code != 200:
            r.read()
            return sent, r.status_code, r.json(), r.headers.get("Retry-After")
        for line in r.iter_lines():
            if line.startswith("data:"):
                return sent, 200, json.loads(line[5:]), None
    raise AssertionError("the stream ended without an event")


def test_forty_client_ids_from_one_address_get_its_cap_over_the_fleet(fleet):
    address = "198.51.100.7"
    held = []
    for i in range(CAP):  # the address's cap filled by long jobs of three minted ids (on whichever replicas)
        held.append(HeldJob(fleet.nginx.base, _who(f"minted-{i:02d}", address), long_text(4000, shift=60 + i)))
        assert held[-1].answered.wait(120) and held[-1].first and held[-1].first[0] == 200, held[-1].first
    over = []
    for i in range(CAP, 40):
        time.sleep(PACE_S)
        over.append(_submit(fleet.nginx.base, _who(f"minted-{i:02d}", address)))
    first_end = min(job.ended_at for job in held)
    capped = [(status, body, retry) for sent, status, body, retry in over if sent < first_end - 1.0]
    assert over[0][1] == 429, over[0]  # right after the third acceptance the cap is full however fast jobs run
    assert [status for status, _, _ in capped] == [429] * len(capped), [c[:2] for c in capped if c[0] != 429]
    for _, body, retry in capped:
        assert "max_queued_jobs_per_address=3" in body["detail"] and address in body["detail"], body
        assert retry is not None and int(retry) >= 1
    _, status, event, _ = _submit(fleet.nginx.base, _who("elsewhere-01", "203.0.113.9"))
    assert status == 200 and event.get("accepted") is True, event  # another address is still served
    bystanders = []
    for i in range(10):
        time.sleep(PACE_S)
        bystanders.append(httpx.post(fleet.nginx.base + "/api/text/tokenize", headers=_who(f"bystander-{i}"),
                                     json={"model": "lm", "text": "the cat sat"}, timeout=60).status_code)
    assert bystanders == [200] * 10, bystanders  # 0 × 502: no replica was taken out by the 429s
    cancels = []
    for i, job in enumerate(held):
        job_id = job.first[1]["job_id"]
        cancels.append(httpx.delete(f"{fleet.nginx.base}/api/jobs/{job_id}", headers=_who(f"minted-{i:02d}", address),
                                    timeout=30))
    assert [r.status_code for r in cancels] == [200] * CAP, [r.text[:160] for r in cancels]
    for job in held:
        job.join(120)
        assert not job.is_alive() and (job.last.get("cancelled") is True or job.last.get("done") is True), job.last
    print(f"\n40 client ids from one address through nginx: {CAP} accepted, {len(capped)} × 429 while the cap was "
          f"full; another address served; bystanders 10/10 × 200; cancels {CAP} × 200")
