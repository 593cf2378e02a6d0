"""The first view's tensor work runs at its own thread count on the request's thread (app/attention.py
threads_on_this_thread) without changing the count other threads start with: torch.set_num_threads also sets the
process's default, which a thread reads at its first parallel op (a server's worker thread started meanwhile would
keep one thread for every later run)."""
from __future__ import annotations

import re
import threading

import pytest
import torch

from app.attention import _thread_controls, threads_on_this_thread


def mkl_threads_here() -> int:
    """MKL's thread count as the calling thread sees it (what its matrix products use)."""
    found = re.search(r"mkl_get_max_threads\(\) : (\d+)", torch.__config__.parallel_info())
    if found is None:
        pytest.skip("this torch has no MKL")
    return int(found.group(1))


@pytest.fixture
def two_threads():
    if _thread_controls() is None:
        pytest.skip("this torch build exposes no per-thread OpenMP/MKL settings")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def counts_in_a_new_thread() -> tuple[int, int]:
    seen = []
    worker = threading.Thread(target=lambda: seen.append((torch.get_num_threads(), mkl_threads_here())))
    worker.start()
    worker.join()
    return seen[0]


def test_one_thread_here_while_a_thread_started_meanwhile_gets_the_process_default(two_threads):
    with threads_on_this_thread(1):
        assert torch.get_num_threads() == 1 and mkl_threads_here() == 1  # this thread's parallel regions and products
        assert counts_in_a_new_thread() == (2, 2)  # a worker started now keeps the process's two
    assert torch.get_num_threads() == 2 and mkl_threads_here() == 2  # and this thread's count came back


def test_zero_leaves_the_count(two_threads):
    with threads_on_this_thread(0):
        assert torch.get_num_threads() == 2


def test_one_thread_holds_on_a_thread_new_to_torch(two_threads):
    """On a thread that has run no torch work yet (the run store's writer, a fresh worker), the count set stays through
    its first parallel op: torch's lazy per-thread init would otherwise reset it to the process's two."""
    get_omp = _thread_controls()[0]
    strided = torch.randn(1, 512, 12, 64).transpose(1, 2)  # copied in parallel: over torch's grain size
    seen = []

    def work() -> None:
        with threads_on_this_thread(1):
            strided.contiguous()
            seen.append(get_omp())

    worker = threading.Thread(target=work)
    worker.start()
    worker.join()
    assert seen == [1]


def test_a_fresh_run_gives_its_thread_count_to_its_first_view(tiny_bert, monkeypatch):
    """The run decides its thread count from /proc (app/costs.py); its first view, a moment later, takes that count
    instead of reading /proc again. A decision older than THREADS_DECIDED_S is taken again."""
    from types import SimpleNamespace

    from app.costs import CPU_SHARE
    from app.pipeline.views import response_threads
    from app.runtime import Runtime
    from app.settings import Settings
    from models.adapters.bert import BertAdapter

    runtime = Runtime(Settings(default_models=[], request_timeout_s=30, single_thread_max_tokens=0))
    adapter = BertAdapter("tiny", str(tiny_bert), max_tokens=64, device="cpu")
    asked = []
    measure = CPU_SHARE.threads_for
    monkeypatch.setattr(CPU_SHARE, "threads_for", lambda threads: asked.append(threads) or measure(threads))
    result = runtime.run(adapter, adapter.encode("the model reads every token of this sentence"), (), False)
    threads, _ = result.threads_decided
    assert len(asked) == 1 and threads >= 1  # the run read /proc once
    job = SimpleNamespace(runtime=runtime)
    asked.clear()
    assert response_threads(job, result) == threads
    assert asked == []  # the run's decision, not a second read
    monkeypatch.setattr("app.pipeline.views.THREADS_DECIDED_S", 0.0)
    assert response_threads(job, result) >= 1
    assert len(asked) == 1  # too old: decided again
