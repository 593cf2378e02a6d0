"""Runtime limits and hardening: bounded queue (503 + Retry-After), per-request time limit, readiness,
graceful SIGTERM, no stack traces in responses, registry-only model ids, security headers."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from app.runtime import Overloaded, Runtime, request_deadline
from app.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


def make_settings(tiny_bert, **overrides) -> Settings:
    values = dict(default_models=["tiny"], extra_text_models={"tiny": str(tiny_bert)}, max_text_chars=2000)
    values.update(overrides)
    return Settings(**values)


def wait_until(predicate, what: str, limit_s: float = 30.0) -> None:
    """Wait for a state change (not a speed check): fail only if it never happens."""
    end = time.monotonic() + limit_s
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"never happened: {what}")
        time.sleep(0.01)


def post_text(client, text: str):
    return client.post("/api/text/attention", json={"model": "tiny", "text": text, "layers": [0], "heads": [0]})


@pytest.fixture
def limited_client(tiny_bert, request):
    settings = make_settings(tiny_bert, **getattr(request, "param", {}))
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        client.app.state.runtime.warm_up()
        yield client


def test_default_queue_depth_is_at_least_32():
    assert Settings().queue_depth >= 32


@pytest.mark.parametrize("limited_client", [{"queue_depth": 1, "request_timeout_s": 120}], indirect=True)
def test_queue_full_answers_503_with_retry_after(limited_client):
    runtime = limited_client.app.state.runtime
    runtime._run_lock.acquire()  # a long forward is running
    try:
        with ThreadPoolExecutor(1) as pool:
            queued = pool.submit(post_text, limited_client, "the cat sat on the mat")
            wait_until(lambda: runtime.waiting == 1, "first request queued")
            refused = post_text(limited_client, "the dog sat on the rug")
            assert refused.status_code == 503
            assert int(refused.headers["Retry-After"]) >= 1
            assert "queue_depth" in refused.json()["detail"]
            assert not queued.done()  # the queued one still waits; nothing was dropped
            runtime._run_lock.release()
            admitted = queued.result(timeout=60)
    finally:
        if runtime._run_lock.locked() and runtime.waiting == 0:
            try:
                runtime._run_lock.release()
            except RuntimeError:
                pass
    assert admitted.status_code == 200
    assert admitted.json()["tokens"][0] == "[CLS]"


@pytest.mark.parametrize("limited_client", [{"queue_depth": 8, "request_timeout_s": 0.3}], indirect=True)
def test_request_time_limit_answers_503(limited_client):
    runtime = limited_client.app.state.runtime
    runtime._run_lock.acquire()
    try:
        r = post_text(limited_client, "it was tired because the street")
    finally:
        runtime._run_lock.release()
    assert r.status_code == 503
    assert int(r.headers["Retry-After"]) >= 1
    assert "request_timeout_s" in r.json()["detail"]
    assert runtime.waiting == 0
    again = post_text(limited_client, "it was tired because the street")
    assert again.status_code == 200, again.text  # and it recovers


def test_deadline_spans_every_wait_of_a_request(tiny_bert):
    """A request whose deadline has passed is refused at its next wait even when the model is free."""
    runtime = Runtime(make_settings(tiny_bert, request_timeout_s=60))
    token = request_deadline.set(time.monotonic() - 1)
    try:
        with pytest.raises(Overloaded):
            with runtime.admitted():
                pass
    finally:
        request_deadline.reset(token)
    assert not runtime._run_lock.locked() and runtime.waiting == 0
    with runtime.admitted():  # without a deadline (or a live one) it is admitted
        assert runtime._run_lock.locked()


def test_ready_is_503_until_warm(tiny_bert, monkeypatch):
    release = threading.Event()
    original = Runtime.warm_up

    def gated_warm_up(self):
        release.wait(60)
        original(self)

    monkeypatch.setattr(Runtime, "warm_up", gated_warm_up)
    with TestClient(create_app(make_settings(tiny_bert))) as client:
        r = client.get("/api/ready")
        assert r.status_code == 503 and r.headers.get("Retry-After")
        assert client.get("/api/health").status_code == 200  # alive while loading
        release.set()
        wait_until(lambda: client.app.state.runtime.ready, "warm-up finished")
        r = client.get("/api/ready")
        assert r.status_code == 200 and "tiny" in r.json()["models"]


@pytest.mark.parametrize("limited_client", [{}], indirect=True)
def test_internal_error_leaks_no_stack_trace(limited_client, monkeypatch):
    runtime = limited_client.app.state.runtime

    def broken(*args, **kwargs):
        raise RuntimeError("secret internal detail /srv/attnlab/models.py line 42")

    monkeypatch.setattr(runtime, "encode", broken)
    r = post_text(limited_client, "the cat sat")
    assert r.status_code == 500
    assert "Traceback" not in r.text and "secret internal detail" not in r.text and ".py" not in r.text
    assert r.json() == {"detail": "internal error (logged on the server)"}


@pytest.mark.parametrize("limited_client", [{}], indirect=True)
def test_model_ids_only_from_the_registry(limited_client, tiny_bert):
    # A real model folder on this machine is still refused: a request names ids, never paths.
    for name in (str(tiny_bert), "../weights/dinov2-small", "/etc/passwd", "https://example.invalid/model"):
        r = limited_client.post("/api/text/attention", json={"model": name, "text": "the cat"})
        assert r.status_code == 422, name
        assert name not in limited_client.app.state.runtime.loaded_adapters()


@pytest.mark.parametrize("limited_client", [{}], indirect=True)
def test_security_headers_on_pages_and_api(limited_client):
    for path in ("/", "/api/health"):
        r = limited_client.get(path)
        assert r.status_code == 200, path
        assert r.headers["X-Content-Type-Options"] == "nosniff"
        assert r.headers["X-Frame-Options"] == "DENY"
        csp = r.headers["Content-Security-Policy"]
        assert "default-src 'self'" in csp and "frame-ancestors 'none'" in csp and "object-src 'none'" in csp
        assert r.headers["Referrer-Policy"]


@pytest.mark.parametrize("limited_client", [{}], indirect=True)
def test_no_cross_origin_allowed_by_default(limited_client):
    r = limited_client.options(
        "/api/text/attention", headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"}
    )
    assert "access-control-allow-origin" not in {k.lower() for k in r.headers}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_lets_in_flight_request_finish_and_exits_0(tmp_path):
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    server = subprocess.Popen(
        [sys.executable, "-m", "app.serve", "tests.api.slow_app:app", "--host", "127.0.0.1", "--port", str(port)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        def healthy() -> bool:
            assert server.poll() is None, server.stdout.read().decode(errors="replace")
            try:
                return httpx.get(base + "/api/health", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(healthy, "uvicorn serving", limit_s=60)
        marker = tmp_path / "in-flight"
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(
                httpx.get, base + "/test/slow", params={"seconds": 2.5, "marker": str(marker)}, timeout=30
            )
            wait_until(marker.exists, "slow request in flight")
            server.send_signal(signal.SIGTERM)
            response = pending.result(timeout=30)
        assert response.status_code == 200 and response.json() == {"slept": 2.5}
        assert server.wait(timeout=10) == 0
        with pytest.raises(httpx.TransportError):  # and it is gone
            httpx.get(base + "/api/health", timeout=2)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_pickled_checkpoints_are_refused(tiny_bert, tmp_path):
    """Safetensors only: a checkpoint that holds only a pickle (pytorch_model.bin) never reaches torch.load."""
    import shutil

    import torch
    from safetensors.torch import load_file

    from models.adapters.bert import BertAdapter

    folder = tmp_path / "pickled"
    shutil.copytree(tiny_bert, folder)
    torch.save(load_file(str(folder / "model.safetensors")), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    BertAdapter("ok", str(tiny_bert), max_tokens=16, device="cpu")  # the same model as safetensors loads
    with pytest.raises((OSError, ValueError)):
        BertAdapter("pickled", str(folder), max_tokens=16, device="cpu")


@pytest.mark.parametrize("limited_client", [{"max_interventions": 2, "max_samples": 3}], indirect=True)
def test_intervention_and_sample_limits_come_from_settings(limited_client):
    one = {"op": "temperature", "beta": 0.5}
    base = {"model": "tiny", "text": "the cat sat", "layers": [0], "heads": [0]}
    assert limited_client.post("/api/text/attention", json={**base, "interventions": [one] * 2}).status_code == 200
    r = limited_client.post("/api/text/attention", json={**base, "interventions": [one] * 3})
    assert r.status_code == 422 and "max_interventions" in r.text
    r = limited_client.post("/api/text/attention", json={**base, "samples": 4})
    assert r.status_code == 422 and "max_samples" in r.text


def test_model_lock_is_handed_over_in_arrival_order(tiny_bert):
    runtime = Runtime(make_settings(tiny_bert, queue_depth=8, request_timeout_s=60))
    order: list[int] = []

    def worker(i: int) -> None:
        with runtime.admitted():
            order.append(i)

    runtime._run_lock.acquire()
    threads = []
    try:
        for i in range(4):
            t = threading.Thread(target=worker, args=(i,))
            t.start()
            threads.append(t)
            wait_until(lambda: runtime.waiting == i + 1, f"worker {i} queued")
    finally:
        runtime._run_lock.release()
        with runtime._turns:
            runtime._turns.notify_all()
    for t in threads:
        t.join(60)
    assert order == [0, 1, 2, 3]
    assert runtime.waiting == 0 and not runtime._run_lock.locked()


def test_admission_gate_refuses_on_the_event_loop():
    """Past `limit` API POSTs in flight, the gate answers 503 + Retry-After without calling the app."""
    import asyncio

    from app.main import AdmissionGate

    async def scenario():
        release, entered = asyncio.Event(), []

        async def slow_app(scope, receive, send):
            entered.append(scope["path"])
            await release.wait()
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})

        gate = AdmissionGate(slow_app, limit=2)
        transport = httpx.ASGITransport(app=gate)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            first = [asyncio.create_task(client.post("/api/text/attention")) for _ in range(2)]
            while len(entered) < 2:
                await asyncio.sleep(0.01)
            refused = await client.post("/api/text/attention")
            not_gated = asyncio.create_task(client.get("/api/health"))  # GETs are not gated
            while len(entered) < 3:
                await asyncio.sleep(0.01)
            release.set()
            done = [await t for t in first] + [await not_gated]
        return refused, done, entered, gate.in_flight

    refused, done, entered, in_flight = asyncio.run(scenario())
    assert refused.status_code == 503 and int(refused.headers["Retry-After"]) >= 1
    assert [r.status_code for r in done] == [200, 200, 200]
    assert entered.count("/api/text/attention") == 2  # the refused one never reached the app
    assert in_flight == 0


def test_server_code_never_unpickles_or_fetches_urls():
    """No torch.load / pickle of anything (user data included), no server-side URL fetching, no remote code."""
    forbidden = ("torch.load(", "pickle.load", "urllib.request", "urlopen(", "import httpx", "import requests",
                 "trust_remote_code=True")
    offenders = [
        f"{path.relative_to(ROOT)}: {needle}"
        for folder in ("app", "models")
        for path in (ROOT / folder).rglob("*.py")
        for needle in forbidden
        if needle in path.read_text(encoding="utf-8")
    ]
    assert offenders == []


def test_server_timing_reports_the_model_run_only_when_it_ran(client):
    """Server-Timing: a fresh request names the model run and its queue wait; a cached repeat has no model run."""
    import re

    body = {"model": "tiny", "text": "server timing sentence one", "layers": [0], "heads": [0]}
    fresh = client.post("/api/text/attention", json=body)
    timing = dict(re.findall(r"(\w+);dur=([\d.]+)", fresh.headers["server-timing"]))
    assert {"queue", "model", "app"} <= set(timing)
    assert 0 < float(timing["model"]) <= float(timing["app"])
    repeat = client.post("/api/text/attention", json=body)
    assert "model;" not in repeat.headers["server-timing"] and "app;dur=" in repeat.headers["server-timing"]


def test_small_inputs_run_on_one_thread_and_the_count_is_restored(api_settings, monkeypatch):
    """single_thread_max_tokens: a short input runs with one torch thread, a long one with the usual count."""
    import torch

    from app.runtime import Runtime

    seen = []
    runtime = Runtime(api_settings.model_copy(update={"single_thread_max_tokens": 8}))
    adapter = runtime.adapter("tiny")
    real_run = adapter.run
    monkeypatch.setattr(adapter, "run", lambda *a, **k: (seen.append(torch.get_num_threads()), real_run(*a, **k))[1])
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        runtime.run(adapter, adapter.encode("a short one"), (), False)  # 5 tokens
        runtime.run(adapter, adapter.encode("a much longer sentence that has more than eight tokens in it"), (), False)
        assert seen == [1, 2] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


# ---- issue 19: the second probe ------------------------------------------------------------------------
def _sse(response) -> list[dict]:
    import json

    return [json.loads(line[5:]) for line in response.text.splitlines() if line.startswith("data:")]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    from tests.tiny_models import build_text_model

    return build_text_model("llama", tmp_path_factory.mktemp("llama19"))


def lm_client(tiny_llama, **overrides) -> TestClient:
    values = dict(default_models=["tl"], extra_models={"tl": str(tiny_llama)}, max_new_tokens=12)
    values.update(overrides)
    client = TestClient(create_app(Settings(**values)))
    client.__enter__()
    client.app.state.runtime.warm_up()
    return client


PERTURB = {"op": "perturb_keys", "noise_std": 0.1, "seed": 1}


def test_generate_checks_max_interventions_like_every_route(tiny_llama):
    """§2: 65 interventions were accepted by /api/text/generate while /api/text/attention answered 422."""
    client = lm_client(tiny_llama)
    try:
        body = {"model": "tl", "text": "the cat sat on the mat", "max_new_tokens": 2, "interventions": [PERTURB] * 65}
        for path in ("/api/text/generate", "/api/text/attention"):
            r = client.post(path, json=body if path.endswith("generate") else
                            {k: v for k, v in body.items() if k != "max_new_tokens"})
            assert r.status_code == 422, (path, r.status_code, r.text[:200])
            assert "max_interventions" in r.text and r.json()["detail"][0]["loc"] == ["body", "interventions"]
        r = client.post("/api/text/generate", json={**body, "interventions": [PERTURB] * 64})
        assert r.status_code == 200 and _sse(r)[-1]["done"] is True
    finally:
        client.__exit__(None, None, None)


def test_generate_stream_ends_with_an_error_event_past_generate_timeout_s(tiny_llama):
    """§2: request_timeout_s applied per step only; a whole stream now stops at generate_timeout_s."""
    client = lm_client(tiny_llama, generate_timeout_s=0.001)  # any real step takes longer than 1 ms
    try:
        r = client.post("/api/text/generate", json={"model": "tl", "text": "the cat sat on the mat", "max_new_tokens": 12})
        assert r.status_code == 200
        events = _sse(r)
        assert events[-1].get("setting") == "generate_timeout_s" and "generate_timeout_s=0.001" in events[-1]["error"]
        assert not any(e.get("done") for e in events) and len(events) < 12
    finally:
        client.__exit__(None, None, None)
    client = lm_client(tiny_llama)  # the default budget lets the same stream finish
    try:
        r = client.post("/api/text/generate", json={"model": "tl", "text": "the cat sat on the mat", "max_new_tokens": 12})
        assert _sse(r)[-1]["done"] is True
    finally:
        client.__exit__(None, None, None)


def test_cost_estimate_of_known_shapes():
    """§4: the estimate is arithmetic on the model's shape (app/costs.py)."""
    from app.costs import ModelShape, forward_macs, request_runs, stream_macs

    shape = ModelShape(params=1000, layers=2, heads=3, head_dim=4)
    assert forward_macs(shape, 10, 10) == 1000 * 10 + 2 * (2 * 3 * 10 * 10) * 4
    assert forward_macs(shape, 10, 10, interventions=5) == forward_macs(shape, 10, 10) + 4 * 5 * 2 * 3 * 10 * (10 + 4)
    assert forward_macs(shape, 1, 50) < forward_macs(shape, 50, 50) / 40  # a decoding step is one query
    assert request_runs(16, True) == 17 and request_runs(16, False) == 1 and request_runs(1, True) == 2
    assert stream_macs(shape, 10, 1, 0) == 2 * forward_macs(shape, 10, 10)  # the prompt, on both sides
    # the probe's LM case: 512 tokens, samples 16, on smollm2-135m's shape, at the default 8 GMAC/s, is minutes
    smollm = ModelShape(params=134_515_008, layers=30, heads=9, head_dim=64)
    assert 17 * forward_macs(smollm, 512, 512) / 8e9 > 60


