"""The run store's tiers (app/runstore.py, issue 36 §1): runs that leave RAM go to local disk and come back
memory-mapped, exactly as kept (short runs' P, long runs' q̂/k̂ and summaries, hidden states, outputs, dtypes); pinned
runs move to disk rather than being dropped or blocking memory; the disk tier keeps its own budget; a run a job holds
is never dropped; a dropped run's id is remembered as expired (a bounded set), one never held is unknown."""
from __future__ import annotations

import dataclasses
import time

import pytest
import torch

import app.runstore as runstore
from app.memory import MemoryBudget
from app.runstore import ResultCache
from models.adapters.causal_lm import CausalLMAdapter
from models.atlas import full_row_entropy, window
from models.interventions import Intervention
from tests.tiny_models import build_text_model

TEXT = "the cat sat on the mat because it was tired , the dog ran on the street"


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> CausalLMAdapter:
    return CausalLMAdapter("tiny-llama", str(build_text_model("llama", tmp_path_factory.mktemp("llama"))))


def _run(adapter: CausalLMAdapter, run_id: str, long: bool, interventions=()):
    """A kept run as the runtime makes it: long (over full_map_tokens: q̂/k̂ and summaries) or short (P kept)."""
    adapter.full_map_tokens = 8 if long else 512
    adapter.atlas_config = dataclasses.replace(adapter.atlas_config, block_rows=4, overview_blocks=6)
    result = adapter.run(adapter.encode(TEXT), interventions, False)
    result.run_id, result.model_id = run_id, "tiny-llama"
    assert result.is_long == long
    return result


def _store(tmp_path, ram: int, disk: int = 2**30, pin_s: float = 60.0, items: int = 64) -> ResultCache:
    return ResultCache(max_items=items, max_bytes=ram, pin_s=pin_s, disk_bytes=disk, disk_dir=str(tmp_path))


def _windows_equal(a, b) -> None:
    n = a.atlas.records[0].queries.shape[1]
    for layer in range(a.atlas.n_layers):
        for head in range(a.atlas.records[layer].queries.shape[0]):
            ra, rb = a.atlas.record(layer), b.atlas.record(layer)
            assert torch.equal(window(ra, head, (2, n), (0, n), None), window(rb, head, (2, n), (0, n), None))
            assert torch.equal(full_row_entropy(ra, [head], 0, n, None, 4), full_row_entropy(rb, [head], 0, n, None, 4))


@pytest.mark.parametrize("long", [True, False], ids=["long", "short"])
def test_a_run_spilled_to_disk_comes_back_exactly_and_memory_mapped(llama, tmp_path, long):
    result = _run(llama, "r1", long, (Intervention("mask_keys", tokens=(1, 2)),))
    store = _store(tmp_path, ram=1)  # nothing fits in RAM: the run goes straight to disk
    store.put(("k",), result, "me")
    assert store.flush(timeout=60)  # the file is written by the store's writer thread
    assert store.host_bytes == 0 and store.disk_bytes > 0 and store.stats()["disk_runs"] == 1
    back = store.by_run_id("r1")
    assert back is not None and back is not result and back.run_id == "r1" and back.model_id == "tiny-llama"
    assert back.hidden_states.dtype == result.hidden_states.dtype and torch.equal(back.hidden_states, result.hidden_states)
    assert all(torch.equal(back.output[k], v) for k, v in result.output.items())
    assert back.tokens == result.tokens and back.warnings == result.warnings
    if long:
        assert back.kept_attention is None
        assert torch.equal(back.atlas.entropy(), result.atlas.entropy())
        assert torch.equal(back.atlas.overview([0, 1], [0, 1, 2, 3]), result.atlas.overview([0, 1], [0, 1, 2, 3]))
    else:
        assert torch.equal(back.kept_attention, result.kept_attention)
    _windows_equal(back, result)
    # memory-mapped: the tensors' storage is the file, not a copy in anonymous memory
    path = next(iter(store._disk.values())).path
    maps = open("/proc/self/maps").read()
    assert str(path) in maps
    assert store.get(("k",)) is back  # the compute path finds it too (on a CPU: the mapped run itself)


