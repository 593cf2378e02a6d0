"""Helpers shared by the API tests: an app serving tiny random models added the way an operator adds them, settings
around the tiny BERT, waiting for a state change, and the events of a server-sent-events answer."""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

from fastapi.testclient import TestClient

from app.main import create_app
from app.settings import Settings
from tests.tiny_models import build_text_model


def run_async(coroutine: Coroutine):
    """asyncio.run in a thread of its own: a session's Playwright (sync API) leaves its event loop running in the
    worker's main thread, where asyncio.run refuses to start ("cannot be called from a running event loop")."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


@contextmanager
def tiny_models_client(tmp_path_factory, families: dict[str, str], **settings) -> Iterator[TestClient]:
    """A client of an app serving {model id: family of tests/tiny_models.py} as extra models, warmed up (so tests
    do not race the background warm-up); `settings` are the rest of its Settings."""
    models = {name: str(build_text_model(family, tmp_path_factory.mktemp(family))) for name, family in families.items()}
    with TestClient(create_app(Settings(extra_models=models, **settings))) as client:
        client.app.state.runtime.warm_up()
        yield client


# A sentence of 38 tokens for the tiny LM (tests/tiny_models.py "llama": GQA), and the settings under which it is a long
# input: the long-input path from 9 tokens on, overviews of 6 blocks, row blocks of 4 rows.
TINY_TEXT = ("the cat sat on the mat because it was tired , the dog ran on the street . a big red car did not cross "
             "the small blue house , it was the capital of france")
TINY_ATLAS = {"full_map_tokens": 8, "overview_blocks": 6, "atlas_block_rows": 4}


def tiny_lm_client(folder, **settings) -> TestClient:
    """A client (use it in a `with`) of an app serving the tiny model in `folder` as its only model, "lm"."""
    return TestClient(create_app(Settings(default_models=["lm"], extra_models={"lm": str(folder)},
                                          max_response_numbers=200_000, **settings)))


def sse_events(response) -> list[dict]:
    """The JSON payloads of a job's server-sent-events answer, in order, after its accepted event (checked here: a
    job's first event, docs/api.md "Jobs")."""
    accepted, *events = job_events(response)
    assert accepted.get("accepted") is True and {"eta_s", "queue_position", "runs"} <= set(accepted), accepted
    return events


def job_events(response) -> list[dict]:
    """Every JSON payload of a server-sent-events answer, in order, the accepted event included."""
    return [json.loads(line[len("data:"):]) for line in response.text.splitlines() if line.startswith("data:")]


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
