"""Process state has one owner (issue 54): create_app builds an app/process.py ProcessState per app; app/ keeps no
module-level instance of the mutable classes it holds."""
from __future__ import annotations

import ast
import time
from pathlib import Path

from app.jobs import Job
from app.main import create_app
from app.process import ProcessState
from app.settings import Settings

ROOT = Path(__file__).resolve().parents[2]

# The classes whose instances are process state: one each per app, on app.state.process, never a module global.
STATE_CLASSES = {"JobBoard", "JobLogs", "Lifecycle", "Fleet", "StatusCounts", "InFlight", "Throughput", "CpuShare",
                 "StepTimes", "Counter", "ProcessState"}
# Module globals of those classes still in app/, each with why: facts of the process itself, not of one app.
ALLOWED: dict[str, str] = {
    "app/costs.py:CPU_SHARE": "the CPU share the machine gives this process (/proc/self/stat and /proc/stat): one fact "
                              "of the process, whichever app asks; one per app would only read /proc more often",
    "app/in_flight.py:MODEL_REQUESTS": "OpenMP teams belong to the process's threads (app/openmp_teams.py, whose "
                                       "TeamStats is process-wide too): a thread ends its team when another model "
                                       "request of the process works, whichever app it came to",
    "app/in_flight.py:API_POSTS": "the run store's writer defers a file while any API POST of the process is in "
                                  "flight: the write's CPU time and memory traffic land on every response the process "
                                  "sends, not only its own app's",
}


def _module_instances(path: Path) -> list[str]:
    """Names bound at the top of `path` to a call of one of STATE_CLASSES."""
    found = []
    for node in ast.parse(path.read_text()).body:
        targets, value = [], None
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        if not isinstance(value, ast.Call):
            continue
        called = value.func.attr if isinstance(value.func, ast.Attribute) else getattr(value.func, "id", "")
        if called in STATE_CLASSES:
            found += [t.id for t in targets if isinstance(t, ast.Name)]
    return found


def test_app_keeps_no_module_level_process_state():
    found = {f"{path.relative_to(ROOT).as_posix()}:{name}"
             for path in sorted((ROOT / "app").rglob("*.py")) for name in _module_instances(path)}
    assert found - set(ALLOWED) == set(), "process state belongs to app/process.py ProcessState, built by create_app"
    assert set(ALLOWED) - found == set(), "an allowed global is gone: take it off ALLOWED"


def test_the_check_finds_a_module_level_instance(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("from app.jobs import JobBoard\nimport app.lifecycle as lc\n"
                      "BOARD = JobBoard()\nLIFE: lc.Lifecycle = lc.Lifecycle()\n\ndef f():\n    local = JobBoard()\n")
    assert _module_instances(sample) == ["BOARD", "LIFE"]


def _job(client: str) -> Job:
    return Job(what="POST /api/text/attention", client=client, deadline=time.monotonic() + 600,
               emit=lambda event: None)


def test_two_apps_have_their_own_job_boards_logs_lifecycles_and_fleets():
    settings = Settings(default_models=[], prepare_in_background=False)
    one, two = create_app(settings), create_app(settings)
    first, second = one.state.process, two.state.process
    assert isinstance(first, ProcessState) and isinstance(second, ProcessState)
    for part in ("jobs", "job_logs", "lifecycle", "fleet", "status", "measures"):
        assert getattr(first, part) is not getattr(second, part), part
    assert first.fleet.jobs is first.jobs and second.fleet.jobs is second.jobs

    job = _job("h:alice")
    first.jobs.register(job)
    try:
        assert len(first.jobs) == 1 and len(second.jobs) == 0 and job.board is first.jobs
        assert first.fleet.drained() is None and second.fleet.drained() is not None  # a drain waits for its own jobs
    finally:
        first.jobs.finish(job)
    assert len(first.jobs) == 0

    first.lifecycle.begin_shutdown(0.1)
    assert first.lifecycle.shutting_down and not second.lifecycle.shutting_down
    first.fleet.begin_drain()
    assert first.fleet.draining and not second.fleet.draining


def test_a_shutting_down_app_refuses_while_another_serves():
    """The lifecycle reaches the app's own guard: one app told to stop answers 503, the other still serves."""
    from fastapi.testclient import TestClient

    settings = Settings(default_models=[], prepare_in_background=False)
    stopping, serving = create_app(settings), create_app(settings)
    stopping.state.process.lifecycle.begin_shutdown(30.0)
    with TestClient(stopping) as a, TestClient(serving) as b:
        assert a.get("/api/health").status_code == 503
        assert b.get("/api/health").status_code == 200
        b.get("/api/health")
        metrics = b.get("/metrics").text
    assert 'attnlab_requests_total{status="200"} 2' in metrics  # its own counts, not the stopping app's 503
    assert dict(stopping.state.process.status.items()) == {503: 1}


def test_two_apps_learn_their_models_speed_apart():
    """The throughput fit and step times are keyed by model id: two apps serving different models as "lm" (tests do)
    must not estimate one from the other's runs. The app's runtime holds its ProcessState's measures."""
    from fastapi.testclient import TestClient

    settings = Settings(default_models=[], prepare_in_background=False)
    one, two = create_app(settings), create_app(settings)
    with TestClient(one), TestClient(two):
        assert one.state.runtime.measures is one.state.process.measures
        one.state.runtime.measures.throughput.set_rate("lm", 1.0)
        one.state.runtime.measures.steps.observe("lm", 2.0)
        assert one.state.process.measures.throughput.seconds("lm", 10.0, 1e9)[0] == 10.0  # at its 1 MAC/s
        assert two.state.process.measures.throughput.seconds("lm", 10.0, 1e9)[0] < 1e-6  # at the default it was given
        assert two.state.process.measures.steps.seconds("lm") is None


def test_the_signal_handling_finds_the_served_apps_state_through_uvicorns_wrapping():
    """serve.py's SIGTERM handling drains and stops the app uvicorn serves: it finds that app's ProcessState through the
    middleware uvicorn wraps it in (its real Config.load), and none before the app is loaded."""
    import uvicorn

    from app.serve import served_process

    app = create_app(Settings(default_models=[], prepare_in_background=False))
    config = uvicorn.Config(app, proxy_headers=True, log_level="critical")
    config.load()
    assert config.loaded_app is not app  # wrapped (proxy headers): the walk is needed
    assert served_process(config.loaded_app) is app.state.process
    assert served_process(None) is None
    assert served_process(object()) is None
