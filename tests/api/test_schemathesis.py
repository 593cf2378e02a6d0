"""Property-based API fuzzing: schemathesis generates requests from /openapi.json (in-process, ASGI)
and no request may produce a server error (5xx other than the queue's or shutdown's 503). Every one of
the 13 operations is exercised (the last test checks it and prints how each answered).

Bounded for a 2-core machine: tiny random-weight BERTs (plus minilm when a request leaves `model` out,
with max_tokens=32), 15 examples per operation, 6 for the image endpoints.
"""
from __future__ import annotations

import shutil
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, Phase, settings

from app.main import create_app
from app.settings import Settings

HEAVY = r"^/api/(image|text/generate)"  # each example decodes an image, runs a ViT or generates with an LM


# The schema is read at import (it does not depend on the models); the tiny models are copied into
# these folders and the runtime is started by the module fixture below, before the first example runs.
MODELS_DIR = Path(tempfile.mkdtemp(prefix="attnlab-fuzz-"))
app = create_app(
    Settings(
        default_models=["tiny"],
        extra_text_models={"tiny": str(MODELS_DIR / "tiny"), "tiny-mlm": str(MODELS_DIR / "tiny-mlm")},
        max_text_chars=2000,
        max_tokens=32,
        max_response_numbers=50_000,
        max_upload_bytes=512 * 1024,
        queue_depth=32,
        **({"max_new_tokens": 2} if "max_new_tokens" in Settings.model_fields else {}),  # LM generation: 2 steps
    )
)


async def without_lifespan(scope, receive, send):
    """The app for schemathesis: it opens a client per call, which would start a new runtime each time."""
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    await app(scope, receive, send)


schema = schemathesis.openapi.from_asgi("/openapi.json", without_lifespan)


@pytest.fixture(scope="module", autouse=True)
def running_app(tiny_bert, tiny_mlm):
    shutil.copytree(tiny_bert, MODELS_DIR / "tiny", dirs_exist_ok=True)
    shutil.copytree(tiny_mlm, MODELS_DIR / "tiny-mlm", dirs_exist_ok=True)
    with TestClient(app):  # runs the lifespan once: app.state.runtime serves every call below
        app.state.runtime.warm_up()
        yield app
    shutil.rmtree(MODELS_DIR, ignore_errors=True)


KNOWN = {  # the 13 operations of issue 12's count; any added since are exercised too (ALL below)
    "GET /api/health", "GET /api/ready", "GET /api/models", "POST /api/text/attention", "POST /api/images",
    "GET /api/images/{image_id}/view", "POST /api/image/attention", "GET /api/gaussian/models",
    "GET /api/gaussian/centers", "GET /api/gaussian/history", "POST /api/gaussian/attention",
    "POST /api/gaussian/conv-equivalence", "GET /api/gaussian/blocks",
}
ALL = {f"{op.method.upper()} {op.path}" for op in (r.ok() for r in schema.get_all_operations())}
CALLS: dict[str, dict] = defaultdict(lambda: {"statuses": defaultdict(int), "seconds": 0.0})


def test_schema_covers_the_api():
    assert KNOWN <= ALL, KNOWN - ALL


FUZZ = settings(
    deadline=None,
    suppress_health_check=list(HealthCheck),
    phases=[Phase.explicit, Phase.generate, Phase.shrink],
    derandomize=True,
    database=None,
)


def check_no_server_error(case) -> None:
    started = time.perf_counter()
    response = case.call()
    calls = CALLS[f"{case.method.upper()} {case.path}"]
    calls["statuses"][response.status_code] += 1
    calls["seconds"] += time.perf_counter() - started
    allowed_503 = response.status_code == 503 and "retry-after" in {k.lower() for k in response.headers}
    assert response.status_code < 500 or allowed_503, (
        f"{case.method} {case.formatted_path} → {response.status_code}: {response.text[:500]}"
    )
    assert "Traceback (most recent call last)" not in response.text  # the bare word may be echoed input


@schema.exclude(path_regex=HEAVY).parametrize()
@settings(FUZZ, max_examples=15)
def test_no_server_errors(case):
    check_no_server_error(case)


@schema.include(path_regex=HEAVY).parametrize()
@settings(FUZZ, max_examples=6)
def test_no_server_errors_image_endpoints(case):
    check_no_server_error(case)


def test_every_operation_was_exercised():
    """Runs after the fuzzing tests (file order): each of the 13 operations was called and answered."""
    for name in sorted(CALLS):
        calls = CALLS[name]
        print(f"{name}: {sum(calls['statuses'].values())} calls in {calls['seconds']:.1f} s, "
              f"statuses {dict(sorted(calls['statuses'].items()))}")
    missing = ALL - {name for name, calls in CALLS.items() if calls["statuses"]}
    assert not missing, f"operations schemathesis never called: {sorted(missing)}"