def test_requests_that_would_time_out_are_refused_with_413_before_they_start(tiny_bert, tiny_llama):
    """§4: dinov2 at 448 px with samples 16 and the LM at 512 tokens with samples 16 ran a minute, then 503.
    With a throughput such that one run takes 1/5 of request_timeout_s, 17 runs are refused, 1 is served."""
    from app.costs import THROUGHPUT, forward_macs, model_shape

    THROUGHPUT.clear()
    probe = TestClient(create_app(make_settings(tiny_bert)))
    with probe:
        probe.app.state.runtime.warm_up()
        adapter = probe.app.state.runtime.adapter("tiny")
        tokens = len(adapter.encode("the cat sat on the mat", None).tokens)
        one_run = forward_macs(model_shape(adapter), tokens, tokens, 1)
    rate_gmacs = one_run / 1e9 / (0.2 * 60)  # one run: 12 s of the 60 s request_timeout_s
    client = TestClient(create_app(make_settings(tiny_bert, compute_gmacs_per_s=rate_gmacs)))
    with client:
        client.app.state.runtime.warm_up()
        body = {"model": "tiny", "text": "the cat sat on the mat", "layers": [0], "heads": [0],
                "interventions": [PERTURB], "compare": True, "samples": 16}
        started = time.monotonic()
        r = client.post("/api/text/attention", json=body)
        assert r.status_code == 413, r.text
        assert "request_timeout_s=60" in r.json()["detail"] and "17 model runs" in r.json()["detail"]
        assert time.monotonic() - started < 5  # refused, not run
        assert client.post("/api/text/attention", json={**body, "compare": False, "samples": 1}).status_code == 200
    # a stream: estimated over generate_timeout_s → 413 naming it
    client = lm_client(tiny_llama, compute_gmacs_per_s=1e-9)
    try:
        r = client.post("/api/text/generate", json={"model": "tl", "text": "the cat sat on the mat", "max_new_tokens": 8})
        assert r.status_code == 413 and "generate_timeout_s" in r.json()["detail"], r.text
    finally:
        client.__exit__(None, None, None)


