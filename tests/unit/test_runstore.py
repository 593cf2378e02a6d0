"""The run store's tiers (app/runstore.py, issue 36 §1): runs that leave RAM go to local disk and come back
memory-mapped, exactly as kept (short runs' P, long runs' q̂/k̂ and summaries, hidden states, outputs, dtypes); pinned
runs move to disk rather than being dropped or blocking memory; the disk tier keeps its own budget; a run a job holds
is never dropped; a dropped run's id is remembered as expired (a bounded set), one never held is unknown."""
from __future__ import annotations

import dataclasses
import gc
import json
import math
import os
import threading
import time

import numpy as np
import pytest
import torch
from safetensors import safe_open

import app.runstore as runstore
import app.runstore_disk as runstore_disk
from app import runfile
from app.memory import MemoryBudget
from app.runstore import ResultCache
from models.adapters.causal_lm import CausalLMAdapter
from models.atlas import full_row_entropy, window
from models.interventions import Intervention
from tests.tiny_models import build_image_model, build_text_model

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


# ---- the file format: every kind of run, tensors and JSON only (app/runfile.py) ------------------------------------
def _same(a, b, where: str = "run") -> None:
    """`b` (read back) equals `a` (as kept): same types, tensors of the same dtype, shape and values (NaN where NaN),
    objects attribute by attribute (those a run forms again when asked, runfile.SKIPPED, aside)."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        torch.testing.assert_close(b, a.cpu(), rtol=0, atol=0, equal_nan=True, msg=where)
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b, equal_nan=a.dtype.kind == "f"), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            _same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    elif type(a).__name__ in runfile.CLASSES:
        _same({k: v for k, v in vars(a).items() if k not in runfile.SKIPPED},
              {k: v for k, v in vars(b).items() if k not in runfile.SKIPPED}, where)
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), where
    else:
        assert a == b, where


def _kind(name: str, tmp_path):
    """(adapter, encoded, interventions, record_scores) of one kind of run the suite makes."""
    from PIL import Image

    from models.adapters.bert import BertAdapter
    from models.adapters.seq2seq import Seq2SeqAdapter
    from models.adapters.vit import VitAdapter

    perturb = (Intervention("perturb_keys", noise_std=0.5, seed=3, layers=(1,)), Intervention("mask_keys", tokens=(1,)),
               Intervention("temperature", beta=0.5, heads=(0, 2)))
    family = name.split("-")[0]
    if family in ("lm", "continuation"):
        dtype = "bfloat16" if "bf16" in name else "float32"
        adapter = CausalLMAdapter("tiny-llama", str(build_text_model("llama", tmp_path / "llama")), device="cpu",
                                  dtype=dtype)
        encoded = adapter.at_position(adapter.encode(TEXT), None)
        if family == "continuation":  # prompt + continuation ids, as app/routes/text.py keeps each side
            encoded = adapter.encode_ids(encoded.inputs["input_ids"][0].tolist() + [5, 9, 11])
    elif family == "bert":
        adapter = BertAdapter("tiny-bert", str(build_text_model("bert", tmp_path / "bert")), device="cpu")
        encoded = adapter.encode(TEXT)
    elif family == "seq2seq":
        adapter = Seq2SeqAdapter("tiny-bart", str(build_text_model("bart", tmp_path / "bart")), device="cpu")
        encoded = adapter.encode(TEXT, "the dog ran")
        perturb = perturb[1:]
    else:
        adapter = VitAdapter("tiny-vit", str(build_image_model("vit", tmp_path / "vit")), device="cpu")
        encoded = adapter.encode(Image.linear_gradient("L").convert("RGB").resize((48, 40)), "gradient", image_size=48)
        perturb = (Intervention("mask_keys", tokens=(2, 3)), Intervention("causal", layers=(0,)))
    adapter.full_map_tokens = 8 if "long" in name else 512
    adapter.atlas_config = dataclasses.replace(adapter.atlas_config, block_rows=4, overview_blocks=6)
    return adapter, encoded, perturb, "short" in name


KINDS = ["lm-short", "lm-long", "lm-bf16-long", "continuation-long", "bert-short", "seq2seq-short", "seq2seq-long",
         "image-short", "image-long"]


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_of_run_reads_back_equal_from_its_file(kind, tmp_path):
    """Short text (P, q̂/k̂ with scores, pending records with their interventions, pending dead-row counts), long text
    with an atlas (records, summaries), bfloat16 q̂/k̂, a continuation, an encoder, an encoder–decoder (P per kind),
    an image (patch positions in the atlas config): the run read back from disk equals the run written, field by
    field, in the dtypes it kept."""
    adapter, encoded, interventions, scores = _kind(kind, tmp_path)
    result = adapter.run(encoded, interventions, scores)
    result.run_id, result.model_id, result.elapsed_s = "r", "tiny", 0.25
    result.derived["thumbnails24"] = {"dtype": "uint8", "shape": [2, 4], "data": "AAE=", "max": [0.5, float("nan")]}
    result.derived["n_positions"], result.derived["grid"] = np.int64(7), np.arange(6.0).reshape(2, 3)
    assert result.is_long == ("long" in kind)
    if "bf16" in kind:
        assert result.atlas.records[0].queries.dtype == torch.bfloat16
    store = _store(tmp_path, ram=1)
    store.put(("k",), result, "me")
    assert store.flush(timeout=60) and store.stats()["disk_runs"] == 1
    back = store.by_run_id("r")
    assert back is not result
    _same(result, back)
    path = next(iter(store._disk.values())).path
    with safe_open(str(path), "pt") as opened:  # a plain safetensors file: its tensors and a JSON header
        names = list(opened.keys())
        meta = json.loads(opened.metadata()[runfile.META_KEY])
    assert len(names) >= 3 and meta["format"] == runfile.FORMAT
    assert str(path) in open("/proc/self/maps").read()  # read memory-mapped
    store.close()


def test_a_run_file_names_data_never_code(llama, tmp_path):
    """The reader builds only a run's own classes: a file naming any other class (a pickle's way to run code) is
    refused, and the file holds no pickle opcodes."""
    result = _run(llama, "r", True)
    made = runfile.encode(result)
    path = tmp_path / "run.safetensors"
    runfile.write(made, path)
    assert runfile.read(path).tokens == result.tokens
    data = path.read_bytes()
    assert b"\x80\x04\x95" not in data and b"\x80\x02" not in data[:64]  # no pickle protocol header
    forged = data.replace(b'\\"class\\":\\"Atlas\\"', b'\\"class\\":\\"Popen\\"')
    assert forged != data
    path.write_bytes(forged)
    with pytest.raises(KeyError):
        runfile.read(path)
    with pytest.raises(TypeError, match="cannot hold"):
        runfile.encode(dataclasses.replace(result, derived={"x": object()}))


# ---- the writer thread: no disk write in the request's thread -------------------------------------------------------
def test_put_leaves_the_file_to_the_writer_thread(llama, tmp_path, monkeypatch):
    """A run leaving RAM is written by the store's writer thread, never by the thread that put the run that made it
    leave (a request's); meanwhile it answers from RAM, its bytes still booked there."""
    writers, release = [], threading.Event()
    real_write = runfile.write

    def slow_write(run_file, path):  # the real write, after `release`: the test sees the run while it is written
        writers.append(threading.current_thread())
        release.wait(30)
        return real_write(run_file, path)

    monkeypatch.setattr(runfile, "write", slow_write)
    first, second = _run(llama, "a", True), _run(llama, "b", True)
    store = _store(tmp_path, ram=first.nbytes + second.nbytes // 2)
    store.put(("a",), first, "me")
    store.put(("b",), second, "me")  # "a" leaves RAM: queued for the writer, put returns at once
    assert store.by_run_id("a") is first  # from RAM while its file is written
    assert store.host_bytes == first.nbytes + second.nbytes and store.stats()["writing_runs"] == 1
    release.set()
    assert store.flush(timeout=60)
    assert writers and all(t is not threading.current_thread() for t in writers)
    assert store.host_bytes == second.nbytes and store.stats()["disk_runs"] == 1
    back = store.by_run_id("a")
    assert back is not first and torch.equal(back.hidden_states, first.hidden_states)
    store.close()


def test_a_put_waits_only_for_a_place_in_the_bounded_queue(llama, tmp_path, monkeypatch):
    """With the writer stuck, `write_queue` runs wait in its queue (and one in its hands); the next run that must leave
    RAM makes its put wait for a place, and no longer once the writer moves on. A run dropped while queued leaves no
    file."""
    release = threading.Event()
    real_write = runfile.write
    monkeypatch.setattr(runfile, "write", lambda run_file, path: (release.wait(30), real_write(run_file, path))[1])
    runs = [_run(llama, f"r{i}", True) for i in range(4)]
    store = ResultCache(max_items=64, max_bytes=1, pin_s=60, disk_bytes=2**30, disk_dir=str(tmp_path),
                        write_queue=1)  # every run leaves RAM at once
    store.put((0,), runs[0], "me")  # in the writer's hands
    store.put((1,), runs[1], "me")  # in the queue (1 place)
    third = threading.Thread(target=store.put, args=((2,), runs[2], "me"))
    third.start()
    third.join(0.5)
    assert third.is_alive()  # waiting for a place in the queue, not for a write of its own
    assert all(store.by_run_id(f"r{i}") is runs[i] for i in range(3))  # all readable from RAM meanwhile
    release.set()
    third.join(30)
    assert not third.is_alive() and store.flush(timeout=60)
    assert store.stats()["disk_runs"] == 3 and store.host_bytes == 0
    release.clear()
    store.put((3,), runs[3], "me")
    with store._lock:
        store._drop((3,))  # dropped while its write waits: its booking goes at once, its file never stays
    release.set()
    assert store.flush(timeout=60) and store.why_missing("r3") == "expired"
    assert len(list(tmp_path.glob("attnlab-runs-*/*.safetensors"))) == 3
    store.close()


def test_the_writer_thread_stops_with_the_store(llama, tmp_path):
    store = _store(tmp_path, ram=1)
    store.put(("k",), _run(llama, "k", True), "me")
    thread = store._resources.thread
    assert thread is not None and thread.is_alive()
    store.close()
    assert not thread.is_alive()
    collected = _store(tmp_path, ram=1)  # a store that is only let go of (an app's runtime dropped in a test)
    collected.put(("k",), _run(llama, "k2", True), "me")
    assert collected.flush(timeout=60)
    thread, folder = collected._resources.thread, collected._dir
    del collected
    gc.collect()
    thread.join(30)
    assert not thread.is_alive() and not folder.exists()


def test_a_disk_that_is_nearly_full_is_left_its_free_space(llama, tmp_path):
    """The filesystem's free space beyond disk_min_free caps the tier (a full disk fails everyone's writes): with
    none to spare, a run leaving RAM is kept in RAM while pinned and dropped once not, as with the tier full."""
    import shutil

    free = shutil.disk_usage(tmp_path).free
    pinned = ResultCache(max_items=64, max_bytes=1, pin_s=60, disk_bytes=2**40, disk_dir=str(tmp_path),
                         disk_min_free=free + 2**30)
    pinned.put(("a",), _run(llama, "a", True), "me")
    assert pinned.flush(timeout=60) and pinned.disk_bytes == 0 and pinned.spills == 0
    assert pinned.by_run_id("a") is not None
    loose = ResultCache(max_items=64, max_bytes=1, pin_s=0, disk_bytes=2**40, disk_dir=str(tmp_path),
                        disk_min_free=free + 2**30)
    loose.put(("a",), _run(llama, "a", True), "me")
    assert loose.flush(timeout=60) and loose.by_run_id("a") is None and loose.why_missing("a") == "expired"
    # with room to spare the same run goes to disk
    roomy = ResultCache(max_items=64, max_bytes=1, pin_s=60, disk_bytes=2**40, disk_dir=str(tmp_path),
                        disk_min_free=0)
    roomy.put(("a",), _run(llama, "a", True), "me")
    assert roomy.flush(timeout=60) and roomy.spills == 1 and roomy.disk_bytes > 0


def _owner_of(process) -> str:
    return f"{runstore._boot_id()} {process.pid} {runstore._start_time(process.pid)}"


def test_directories_left_by_dead_processes_are_swept(llama, tmp_path):
    """A killed server leaves its directory (nothing else removes it: gigabytes a day on a test machine). The next
    store to make one in the same parent removes those whose process is gone, and no other."""
    import os
    import subprocess

    live = subprocess.Popen(["sleep", "60"])
    dead = subprocess.Popen(["sleep", "60"])
    try:
        owners = {"live": _owner_of(live), "dead": _owner_of(dead), "other-boot": f"x {live.pid} 1",
                  "reused-pid": f"{runstore._boot_id()} {live.pid} 1", "garbled": "not an owner"}
        dead.kill()
        dead.wait()
        for name, owner in owners.items():
            folder = tmp_path / f"attnlab-runs-{name}"
            folder.mkdir()
            (folder / "owner").write_text(owner)
            (folder / "r.safetensors").write_bytes(b"x" * 1000)
        young, old = tmp_path / "attnlab-runs-young-no-owner", tmp_path / "attnlab-runs-old-no-owner"
        young.mkdir(), old.mkdir()
        os.utime(old, (time.time() - 2 * runstore.ORPHAN_AGE_S,) * 2)
        unrelated = tmp_path / "something-else"
        unrelated.mkdir()
        store = _store(tmp_path, ram=1)
        store.put(("k",), _run(llama, "k", True), "me")  # its first write makes its directory, sweeping first
        assert store.flush(timeout=60)
        left = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("attnlab-runs-"))
        mine = store._dir.name
        assert left == sorted(["attnlab-runs-live", "attnlab-runs-young-no-owner", mine])
        assert unrelated.exists()
        assert (store._dir / "owner").read_text() == runstore._owner()
        # a second store in the same process never sweeps the first's live directory
        other = _store(tmp_path, ram=1)
        other.put(("k",), _run(llama, "k", True), "me")
        assert other.flush(timeout=60) and store._dir.exists() and store.by_run_id("k") is not None
    finally:
        live.kill()
        live.wait()


def test_a_hard_exit_removes_this_process_directories(llama, tmp_path):
    store = _store(tmp_path, ram=1)
    store.put(("k",), _run(llama, "k", True), "me")
    assert store.flush(timeout=60)
    folder = store._dir
    assert folder.exists()
    runstore.remove_directories()  # what app/serve.py calls before os._exit
    assert not folder.exists() and folder not in runstore._LIVE_DIRS
    store.close()  # and closing after it is harmless


def test_the_writer_thread_starts_no_openmp_team(llama, tmp_path):
    """The writer's torch work runs on its own thread alone: writing a run whose tensors must be made contiguous starts
    no OpenMP helper thread. One would put the process over its cores in OpenMP threads, and GNU OpenMP then spins
    far less before sleeping: every forward's threads slept and woke at each parallel region (first_view.md)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # a new thread's default: what a served process has on 2 cores
    try:
        result = _run(llama, "wide", True)
        # a non-contiguous tensor big enough for torch's copy to go parallel (over its grain of 32,768 elements), laid
        # out as a recorded q̂ is: (B, T, H, d) seen as (B, H, T, d)
        result.hidden_states = torch.randn(1, 512, 12, 64).transpose(1, 2)
        before = set(os.listdir("/proc/self/task"))
        store = _store(tmp_path, ram=1)  # the run leaves RAM at once: the writer thread writes it
        store.put(("k",), result, "me")
        assert store.flush(timeout=60)
        new = set(os.listdir("/proc/self/task")) - before
        writer = store._resources.thread
        assert writer is not None and writer.is_alive()
        assert new == {str(writer.native_id)}, f"threads started besides the writer: {sorted(new)}"
        assert torch.equal(store.by_run_id("wide").hidden_states, result.hidden_states)
        store.close()
    finally:
        torch.set_num_threads(threads)


def _leaving_run(llama, tmp_path):
    """A store whose second put sends the first run to the writer."""
    first, second = _run(llama, "a", True), _run(llama, "b", True)
    store = _store(tmp_path, ram=first.nbytes + second.nbytes // 2)
    store.put(("a",), first, "me")
    store.put(("b",), second, "me")
    return store


def _disk_runs_within(store: ResultCache, seconds: float) -> int:
    deadline = time.monotonic() + seconds
    while store.stats()["disk_runs"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    return store.stats()["disk_runs"]


def test_a_write_waits_until_no_request_is_at_work(llama, tmp_path, monkeypatch):
    """A run leaving RAM is written when no API POST is in flight (its file's CPU time does not land on a view's
    response), and after WRITE_DEFER_S however busy the server is."""
    from app.in_flight import API_POSTS

    monkeypatch.setattr(runstore_disk, "WRITE_DEFER_S", 30.0)
    API_POSTS.entered()
    try:
        store = _leaving_run(llama, tmp_path)
        assert _disk_runs_within(store, 0.5) == 0 and store.stats()["writing_runs"] == 1  # a request is at work
    finally:
        API_POSTS.left()
    assert _disk_runs_within(store, 5) == 1  # written as soon as it ended
    store.close()
    monkeypatch.setattr(runstore_disk, "WRITE_DEFER_S", 0.3)
    API_POSTS.entered()
    try:
        store = _leaving_run(llama, tmp_path)
        started = time.monotonic()
        assert _disk_runs_within(store, 10) == 1 and time.monotonic() - started >= 0.25  # written after the wait
    finally:
        API_POSTS.left()
    store.close()


@pytest.mark.parametrize("awaited_by", ["flush", "evict_for"])
def test_an_awaited_write_does_not_wait_for_requests(llama, tmp_path, monkeypatch, awaited_by):
    """A write someone waits for (the memory accountant making room for a request, flush) is written at once, even while
    requests are in flight: the request waiting for memory is one of them."""
    from app.in_flight import API_POSTS

    monkeypatch.setattr(runstore_disk, "WRITE_DEFER_S", 30.0)
    API_POSTS.entered()
    try:
        store = _leaving_run(llama, tmp_path)
        started = time.monotonic()
        if awaited_by == "flush":
            assert store.flush(timeout=10)
        else:
            assert store.evict_for(store.host_bytes, "me") > 0  # "b" too goes to disk, and "a"'s file is awaited
        assert time.monotonic() - started < 5 and store.stats()["disk_runs"] >= 1
    finally:
        API_POSTS.left()
    store.close()


def test_a_put_waiting_for_a_place_in_the_queue_does_not_wait_for_requests(llama, tmp_path, monkeypatch):
    """A full queue of writes is awaited by the put that found it full, itself inside a request: the writer does not wait
    for the requests to end (they would not, while this one waits)."""
    from app.in_flight import API_POSTS

    monkeypatch.setattr(runstore_disk, "WRITE_DEFER_S", 30.0)
    runs = [_run(llama, f"r{i}", True) for i in range(3)]
    store = ResultCache(max_items=64, max_bytes=1, pin_s=60, disk_bytes=2**30, disk_dir=str(tmp_path), write_queue=1)
    API_POSTS.entered()
    try:
        started = time.monotonic()
        for i, run in enumerate(runs):  # every run leaves RAM at once: the third finds the queue full
            store.put((i,), run, "me")
        assert time.monotonic() - started < 5 and store.flush(timeout=10)
        assert store.stats()["disk_runs"] == 3
    finally:
        API_POSTS.left()
    store.close()


def test_a_promised_run_is_made_once_on_first_use_and_old_promises_expire(tmp_path, llama, monkeypatch):
    """ResultCache.promise (a continuation's kept runs): nothing is made until the id is asked for; concurrent first
    uses make it once; it is then kept under its key; past PROMISES the oldest promise's id says expired."""
    store = _store(tmp_path, ram=2**30)
    made = []
    started = threading.Event()

    def make():
        made.append(1)
        started.wait(5)  # the second caller arrives while the first is making it
        result = _run(llama, "r.promised", long=False)
        store.put(("k",), result)
        return result

    store.promise("r.promised", ("k",), make)
    assert not made and store.why_missing("r.promised") == "unknown"
    answers = []
    threads = [threading.Thread(target=lambda: answers.append(store.by_run_id("r.promised"))) for _ in range(2)]
    for thread in threads:
        thread.start()
    started.set()
    for thread in threads:
        thread.join(10)
    assert len(made) == 1 and len(answers) == 2 and all(a is not None and a.run_id == "r.promised" for a in answers)
    assert store.by_run_id("r.promised") is answers[0] and len(made) == 1
    monkeypatch.setattr(runstore, "PROMISES", 2)
    for i in range(3):
        store.promise(f"r.p{i}", (f"p{i}",), make)
    assert store.why_missing("r.p0") == "expired" and store.by_run_id("r.p0") is None and len(made) == 1
    store.close()


def test_a_long_string_of_a_run_is_kept_as_bytes_not_escaped_in_the_header(llama, tmp_path):
    """A run's thumbnails are a base64 string of every head's levels (55 kB for minilm): kept as a U8 entry of the
    file, it reads back equal (non-ASCII too) and the header stays small (escaped twice in the header, it cost the
    request that evicted its run 1.2 ms)."""
    result = _run(llama, "r", True)
    long_text = "é∑" + "A/+=" * 5000
    result = dataclasses.replace(result, derived={**result.derived, "thumbnails24": {"data": long_text, "max": [0.5]},
                                                  "short": "x" * 10})
    made = runfile.encode(result)
    assert len(made.header) < 10_000 and long_text.encode() not in made.header
    path = tmp_path / "run.safetensors"
    runfile.write(made, path)
    back = runfile.read(path)
    assert back.derived["thumbnails24"] == {"data": long_text, "max": [0.5]} and back.derived["short"] == "x" * 10


def test_a_kept_run_is_measured_again_while_it_is_handed_out_and_settles_when_it_is_not(llama, tmp_path):
    """A run that grows while a request holds it (q̂ stacked beside the records' own tensors) counts its new bytes at
    the next put; a run the store alone holds is not measured at every put (64 runs measured each time were ~1 ms of
    every fresh view)."""
    store = _store(tmp_path, ram=2**30)
    llama.full_map_tokens = 512
    with_scores = llama.run(llama.encode(TEXT), (), True)  # q̂/k̂ recorded: per layer, stacked when first read
    store.put(("a",), with_scores)
    del with_scores
    store.put(("b",), _run(llama, "b", False))  # "a": measured while only the store held it
    assert ("a",) in store._settled and ("b",) not in store._settled  # the putter held "b" then
    before = store.host_bytes
    held = store.get(("a",))
    assert ("a",) not in store._settled
    grew = held.queries.numel() * held.queries.element_size()  # stacked when first read: new memory
    assert grew > 0
    store.put(("c",), _run(llama, "c", False))
    assert store.host_bytes - before >= grew  # noticed although "a" was settled before it was handed out
    assert ("a",) not in store._settled  # still held here: measured again at the next put
    del held
    gc.collect()
    store.put(("d",), _run(llama, "d", False))
    assert ("a",) in store._settled and ("b",) in store._settled and ("c",) in store._settled
    store.close()
