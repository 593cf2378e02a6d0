"""Which models a preparation (`attnlab prepare`) is working on, in small files beside the weights, so that a server
started meanwhile (`make run` serves while dinov2-small, whisper-tiny-en and gemma3-270m are prepared) can say so.

weights/.preparing/<id>.json holds {"state": "preparing", "pid", "since", "log"} while a model is prepared (or queued
for it), {"state": "failed", "error", "log"} after its preparation failed, and is removed when the model's folder is
in place. A preparation writes the model into weights/<id>.tmp and moves the finished folder into place with one
rename (replace_folder below: attnlab_prepare.install_folder, models/gguf.install,
models/weights_cache.py), so a reader sees a model whole or not at all.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

STATE_DIR = ".preparing"  # under the weights folder
RETRY_AFTER_S = 10  # what a request for a model being prepared is told to wait (Retry-After)


def state_file(weights_dir: str | Path, model_id: str) -> Path:
    return Path(weights_dir) / STATE_DIR / f"{model_id}.json"


def log_file(weights_dir: str | Path, model_id: str) -> Path:
    """Where a background preparation's output goes (app/preparation.py)."""
    return Path(weights_dir) / STATE_DIR / f"{model_id}.log"


def mark(weights_dir: str | Path, model_id: str, state: str, *, pid: int | None = None, log: str | None = None,
         error: str | None = None) -> None:
    """Record `state` ("preparing" or "failed") for `model_id`, written whole (a temporary file, then a rename)."""
    path = state_file(weights_dir, model_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"state": state, "pid": pid if pid is not None else os.getpid(), "since": time.time(), "log": log,
              "error": error}
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(record) + "\n")
    os.replace(tmp, path)


def replace_folder(tmp: Path, out: Path) -> None:
    """`tmp` (finished) becomes `out` by renames: an old `out` is moved aside first and removed after, so `out` is at
    every moment the old folder whole, absent, or the new one whole (a server reads it while `make run` prepares)."""
    old = out.with_name(f".{out.name}.old")
    if old.exists():
        shutil.rmtree(old)
    if out.exists():
        out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)


def clear(weights_dir: str | Path, model_id: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        state_file(weights_dir, model_id).unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def read(weights_dir: str | Path, model_id: str) -> dict | None:
    """{"state": "preparing" | "failed", "since", "log", "error"} for `model_id`, or None when no preparation of it
    is recorded. A "preparing" record whose process has ended (killed, or the machine restarted) reads as failed."""
    try:
        record = json.loads(state_file(weights_dir, model_id).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("state") not in ("preparing", "failed"):
        return None
    pid = record.get("pid")
    if record["state"] == "preparing" and isinstance(pid, int) and not _alive(pid):
        record = {**record, "state": "failed",
                  "error": f"its preparation (process {pid}) ended before the model was in place"}
    return record


@contextlib.contextmanager
def preparing(weights_dir: str | Path, model_id: str) -> Iterator[None]:
    """Around one model's preparation in this process: "preparing" while it runs, "failed" with the reason when it
    raises (also on Ctrl-C), nothing once it is done. ATTNLAB_PREPARE_LOG names the log a server reads it from."""
    log = os.environ.get("ATTNLAB_PREPARE_LOG") or None
    mark(weights_dir, model_id, "preparing", log=log)
    try:
        yield
    except BaseException as exc:
        reason = str(exc) if not isinstance(exc, KeyboardInterrupt) else "interrupted (Ctrl-C)"
        mark(weights_dir, model_id, "failed", log=log, error=f"{type(exc).__name__}: {reason}"[:500])
        raise
    clear(weights_dir, model_id)


def sha256_file(path: str | Path) -> str:
    """The SHA-256 of a file, read 1 MiB at a time (sources of a preparation: up to a few GB)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


class SourceHashes:
    """One preparation's SHA-256 of each source file, each file read once: the weights cache's key and the
    prepared.json record (and an up-to-date check by content) share it. Kept for one preparation only, so a file
    rewritten between two preparations is read again (its mtime alone may not show a quick rewrite)."""

    def __init__(self) -> None:
        self._digests: dict[Path, str] = {}

    def __call__(self, path: str | Path) -> str:
        path = Path(path)
        if path not in self._digests:
            self._digests[path] = sha256_file(path)
        return self._digests[path]


# The models a server loads at start (app/settings.py `default_models`): here, so that attnlab_prepare.py reads the same
# list without importing app/ (it runs at setup, below the server).
DEFAULT_MODELS = ("minilm", "smollm2-135m")
DEFAULT_MODELS_ENV = "ATTNLAB_DEFAULT_MODELS"


def default_models(environ: dict[str, str] | None = None) -> list[str]:
    """The server's default_models as its settings read them: the environment variable ATTNLAB_DEFAULT_MODELS (its
    name in any case, as pydantic-settings matches it) holding a JSON list of ids, else DEFAULT_MODELS."""
    environ = os.environ if environ is None else environ
    found = [value for name, value in environ.items() if name.upper() == DEFAULT_MODELS_ENV]
    if not found:
        return list(DEFAULT_MODELS)
    try:
        value = json.loads(found[-1])
    except ValueError:
        value = None
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise ValueError(f"{DEFAULT_MODELS_ENV} must be a JSON list of model ids, e.g. '[\"minilm\"]' "
                         f"(got {found[-1][:80]!r})")
    return value
