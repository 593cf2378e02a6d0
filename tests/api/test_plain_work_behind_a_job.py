"""A plain request made of several model turns, behind a running job (issue 56 §3): short work waits for at most
about one layer of a running job (docs/science.md "Fairness"), once, not once per turn. POST /api/text/head_scores
(its probes' forwards and generation steps, a dozen turns) on the tiny Llama, while a job's forward holds the model
and calls the engine's per-layer listener after each of its layers: the job's layers done while head_scores runs are
counted, and the times the job handed the model over (events, not a clock). Before, the job took the model back in every gap between two of head_scores' turns, so
head_scores waited one job layer per turn: on a busy machine its whole request_timeout_s, and it lost the probes it
had run (a 503 after 95 s while a compare ran)."""
from __future__ import annotations

import threading
import time

import pytest

from app.context import RequestContext
from app.jobs import Job
from models.hooks import _layer_listener
from tests.api.helpers import tiny_lm_client
from tests.tiny_models import build_text_model

JOB_LAYERS = 400


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    llama = build_text_model("llama", tmp_path_factory.mktemp("llama-behind-job"))
    with tiny_lm_client(llama) as c:
        c.app.state.runtime.warm_up()
        yield c


def test_plain_head_scores_waits_about_one_layer_of_a_job_not_one_per_turn(client):
    runtime = client.app.state.runtime
    layers_done: list[int] = []
    started, stop = threading.Event(), threading.Event()
    job = Job(what="test job", client="someone-else", deadline=time.monotonic() + 300, emit=lambda event: None)

    def job_forward() -> None:
        with runtime.admitted(ctx=RequestContext(job=job, client="someone-else")):
            started.set()
            listener = _layer_listener.get()  # what the engine calls after each attention layer
            for layer in range(JOB_LAYERS):
                if stop.is_set():
                    return
                time.sleep(0.02)  # a layer's work
                listener(layer, JOB_LAYERS)
                layers_done.append(layer)

    worker = threading.Thread(target=job_forward)
    worker.start()
    try:
        assert started.wait(30)
        before, yields_before = len(layers_done), runtime.yields
        response = client.post("/api/text/head_scores", json={"model": "lm", "text": None})
        during = len(layers_done) - before
    finally:
        stop.set()
        worker.join(60)
    assert response.status_code == 200, response.text
    assert during < JOB_LAYERS - 1, "head_scores waited for the whole job"
    # the job handed the model over once, at the layer after head_scores asked, and took it back after its end: not
    # once per turn of head_scores (each hand-over is a layer of the job waited for)
    assert runtime.yields - yields_before == 1, f"the job handed over {runtime.yields - yields_before} times"
