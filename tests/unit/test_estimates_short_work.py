"""Estimates for short and end-of-job work (issue 56 §4): a generate's steps at their measured seconds, not only
their multiply-adds; a job whose every step is done has nothing left (eta 0); the load now counts as well as the load
the model's recent runs met."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
from fastapi import HTTPException

from app import costs
from app.admission import check_stream_cost
from app.jobs import Job
from app.settings import Settings


@pytest.fixture
def adapter():
    """What the estimates read of a decoder LM: its id, shape and parameters (on the CPU)."""
    info = SimpleNamespace(id="estimates-lm", layers=2, heads=2, head_dim=4, decoder_layers=None, kv_heads=2)
    yield SimpleNamespace(info=info, model=torch.nn.Linear(8, 8), device=None)


@pytest.fixture
def measures():
    """An app's measures of its models' speed (app/costs.py CostMeasures): nothing measured yet."""
    return costs.CostMeasures()


def test_a_generate_is_estimated_from_its_measured_step_time(adapter, measures):
    settings = Settings(default_models=[], generate_timeout_s=5)
    runtime = SimpleNamespace(settings=settings, measures=measures)
    check_stream_cost(adapter, runtime, 10, 8, 0)  # a few multiply-adds of a tiny model: far within 5 s
    for _ in range(3):
        costs.observe_step(measures, adapter, 0.5)  # measured: half a second a step (per-call overhead, load)
    with pytest.raises(HTTPException) as refused:  # 2 sides × 7 steps × 0.5 s = 7 s > generate_timeout_s
        check_stream_cost(adapter, runtime, 10, 8, 0)
    assert refused.value.status_code == 413 and "max_new_tokens" in refused.value.detail
    assert costs.stream_seconds(measures, adapter, settings, 10, 8, 0) >= 2 * 7 * 0.5


def test_the_last_step_of_a_job_leaves_nothing(adapter):
    job = Job(what="test", client="c", deadline=time.monotonic() + 60, emit=lambda event: None)
    job.estimate_s, job.accepted_at = 20.0, time.monotonic()
    job.started_at = time.monotonic() - 1.0
    assert job.progressed(4, 5, time.monotonic()) > 0
    assert job.progressed(5, 5, time.monotonic()) == 0  # head_scores' 5/5 said 12.8 s


def test_the_load_now_counts_beside_the_load_of_recent_runs(adapter, measures, monkeypatch):
    settings = Settings(default_models=[])
    macs = 1e9
    for _ in range(4):  # runs on an idle machine: 1 s each, the slowdown they met is 1
        measures.throughput.observe(adapter.info.id, macs, 1.0, 1.0)
    monkeypatch.setattr(costs, "_share", lambda _adapter: 1.0)
    idle = costs.estimated_seconds(measures, adapter, settings, macs)
    monkeypatch.setattr(costs, "_share", lambda _adapter: 0.25)  # now three cores' worth of others per core of ours
    assert costs.estimated_seconds(measures, adapter, settings, macs) >= 0.99 * idle / 0.25
