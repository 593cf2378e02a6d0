"""Issue 37 §6, issue 36 §3 on the real server (uvicorn, raw HTTP): a queued job's stream is never silent (an SSE
comment every job_heartbeat_s), a client over max_queued_jobs_per_client is told so at once (429 naming the setting)
while other clients go on, and another client's job runs before the busy client's second one (turns go round the
clients). Before: a queued job sent nothing until its turn (nginx cut one at 120 s), a client's 36 queued jobs were all
accepted and every other client got 503, and jobs ran in arrival order."""
from __future__ import annotations

import json
import threading
import time

import httpx

from tests.faults.conftest import long_request, text_models

STREAM = {"Accept": "text/event-stream"}


class Recorder:
    """One streamed job in a thread: every line of its answer with the time it arrived."""

    def __init__(self, base: str, client: str, body: dict):
        self.lines: list[tuple[float, str]] = []
        self.status: int | None = None
        self.started = time.monotonic()
        self._thread = threading.Thread(target=self._run, args=(base, client, body), daemon=True)
        self._thread.start()

    def _run(self, base: str, client: str, body: dict) -> None:
        with httpx.stream("POST", base + "/api/text/attention", json=body, timeout=120,
                          headers={**STREAM, "X-Attnlab-Client": client}) as response:
            self.status = response.status_code
            for line in response.iter_lines():
                self.lines.append((time.monotonic(), line))

    def events(self) -> list[tuple[float, dict]]:
        return [(t, json.loads(line[5:])) for t, line in self.lines if line.startswith("data:")]

    def first(self, predicate) -> float | None:
        return next((t for t, event in self.events() if predicate(event)), None)

    def wait(self, predicate, limit_s: float = 60) -> float:
        end = time.monotonic() + limit_s
        while time.monotonic() < end:
            found = self.first(predicate)
            if found is not None:
                return found
            time.sleep(0.05)
        raise AssertionError(f"never happened; lines so far: {self.lines[:8]}")

    def join(self, limit_s: float = 120) -> None:
        self._thread.join(limit_s)


def test_queued_jobs_are_never_silent_a_client_is_capped_and_turns_go_round(tiny_bert, big_bert, start_server):
    server = start_server({**text_models(tiny_bert, big_bert), "job_heartbeat_s": 1.0,
                           "max_queued_jobs_per_client": 2})
    server.wait_ready()
    busy, other = "busy-client-1", "other-client-2"
    first = Recorder(server.base, busy, long_request(seed=1, samples=4))
    first.wait(lambda e: "progress" in e)
    second = Recorder(server.base, busy, long_request(seed=2, samples=4))
    second.wait(lambda e: e.get("accepted"))
    asked = time.monotonic()
    third = httpx.post(server.base + "/api/text/attention", json=long_request(seed=3, samples=8), timeout=30,
                       headers={**STREAM, "X-Attnlab-Client": busy})
    refused_in = time.monotonic() - asked
    assert third.status_code == 429 and "max_queued_jobs_per_client=2" in third.text, third.text
    assert int(third.headers["Retry-After"]) >= 1 and refused_in < 5.0, refused_in
    newcomer = Recorder(server.base, other, long_request(seed=4, samples=2))
    accepted = newcomer.wait(lambda e: e.get("accepted"))
    assert accepted - newcomer.started < 5.0
    for job in (first, second, newcomer):
        job.join()
    assert all(job.status == 200 for job in (first, second, newcomer))
    assert second.events()[-1][1].get("done") is True and newcomer.events()[-1][1].get("done") is True
    # the other client's job ran before the busy client's second one (which arrived earlier)
    assert newcomer.first(lambda e: "done" in e) < second.first(lambda e: "progress" in e or "done" in e)
    # the queued job was never silent: a comment at least every job_heartbeat_s (1 s) until it ran (its first progress,
    # or its answer when it ran too fast to report a layer)
    times = [second.started] + [t for t, _ in second.lines if t <= second.first(lambda e: "progress" in e or "done" in e)]
    longest = max(b - a for a, b in zip(times, times[1:]))
    assert any(line == ": keep-alive" for _, line in second.lines)
    assert longest < 3.0, f"silent for {longest:.1f} s while queued"
    print(f"\nthird job refused in {refused_in:.2f} s; longest silence of the queued job {longest:.2f} s")
