"""The default models' preparation beside a serving server (ATTNLAB_PREPARE_IN_BACKGROUND, set by `make run`).

`make run` prepares what the server loads at start (`attnlab prepare --served`) and starts the server; the server
then runs `attnlab prepare --model <id>` for each default model not prepared yet (dinov2-small, whisper-tiny-en,
gemma3-270m on a fresh machine), in two lanes as `make weights` does: the GGUF models in one, the rest in the other.
Meanwhile a request for such a model gets 503 with Retry-After, and GET /api/models lists it under `not_ready`
(models/preparing.py holds the state, in files the preparation writes). A finished model loads on first use; a failed
one is logged here with its log file and listed as failed. The preparations end with the server: it stops them at
shutdown, Ctrl-C reaches them too (same process group), and each ends by itself when the server dies
(attnlab_prepare's parent-death signal).
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from models import preparing
from models.registry import prepared_check

log = logging.getLogger("attnlab")

_RUNNING: list["BackgroundPreparation"] = []  # stopped by stop_all() when the process ends (app/serve.py)


class BackgroundPreparation:
    """Lanes of model ids, each prepared one after the other by an `attnlab prepare` child process."""

    def __init__(self, weights_dir: str | Path, lanes: list[list[str]]):
        self.weights_dir = Path(weights_dir)
        self.lanes = [lane for lane in lanes if lane]
        self._children: set[subprocess.Popen] = set()
        self._lock = threading.Lock()
        self._stopping = False
        self.threads: list[threading.Thread] = []

    def start(self) -> None:
        for model_id in (m for lane in self.lanes for m in lane if not prepared(self.weights_dir, m)):
            # queued: listed as being prepared from now on (a model already there is only checked to be up to date)
            preparing.mark(self.weights_dir, model_id, "preparing", log=str(preparing.log_file(self.weights_dir,
                                                                                                 model_id)))
        _RUNNING.append(self)
        for lane in self.lanes:
            thread = threading.Thread(target=self._run_lane, args=(lane,), name=f"prepare-{lane[0]}", daemon=True)
            self.threads.append(thread)
            thread.start()

    def _run_lane(self, lane: list[str]) -> None:
        for model_id in lane:
            if self._stopping:
                if not prepared(self.weights_dir, model_id):
                    preparing.mark(self.weights_dir, model_id, "failed", error="the server stopped before its turn")
                continue
            self._prepare(model_id)

    def _prepare(self, model_id: str) -> None:
        log_path = preparing.log_file(self.weights_dir, model_id)
        command = [sys.executable, "-m", "attnlab_prepare", "--weights-dir", str(self.weights_dir), "--model", model_id]
        env = {**os.environ, "ATTNLAB_PREPARE_PARENT": str(os.getpid()), "ATTNLAB_PREPARE_LOG": str(log_path)}
        started, was_there = time.monotonic(), prepared(self.weights_dir, model_id)
        log.info("%s %s in the background (log: %s)", "checking" if was_there else "preparing", model_id, log_path)
        with open(log_path, "wb") as output:
            with self._lock:
                if self._stopping:
                    return
                child = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT,
                                         env=env)
                self._children.add(child)
            code = child.wait()
        with self._lock:
            self._children.discard(child)
        if prepared(self.weights_dir, model_id):  # in place (its process may have been stopped just after)
            preparing.clear(self.weights_dir, model_id)
            log.info("%s %s in %.0f s; it loads on first use", model_id, "checked" if was_there else "prepared",
                     time.monotonic() - started)
            return
        state = preparing.read(self.weights_dir, model_id)
        if state is None or state["state"] != "failed":  # ended without saying why (killed): say it for it
            preparing.mark(self.weights_dir, model_id, "failed", log=str(log_path),
                           error=f"attnlab prepare exited with status {code}")
        if not self._stopping:
            log.error("preparing %s failed (exit status %s): %s; see %s", model_id, code,
                      (preparing.read(self.weights_dir, model_id) or {}).get("error"), log_path)

    def stop(self, wait_s: float = 5.0) -> None:
        """End the preparations still running (SIGTERM, then SIGKILL after `wait_s`)."""
        with self._lock:
            self._stopping = True
            children = list(self._children)
        for child in children:
            child.terminate()
        deadline = time.monotonic() + wait_s
        for child in children:
            try:
                child.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        if self in _RUNNING:
            _RUNNING.remove(self)


def default_lanes(served: list[str]) -> list[list[str]]:
    """The default preparation's models other than those the server loads at start (`make run` prepared them first):
    GGUF models in one lane, the others in a second. One already prepared is only checked to be up to date (~1 s)."""
    from attnlab_prepare import DEFAULT_PREPARED
    from models.gguf import SOURCES

    rest = [m for m in DEFAULT_PREPARED if m not in served]
    return [[m for m in rest if m in SOURCES], [m for m in rest if m not in SOURCES]]


def prepared(weights_dir: str | Path, model_id: str) -> bool:
    """Whether a model's weights are in place: the registry's check (ModelSpec.prepared), the one the server's
    refusals and listings use, so the two never disagree."""
    check = prepared_check(weights_dir, model_id)
    return check is not None and check()


def start_background(weights_dir: str | Path, served: list[str]) -> BackgroundPreparation | None:
    lanes = default_lanes(served)
    if not any(lanes):
        return None
    background = BackgroundPreparation(weights_dir, lanes)
    background.start()
    return background


def stop_all() -> None:
    for background in list(_RUNNING):
        background.stop()
