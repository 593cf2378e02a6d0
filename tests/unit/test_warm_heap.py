"""The warm heap (app/allocator.py WarmHeap, docs/deploy.md "Memory allocator"): once a reservation made on a thread
is mapped and freed by the warm heap's own thread, a run's new buffers on that thread find their pages mapped, so the
kernel's first-touch faults are not paid inside the forward; and the periodic malloc_trim leaves that free memory
alone. Each case runs in a fresh interpreter: mallopt's thresholds
and the heap's state belong to the process."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from app.allocator import _glibc

ROOT = Path(__file__).resolve().parents[2]
PAGES = 8 * 2**20 // 4096  # the buffer below: 8 MiB, about one minilm 128-token run's kept bytes

SCRIPT = r"""
import json, resource, sys, threading, time
import torch
from app.allocator import WarmHeap, _glibc
from app.allocator import MallocTrimmer

torch.set_num_threads(1)
warm = WarmHeap(32 * 2**20, _glibc())  # the thresholds in both cases: only the top-up differs
out = {}

def run():
    if sys.argv[1] == "warm":
        warm.reserve()  # this thread's arena; mapped and freed by the warm heap's own thread
        deadline = time.monotonic() + 30
        while warm.top_ups < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buffer = torch.empty(8 * 2**20 // 4, dtype=torch.float32).fill_(1.0)  # a run's kept buffer, first written
    out["faults"] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    del buffer

worker = threading.Thread(target=run)
worker.start(); worker.join()
trimmer = MallocTrimmer(0.05, keep_free_bytes=int(sys.argv[2]))
trimmer.start()
time.sleep(0.5)
out.update(trims=trimmer.calls, skipped=trimmer.skipped, mapped=warm.mapped_pages)
print(json.dumps(out))
"""


def run_case(case: str, keep_free_bytes: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MALLOC_ARENA_MAX": "2"}
    done = subprocess.run([sys.executable, "-c", SCRIPT, case, str(keep_free_bytes)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


pytestmark = pytest.mark.skipif(_glibc() is None, reason="glibc's malloc only")


def test_a_reservation_takes_the_next_buffers_page_faults_and_the_trimmer_keeps_it():
    warm = run_case("warm", keep_free_bytes=128 * 2**20)
    assert warm["mapped"] >= PAGES, warm  # the top-up mapped at least the buffer's worth
    assert warm["faults"] < 0.1 * PAGES, warm  # and the buffer found it mapped
    assert warm["trims"] == 0 and warm["skipped"] >= 1, warm  # ≤ 128 MiB free: left as it is


def test_without_one_each_page_is_a_fault_and_more_free_memory_is_trimmed():
    cold = run_case("cold", keep_free_bytes=2**20)
    assert cold["mapped"] == 0, cold
    assert cold["faults"] > 0.6 * PAGES, cold  # the measure the warm case passes can fail (~1,850 here; some pages
    # of the heap were mapped by imports already)
    assert cold["trims"] >= 1, cold  # more than 1 MiB free (the freed buffer): trimmed as before
