"""Fixtures for the integration tests on the real models."""
from __future__ import annotations

import pytest

from tests.integration.helpers import real_server


@pytest.fixture(scope="session")
def smollm2_server():
    """One real server (`python -m app.serve`) on smollm2-135m, started once for the tests that watch it stop the work
    of a client that left (test_smollm2.py, test_smollm2_analysis.py: both in the xdist group "smollm2-server", so one
    worker starts it). A patching scan runs in batches of 4 copies of its 12-token prompt (48 tokens): many steps.
    Yields (base URL, process)."""
    # job_reattach_grace_s=0: a job whose stream dropped stops at once, as these tests watch (by default it runs on
    # for a while, awaiting a re-attach: tests/api/test_job_reattach.py)
    env = {"ATTNLAB_DEFAULT_MODELS": '["smollm2-135m"]', "ATTNLAB_PATCHING_BATCH_TOKENS": "48",
           "ATTNLAB_JOB_REATTACH_GRACE_S": "0"}
    with real_server(env, ready_s=300) as started:  # loading takes about 2 min on a busy 2-core machine
        yield started