def test_a_queued_request_whose_client_left_leaves_the_queue_and_never_runs(tiny_bert):
    """§3: requests waiting for the model kept their place after their client left and ran when their turn
    came (12 closed LM requests: 6 s of work). Now the wait ends on cancellation, and a request that gets the
    lock after its client left gives it back at once."""
    from app.lifecycle import CancelEvent, RequestCancelled, request_cancel

    runtime = Runtime(make_settings(tiny_bert))
    runtime._run_lock.acquire()  # the model is busy
    cancel = CancelEvent()
    outcome: dict = {}

    def queued():
        request_cancel.set(cancel)
        try:
            with runtime.admitted():
                outcome["ran"] = True
        except RequestCancelled as exc:
            outcome["cancelled"] = exc.reason

    thread = threading.Thread(target=queued)
    thread.start()
    wait_until(lambda: runtime.waiting == 1, "the request queues")
    cancel.reason = "client"
    cancel.set()
    started = time.monotonic()
    thread.join(5)
    assert outcome == {"cancelled": "client"} and time.monotonic() - started < 1.0 and runtime.waiting == 0
    runtime._run_lock.release()
    # cancelled after it got the lock: it never runs, and the lock is free again
    token = request_cancel.set(cancel)
    try:
        with pytest.raises(RequestCancelled):
            with runtime.admitted():
                raise AssertionError("ran although its client had left")
    finally:
        request_cancel.reset(token)  # this thread runs later tests: a cancelled request must not outlive this one
    assert runtime._run_lock.acquire(blocking=False)
    runtime._run_lock.release()


