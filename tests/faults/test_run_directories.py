"""The run store's disk tier on a real server (app/runstore.py): its directory goes when the server stops, and a
server killed before it could remove it (SIGKILL, the OOM killer) has it removed by the next one. Before this, every
stopped test server left its attnlab-runs-* directory behind: about 35 GB in a day filled the CI machine's disk."""
from __future__ import annotations

import time

import httpx

from tests.faults.conftest import text_models


def _spilled_directory(server, tmp_path, text: str):
    """A view on a server whose RAM tier holds nothing: its run goes to the disk tier. → that server's directory."""
    response = httpx.post(server.base + "/api/text/attention", json={"text": text, "model": "tiny"}, timeout=60)
    assert response.status_code == 200, response.text
    end = time.monotonic() + 30
    while time.monotonic() < end:
        for folder in tmp_path.glob("runs/attnlab-runs-*"):
            if any(folder.glob("*.safetensors")) and (folder / "owner").read_text().split()[1] == str(server.proc.pid):
                return folder
        time.sleep(0.1)
    raise AssertionError(f"no run file written by pid {server.proc.pid}:\n{server.log()}")


def test_a_stopped_server_removes_its_runs_and_a_killed_ones_are_swept(tiny_bert, start_server, tmp_path):
    # two servers, not three: the successor that sweeps the killed one's directory is the one stopped with SIGTERM
    settings = {**text_models(tiny_bert), "result_cache_bytes": 1, "run_store_dir": str(tmp_path / "runs")}
    killed = start_server(settings)
    killed.wait_ready()
    left = _spilled_directory(killed, tmp_path, "this server is killed before it can clean up")
    killed.proc.kill()
    killed.proc.wait()
    assert left.exists()  # nothing ran in the killed process

    successor = start_server(settings)
    successor.wait_ready()
    own = _spilled_directory(successor, tmp_path, "the next server sweeps what the killed one left")
    assert not left.exists() and own.exists()
    assert "left behind by a process that is gone" in successor.log()
    assert successor.stop() == 0
    assert not own.exists(), "SIGTERM left the disk tier's directory behind"