def test_pinned_runs_go_to_disk_instead_of_staying_over_the_ram_budget(llama, tmp_path):
    first, second = _run(llama, "a", True), _run(llama, "b", True)
    store = _store(tmp_path, ram=first.nbytes + second.nbytes // 2)
    store.put(("a",), first, "client-1")
    store.put(("b",), second, "client-2")  # both pinned; RAM holds one: the older goes to disk
    assert store.flush(timeout=60)
    assert store.host_bytes == second.nbytes and store.disk_bytes > 0
    assert store.by_run_id("a") is not None and store.by_run_id("b") is second
    # without a disk tier the pinned run stayed in RAM, over the budget (the accountant counted it)
    old = _store(tmp_path, ram=first.nbytes + second.nbytes // 2, disk=0)
    old.put(("a",), first, "client-1")
    old.put(("b",), second, "client-2")
    assert old.host_bytes == first.nbytes + second.nbytes and old.disk_bytes == 0


def test_making_room_for_new_work_moves_any_clients_pinned_runs_to_disk(llama, tmp_path):
    """The memory accountant's evict_for: pinned bytes on disk no longer block memory, and nothing is lost."""
    theirs = _run(llama, "theirs", True)
    store = _store(tmp_path, ram=10 * theirs.nbytes)
    store.put(("theirs",), theirs, "them")
    budget = MemoryBudget(budget_bytes=2**30, reserved_bytes=0, cache=store, measure_rss=False)
    assert budget.used_bytes() == theirs.nbytes
    assert store.evict_for(1, "me") == theirs.nbytes  # another client's pinned run: to disk
    assert budget.used_bytes() == 0 and store.by_run_id("theirs") is not None


def test_the_disk_tier_has_its_own_budget(llama, tmp_path):
    runs = [_run(llama, f"r{i}", True) for i in range(3)]
    scratch = _store(tmp_path, ram=1)
    scratch.put(("scratch",), runs[0], "me")
    assert scratch.flush(timeout=60)
    size = scratch.disk_bytes  # one run's file (a tiny run's file is mostly the archive's own headers)
    scratch.close()
    store = _store(tmp_path, ram=1, disk=int(2.5 * size), pin_s=0)  # unpinned at once; room on disk for two
    for i, run in enumerate(runs):
        store.put((i,), run, "me")
    assert store.disk_bytes <= int(2.5 * size) and store.flush(timeout=60)
    assert store.by_run_id("r0") is None and store.why_missing("r0") == "expired"  # the least recently used went
    assert store.by_run_id("r1") is not None and store.by_run_id("r2") is not None
    assert len(list(tmp_path.glob("attnlab-runs-*/*.safetensors"))) == 2  # its file went with it
    # pinned runs fill the disk: a pinned run that must leave RAM stays there instead of being dropped
    pinned = _store(tmp_path, ram=runs[0].nbytes + runs[0].nbytes // 2, disk=int(1.5 * size), pin_s=60)
    for i, run in enumerate(runs):
        pinned.put((i,), run, "me")
    assert pinned.flush(timeout=60)
    assert all(pinned.by_run_id(f"r{i}") is not None for i in range(3))
    assert pinned.disk_bytes <= int(1.5 * size)
    # a run larger than the whole disk tier and the RAM tier (the API refuses it first: 413) stays in RAM while it
    # is pinned, and goes once it is not: its id then says expired, never a 500
    tiny = _store(tmp_path, ram=1, disk=size // 2)
    tiny.put(("big",), _run(llama, "big", True), "me")
    assert tiny.flush(timeout=60) and tiny.by_run_id("big") is not None and tiny.disk_bytes == 0
    loose = _store(tmp_path, ram=1, disk=size // 2, pin_s=0)
    loose.put(("big",), _run(llama, "big", True), "me")
    assert loose.flush(timeout=60) and loose.by_run_id("big") is None and loose.why_missing("big") == "expired"


def test_expired_and_unknown_ids_and_a_bounded_memory_of_them(llama, tmp_path, monkeypatch):
    monkeypatch.setattr(runstore, "FORGET_AFTER", 2)
    store = _store(tmp_path, ram=2**30, disk=0, pin_s=0, items=1)  # no disk tier, one run in RAM at most
    for i in range(4):
        store.put((i,), _run(llama, f"r{i}", False), "me")
    assert store.by_run_id("r3") is not None
    assert store.why_missing("r2") == "expired" and store.why_missing("r1") == "expired"
    assert store.why_missing("r0") == "unknown"  # forgotten: the set of expired ids is bounded
    assert store.why_missing("never") == "unknown"


def test_a_run_a_job_holds_is_never_dropped(llama, tmp_path):
    """A compare's kept base, counted as done when the job was accepted, stays until the job has read it: without a
    disk tier an unpinned run is dropped for the next put, unless held; with one it moves to disk."""
    base, run = _run(llama, "base", True), _run(llama, "run", True, (Intervention("mask_keys", tokens=(1,)),))
    for disk in (0, 2**30):
        store = _store(tmp_path, ram=base.nbytes + run.nbytes // 2, disk=disk, pin_s=0)
        store.put(("base",), base, "me")
        with store.holding([("base",), ("run",)]):
            store.put(("run",), run, "me")
            assert store.evict_for(10 * base.nbytes, "me") >= (base.nbytes if disk else 0)
            assert store.get(("base",)) is not None and store.by_run_id("run") is not None
        if not disk:
            store.put(("other",), _run(llama, "other", True), "me")  # released: unpinned runs make room again
            assert store.by_run_id("base") is None and store.why_missing("base") == "expired"


def test_the_disk_tier_directory_is_removed_on_close(llama, tmp_path):
    store = _store(tmp_path, ram=1)
    store.put(("k",), _run(llama, "k", True), "me")
    assert store.flush(timeout=60)
    folders = list(tmp_path.glob("attnlab-runs-*"))
    assert len(folders) == 1 and any(folders[0].iterdir())
    store.close()
    assert not folders[0].exists() and store.disk_bytes == 0 and store.why_missing("k") == "expired"


def test_a_pin_ends(llama, tmp_path):
    store = _store(tmp_path, ram=1, disk=2**30, pin_s=0.2)
    result = _run(llama, "p", True)
    store.put(("p",), result, "me")
    assert store._pinned(("p",), time.monotonic())
    time.sleep(0.3)
    assert not store._pinned(("p",), time.monotonic()) and store.by_run_id("p") is not None  # on disk still