def test_result_cache_scoped_per_client_when_configured(tiny_bert):
    """§11: a cache hit is visible in the response time (0.03 s vs 0.2 s), so a client could tell what others
    asked. With result_cache_scope="client" each client (cookie or X-Attnlab-Client) has its own entries."""
    body = {"model": "tiny", "text": "a secret sentence someone typed", "layers": [0], "heads": [0]}
    for scope, other_hits in (("shared", 1), ("client", 0)):
        app = create_app(make_settings(tiny_bert, result_cache_scope=scope))
        with TestClient(app) as alice, TestClient(app) as bob:
            app.state.runtime.warm_up()
            cache = app.state.runtime.cache
            first = alice.post("/api/text/attention", json=body)
            assert first.status_code == 200
            if scope == "client":
                assert "attnlab_client=" in first.headers["set-cookie"] and "HttpOnly" in first.headers["set-cookie"]
            else:
                assert "set-cookie" not in first.headers
            hits = cache.hits
            assert alice.post("/api/text/attention", json=body).status_code == 200
            assert cache.hits == hits + 1  # the same client: its own entry
            hits = cache.hits
            assert bob.post("/api/text/attention", json=body).status_code == 200  # another browser (no cookie yet)
            assert cache.hits - hits == other_hits, scope
            hits = cache.hits
            r = bob.post("/api/text/attention", json=body, headers={"X-Attnlab-Client": "api-client-0001"})
            assert r.status_code == 200 and cache.hits - hits == other_hits  # a header names an API client


