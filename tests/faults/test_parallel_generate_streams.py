"""Issue 53 §4 on the real server (uvicorn, raw HTTP): 4 generate streams sent at once, from 4 clients, were all
accepted with ETAs that assumed one stream after another, then ran interleaved step by step, each at a quarter of
that speed, until three of them ran out of generate_timeout_s with 0 tokens. Now a stream keeps the model from its
first step to its end (app/scheduler.py keeping_turn) and its generate_timeout_s counts from that first step: every
accepted stream makes all its tokens, and the streams' steps do not interleave."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

STREAMS = 4
TOKENS = 24
PERTURB = {"op": "perturb_keys", "noise_std": 0.1, "seed": 1}  # two sides a step: twice the turns to interleave


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from tests.tiny_models import build_text_model

    return build_text_model("llama", tmp_path_factory.mktemp("llama-streams"))


def _stream(base: str, client: str, out: dict, ready: threading.Barrier) -> None:
    """One generate stream: its events with the monotonic time each arrived."""
    body = {"model": "tl", "text": "the cat sat on the mat because it was tired", "max_new_tokens": TOKENS,
            "interventions": [PERTURB]}
    events: list[tuple[float, dict]] = []
    out[client] = events
    ready.wait()
    with httpx.stream("POST", base + "/api/text/generate", json=body, timeout=300,
                      headers={"X-Attnlab-Client": client}) as response:
        if response.status_code != 200:
            response.read()
            events.append((time.monotonic(), {"status": response.status_code, "body": response.text}))
            return
        for line in response.iter_lines():
            if line.startswith("data:"):
                events.append((time.monotonic(), json.loads(line[5:])))


def test_four_parallel_streams_each_make_all_their_tokens_one_after_another(tiny_llama, start_server):
    server = start_server({"default_models": ["tl"], "extra_models": {"tl": str(tiny_llama)},
                           "max_new_tokens": TOKENS, "job_heartbeat_s": 1})
    server.wait_ready()
    out: dict[str, list[tuple[float, dict]]] = {}
    ready = threading.Barrier(STREAMS)
    threads = [threading.Thread(target=_stream, args=(server.base, f"stream-client-{i}", out, ready))
               for i in range(STREAMS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    assert not any(thread.is_alive() for thread in threads), "a stream did not end"
    spans = []
    for client, events in out.items():
        bodies = [event for _, event in events]
        assert bodies and bodies[0].get("accepted") is True, (client, bodies[:2])
        assert bodies[-1].get("done") is True, (client, bodies[-1])  # no error event: not run past its time
        steps = [(at, event) for at, event in events if "step" in event]
        assert [event["step"] for _, event in steps] == list(range(TOKENS)), (client, len(steps))
        spans.append((steps[0][0], steps[-1][0], client))
    spans.sort()
    for (_, last, before), (first, _, after) in zip(spans, spans[1:]):
        assert first >= last, f"{after}'s steps began before {before}'s had ended: the streams interleaved"
