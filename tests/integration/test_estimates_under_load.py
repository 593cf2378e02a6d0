"""Issue 36 §5 on the real smollm2-135m, a fresh server started beside two busy processes (its start-up timing runs
under that load): a 7-token first view and the 9-token exact head scan are answered when sent plain (before, a
replica calibrated under load refused a 7-token request as "about 107 s", and the scan with 413 at an estimate of
96 s when it took 26.8 s), and the streamed scan's ETA is within 2× of the real time (or, when the load changed in
between, of the identical plain scan's time just before: the server learns the scan's rate from it, app/costs.py
WorkClock) with an eta_s on every progress event. benchmarks/jobs.py --parts headscan measures the ratios."""
from __future__ import annotations

import json
import multiprocessing
import time

import httpx
import pytest

from tests.integration.helpers import SMOLLM2, real_server

pytestmark = pytest.mark.slow  # a server calibrated beside two spinning processes, then two 9-token head scans

SCAN = {"model": "smollm2-135m", "clean": "The capital city of France is the city of",
        "corrupt": "The capital city of Italy is the city of", "answer": " Paris", "wrong": " Rome",
        "scan": "heads", "method": "exact"}  # 9 tokens each


def _spin(stop_at: float) -> None:
    while time.time() < stop_at:
        pass


def test_a_nine_token_head_scan_is_answered_plain_under_load_and_its_eta_holds():
    assert (SMOLLM2 / "prepared.json").is_file(), "weights/smollm2-135m is missing: run `make weights`"
    busy = [multiprocessing.Process(target=_spin, args=(time.time() + 600,), daemon=True) for _ in range(2)]
    for process in busy:
        process.start()
    try:
        time.sleep(2)
        with real_server({"ATTNLAB_DEFAULT_MODELS": '["smollm2-135m"]'}, ready_s=300) as (base, _server):
            short = httpx.post(f"{base}/api/text/attention", timeout=120, json={
                "model": "smollm2-135m", "text": "the keeper lit the lamp", "layers": [0], "heads": [0]})
            assert short.status_code == 200, short.text[:300]
            sent = time.monotonic()
            plain = httpx.post(f"{base}/api/text/patching", json=SCAN, timeout=300)
            plain_s = time.monotonic() - sent  # the same work, just before: the load the estimate last saw
            assert plain.status_code == 200, plain.text[:300]
            started = time.monotonic()
            events = []
            with httpx.stream("POST", f"{base}/api/text/patching", timeout=300, headers={
                    "Accept": "text/event-stream"}, json={**SCAN, "clean": "The capital city of Spain is the city of",
                                                          "answer": " Madrid"}) as response:
                assert response.status_code == 200
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        events.append((time.monotonic() - started, json.loads(line[6:])))
            real = time.monotonic() - started
            accepted = events[0][1]
            assert accepted["accepted"] is True and events[-1][1].get("done") is True, events[-1]
            progress = [event for _, event in events if "progress" in event]
            assert progress and all(event["eta_s"] >= 0 for event in progress)
            ratio, before = accepted["eta_s"] / real, accepted["eta_s"] / plain_s
            print(f"\nplain scan answered in {plain_s:.1f} s; streamed: ETA {accepted['eta_s']:.1f} s, real {real:.1f} s "
                  f"(×{ratio:.2f}; ×{before:.2f} of the plain scan)")
            # within 2× of the real time; in the whole suite the other worker's load can change between the plain
            # scan and this one, so an ETA within 2× of the identical work just before also holds
            assert 1 / 2 <= ratio <= 2 or 1 / 2 <= before <= 2, (accepted, real, plain_s)
    finally:
        for process in busy:
            process.terminate()