def test_a_request_whose_work_no_longer_fits_after_queueing_is_refused_at_its_turn(tiny_bert):
    """The cost check estimated 20 s of model time; the request gets the model with 5 s left before its deadline:
    503 at once (no work started to be thrown away at the deadline), the lock given back; with 30 s left it runs."""
    from app.costs import request_model_seconds

    runtime = Runtime(make_settings(tiny_bert, request_timeout_s=60))
    for left_s, refused in ((5.0, True), (30.0, False)):
        deadline, estimate = request_deadline.set(time.monotonic() + left_s), request_model_seconds.set(20.0)
        try:
            if refused:
                with pytest.raises(Overloaded, match="needs about 20 s of model time"):
                    with runtime.admitted():
                        raise AssertionError("the work started")
                assert not runtime._run_lock.locked()
            else:
                with runtime.admitted():
                    assert runtime._run_lock.locked()
                request_deadline.set(time.monotonic() + 1.0)
                with runtime.admitted():  # the same request's next run: the estimate was checked at its first turn
                    assert runtime._run_lock.locked()
        finally:
            request_deadline.reset(deadline)
            request_model_seconds.reset(estimate)


def test_a_request_served_from_cached_runs_is_never_refused_by_the_cost_estimate(tiny_bert):
    """After a slow first view, a head or mode change over the same cached runs got 413 (the estimate counted runs
    the cache already held). With a throughput at which one run takes far over request_timeout_s: the cached
    request is answered, a new input is refused."""
    from app.costs import THROUGHPUT

    client = TestClient(create_app(make_settings(tiny_bert)))
    with client:
        client.app.state.runtime.warm_up()
        body = {"model": "tiny", "text": "the cat sat on the mat", "layers": [0], "heads": [0],
                "interventions": [PERTURB], "compare": True}
        assert client.post("/api/text/attention", json=body).status_code == 200
        try:
            THROUGHPUT._rates["tiny"] = 1.0  # one multiply-add per second: every uncached run is hours
            r = client.post("/api/text/attention", json={**body, "heads": [1]})
            assert r.status_code == 200, r.text
            r = client.post("/api/text/attention", json={**body, "text": "a dog ran"})
            assert r.status_code == 413 and "2 model runs" in r.json()["detail"], r.text
        finally:
            THROUGHPUT.clear()
