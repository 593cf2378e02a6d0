"""One OpenMP team at a time (app/openmp_teams.py): the thread that did a plain request's work ends its OpenMP team
at the end of that work when another model request is in flight, and keeps it when its request is alone; a job's
thread ends its team as it hands the model to interactive work.

Counted in a fresh interpreter, by the process's threads (/proc/self/task): a thread that runs torch work on two
threads starts a team with one helper thread, and ending the team ends that helper."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from app.attention import _pause_openmp

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, os, threading, time
import torch
from app.attention import threads_on_this_thread
from app.openmp_teams import MODEL_REQUESTS, TeamStats, job_hands_over_team, plain_work_done

def threads():
    time.sleep(0.05)  # an ended helper thread leaves /proc a moment after it returns
    return len(os.listdir("/proc/self/task"))

def parallel_work():  # an elementwise op torch splits over its threads, and a matrix product
    with threads_on_this_thread(2):
        torch.ones(1 << 21).exp_()
        a = torch.ones(256, 256)
        (a @ a).sum()

seen = {}
def request_thread():
    seen["start"] = threads()
    parallel_work()
    seen["with_team"] = threads()
    MODEL_REQUESTS.entered()  # this request, alone in flight
    seen["alone_released"] = plain_work_done()
    seen["alone"] = threads()
    MODEL_REQUESTS.entered()  # a second one
    TeamStats.enabled = False
    seen["off_released"] = plain_work_done()
    seen["off"] = threads()
    TeamStats.enabled = True
    seen["shared_released"] = plain_work_done()
    seen["shared"] = threads()
    parallel_work()
    seen["next_work"] = threads()
    seen["job_released"] = job_hands_over_team()  # as a job's thread between two layers
    seen["job_handed_over"] = threads()
    seen["released"] = TeamStats.released

worker = threading.Thread(target=request_thread)
worker.start()
worker.join()
print(json.dumps(seen))
"""


@pytest.mark.skipif(_pause_openmp() is None, reason="this torch's OpenMP has no omp_pause_resource_all")
def test_a_team_ends_only_when_other_model_work_would_run_beside_it():
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "2"})
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["with_team"] == seen["start"] + 1, seen  # two-thread work: one helper thread
    assert not seen["alone_released"] and seen["alone"] == seen["with_team"], seen  # one client keeps its team
    assert not seen["off_released"] and seen["off"] == seen["with_team"], seen  # openmp_one_team off
    assert seen["shared_released"] and seen["shared"] == seen["start"], seen  # another in flight: the helper ended
    assert seen["next_work"] == seen["start"] + 1, seen  # the next work on the thread starts a team again
    assert seen["job_released"] and seen["job_handed_over"] == seen["start"], seen  # a job handing over
    assert seen["released"] == 2, seen
